"""Saving only some rows during training: `save_rows` and the strategies (`saver`), the HF Trainer
callback (`hf`), and a run folder's saves (`run_saves`: what to resume from).

Its public API is importable from here (`from tailor_tui.selective import save_rows`), each name
found in its module when first used: importing the package imports neither torch nor transformers.
"""

from tailor_tui import moved

_SAVER, _HF, _RUN_SAVES = (f"{__name__}.{m}" for m in ("saver", "hf", "run_saves"))
_PUBLIC = {**dict.fromkeys(("save_rows", "SelectiveSaver", "Parity", "Filter", "model_rows", "row_naming",
                            "partial_name"), _SAVER),
           **dict.fromkeys(("SelectiveCheckpointCallback", "StaleStartError"), _HF),
           **dict.fromkeys(("resume_point", "Save"), _RUN_SAVES)}

__all__ = sorted(_PUBLIC)
__getattr__ = moved.names(__name__, {}, public=_PUBLIC)
