"""A composition exported as a plain HF model folder: what is read from where and written where
(`export_plan`), a source rank's share (`rank`), the folder as a whole (`export_run`).

Its public API, importable from here and found in `export_run` when first used: `run_export`,
`ExportResult`.
"""

from tailor_tui import moved

_RUN = f"{__name__}.export_run"
_PUBLIC = dict.fromkeys(("run_export", "ExportResult"), _RUN)

__all__ = sorted(_PUBLIC)
__getattr__ = moved.names(__name__, {}, public=_PUBLIC)
