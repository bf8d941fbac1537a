"""Loading checkpoint pickles without ever running code hidden in them.

Every torch.load in tailor-tui goes through `load_pt`: `weights_only=True`, plus an
allow-list of exactly the DeepSpeed classes a ZeRO-3 checkpoint legitimately holds.
`mmap=True` maps tensors lazily, so reading one slice of a rank file touches only
the pages of that slice (MAP_PRIVATE: nothing we do in memory reaches the file).
"""

from __future__ import annotations

import os
import pickle
import re
import zipfile
from pathlib import Path

from .errors import CheckpointError

_ALLOWED: list | None = None


def allowed_globals() -> list:
    """The DeepSpeed classes that appear in optim_states files."""
    global _ALLOWED
    if _ALLOWED is None:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
        from deepspeed.runtime.zero.config import ZeroStageEnum

        _ALLOWED = [ZeroStageEnum, LossScaler, DynamicLossScaler]
    return _ALLOWED


def refused(path: Path, exc: Exception) -> CheckpointError:
    """The error for a pickle that names a global outside the allow-list."""
    found = re.search(r"GLOBAL ([\w.]+)", str(exc))
    what = found.group(1) if found else "an object"
    return CheckpointError(
        f"{path}: refused to load: it holds {what}, which is not one of the DeepSpeed "
        "checkpoint classes tailor-tui allows; it may be unsafe to open (it could run code)"
    )


def load_pt(path: Path, mmap: bool = True):
    """torch.load a checkpoint file safely, or raise CheckpointError naming it."""
    import torch

    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: file is missing; the checkpoint is incomplete")
    if not zipfile.is_zipfile(path):
        raise CheckpointError(
            f"{path}: not a readable torch checkpoint (truncated or corrupt?); "
            "re-copy it from the training run"
        )
    try:
        with torch.serialization.safe_globals(allowed_globals()):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as exc:
        raise refused(path, exc) from None
    except (RuntimeError, OSError, EOFError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(
            f"{path}: cannot be read ({first[:200]}); the file may be truncated or corrupt"
        ) from None
