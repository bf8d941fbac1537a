"""Loading checkpoint pickles without ever running code hidden in them.

Every torch.load in tailor-tui goes through `load_pt`: `weights_only=True`, plus an
allow-list of exactly the DeepSpeed classes a ZeRO-3 checkpoint legitimately holds
(`ds_format.DEEPSPEED_CLASSES`). Files in torch's zip format are memory-mapped
(`mmap=True` maps tensors lazily, so reading one slice of a rank file touches only the
pages of that slice; MAP_PRIVATE: nothing we do in memory reaches the file). Files in
torch's legacy (non-zip) format cannot be mapped: they are read whole.
"""

from __future__ import annotations

import importlib
import os
import pickle
from pathlib import Path

from tailor_tui.errors import RECOPY, CheckpointError
from tailor_tui.formats.ds_format import DEEPSPEED_CLASSES, enum_member_value
from tailor_tui.formats.ptfile import (
    Unsupported,
    check_complete,
    check_crcs,
    file_format,
    read_structure,
    refused,
)


def allowed_globals() -> list:
    """The DeepSpeed classes that checkpoint files pickle, imported from the installed DeepSpeed, and
    `getattr` as early Python 3.11 releases pickle an enum member by name (`enum_member`)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    classes = [getattr(importlib.import_module(module), name) for module, name in DEEPSPEED_CLASSES]
    return [*classes, (enum_member, "builtins.getattr")]


def enum_member(cls, name):
    """`getattr(cls, name)` for torch.load: the member `name` of an allowed DeepSpeed enumeration, by the
    rule the torch-free reader applies (`ds_format.enum_member_value`); anything else is refused."""
    enum_member_value(getattr(cls, "__module__", ""), getattr(cls, "__qualname__", ""), name)
    return cls[name]


def load_pt(path: Path, mmap: bool = True, *, unread: frozenset = frozenset()):
    """torch.load a checkpoint file safely, or raise CheckpointError naming it. `unread`: names
    of records whose tensors the caller never touches through torch (mapped, a zip-format
    file's are never read) and checks itself as it streams them: their CRC-32 is not checked
    here, so a multi-GB rank file is not read just to load its structure."""
    import torch

    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: file is missing; the checkpoint is incomplete")
    try:  # the torch-free reader's rules first (allow-list, bounds, completeness), in either format
        read_structure(path)
    except Unsupported:
        check_complete(path)
    fmt = file_format(path)
    check_crcs(path, skip=unread if mmap and fmt == "zip" else frozenset())  # torch.load does not check them
    try:
        with torch.serialization.safe_globals(allowed_globals()):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap and fmt == "zip")
    except pickle.UnpicklingError as exc:
        raise refused(path, exc) from None
    except (RuntimeError, OSError, EOFError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        what = "zip-format" if fmt == "zip" else "legacy-format (non-zip)"
        raise CheckpointError(
            f"{path}: a {what} torch file that cannot be read ({first[:200]}); "
            f"it may be truncated or corrupt, {RECOPY}"
        ) from None
