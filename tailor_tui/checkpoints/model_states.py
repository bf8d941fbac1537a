"""What a checkpoint takes from its rank-0 model_states file: DeepSpeed release, step, ZeRO layout,
rows (with their tied names) and precision. Read without torch (tensors as stand-ins); cached by
`scan_cache`.
"""

from __future__ import annotations

from pathlib import Path

from tailor_tui.checkpoints.layout import ZeroLayout
from tailor_tui.checkpoints.rows import Row, model_rows
from tailor_tui.checkpoints.scan_cache import ModelStates
from tailor_tui.errors import CheckpointError
from tailor_tui.formats.ds_format import (
    BUFFER_NAMES,
    DS_CONFIG,
    DS_VERSION,
    GLOBAL_STEPS,
    MODULE,
    SHARED_PARAMS,
    unsupported_version,
)
from tailor_tui.formats.ptfile import Unsupported, read_structure
from tailor_tui.formats.safe_load import load_pt


def read_metadata(path: Path) -> dict:
    """A model_states file's structure, read without torch (tensors as TensorRef)."""
    if not path.is_file():
        raise CheckpointError(f"{path}: file is missing; the checkpoint is incomplete")
    try:
        obj, _records, _prefix = read_structure(path)
    except Unsupported:
        return load_pt(path)  # an archive layout the light reader does not know: let torch read it
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path}: not a DeepSpeed model_states file")
    return obj


def read_model_states(path: Path) -> ModelStates:
    """What a checkpoint takes from its rank-0 model_states file `path`, read (no cache), or
    CheckpointError saying why it cannot be used."""
    states = read_metadata(path)
    ds_version = states.get(DS_VERSION)
    ds_version = ds_version if isinstance(ds_version, str) else ""  # absent: rewritten by another tool
    check_version(path, ds_version)
    try:
        layout = ZeroLayout.from_model_states(states)
    except (KeyError, TypeError, AttributeError, ValueError):
        raise CheckpointError(
            f"{path}: not a ZeRO stage 3 model_states file "
            "(no param_shapes / dp_world_size); tailor-tui composes ZeRO-3 checkpoints only"
        ) from None
    return ModelStates(ds_version, int(states.get(GLOBAL_STEPS) or 0), layout, _rows(states, layout),
                       _precision(states, layout))


def check_version(path: Path, ds_version: str) -> None:
    why = unsupported_version(ds_version)
    if why:
        raise CheckpointError(f"{path}: cannot be read: {why}")


def _precision(states: dict, layout: ZeroLayout) -> str:
    """"fp16" or "fp32", as a model_states file tells it."""
    config = states.get(DS_CONFIG)
    if isinstance(config, dict):  # the config the training script passed, as a dict
        fp16 = config.get("fp16")
        return "fp16" if isinstance(fp16, dict) and fp16.get("enabled") is True else "fp32"
    # The config was passed as a file path (ds_config is that str) or on the command line
    # (None): the dtype of the 16-bit parameter placeholders DeepSpeed saves tells instead.
    module = states.get(MODULE) or {}
    for name in layout.param_names():
        found = _element_type(module.get(name))
        if found in ("HalfStorage", "float16"):
            return "fp16"
        if found is not None:
            return "fp32"
    return "fp32"


def _element_type(tensor) -> str | None:
    """A saved tensor's element type: its storage type (torch-free reader) or torch dtype."""
    type_name = getattr(getattr(tensor, "storage", None), "type_name", None)
    if isinstance(type_name, str):
        return type_name
    dtype = getattr(tensor, "dtype", None)
    return str(dtype).removeprefix("torch.") if dtype is not None else None


def _rows(states: dict, layout: ZeroLayout) -> tuple[Row, ...]:
    """Rows in model order (the module state_dict's order), each with what it owns
    (`rows.model_rows`); names tied to a parameter are DeepSpeed's `shared_params`, or else the
    module's entries that share a parameter's storage."""
    params = layout.param_names()
    module = states.get(MODULE) or {}
    buffers = [b for b in (states.get(BUFFER_NAMES) or ()) if isinstance(b, str) and b in module]  # persistent ones
    shared = states.get(SHARED_PARAMS)
    aliases = {k: v for k, v in shared.items() if isinstance(k, str) and isinstance(v, str)} \
        if isinstance(shared, dict) else {}
    if not aliases:
        storage = {_storage_key(module.get(p)): p for p in params if _storage_key(module.get(p)) is not None}
        aliases = {n: storage[_storage_key(t)] for n, t in module.items()
                   if n not in storage.values() and _storage_key(t) in storage}
    known = set(params) | set(buffers)
    aliases = {n: p for n, p in aliases.items() if n not in known and p in known}
    return model_rows(params, buffers, aliases, [n for n in module if isinstance(n, str)])


def _storage_key(tensor) -> str | None:
    """The archive record a saved tensor's storage is (torch-free reader), to tell tied names."""
    key = getattr(getattr(tensor, "storage", None), "key", None)
    return key if isinstance(key, str) else None
