"""The processes that do the work: the local worker pool (`workers`), launchers and the multi-node
team (`launch`, `meet`, `members`, `transaction`, `trust`, `progress`), and the composer's batch job
on a login node (`sbatch`).

Its public API, importable from here and found in its modules when first used: `Team`, `TeamError`,
`SOLO` (`members`) and `connect` (`meet`). The old module `tailor_tui.team`'s other names are old
paths (a DeprecationWarning names their module).
"""

from tailor_tui import moved

_MEMBERS = f"{__name__}.members"
_PUBLIC = {**dict.fromkeys(("Team", "TeamError", "SOLO"), _MEMBERS), "connect": f"{__name__}.meet"}

__all__ = sorted(_PUBLIC)
__getattr__ = moved.names(__name__, {}, public=_PUBLIC)
