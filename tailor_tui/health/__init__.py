"""Row health: statistics per rank and per run (`stats_job`, `stats_rank`, `stats_run`), the
healing rule and training logs (`healing`), and the NaN guard of `--apply` (`guard`).

Its public API, importable from here and found in `healing` when first used: `Health`, `Healing`,
`heal`, `TrainingLog`, `training_log`, `why_unhealthy`.
"""

from tailor_tui import moved

_HEALING = f"{__name__}.healing"
_PUBLIC = dict.fromkeys(("Health", "Healing", "heal", "TrainingLog", "training_log", "why_unhealthy"), _HEALING)

__all__ = sorted(_PUBLIC)
__getattr__ = moved.names(__name__, {}, public=_PUBLIC)
