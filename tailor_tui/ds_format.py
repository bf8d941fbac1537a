"""What DeepSpeed ZeRO-3 checkpoints hold, release by release, and which releases tailor-tui reads.

Named once here, used by the torch-free reader (`pickled`), the torch reader
(`safe_load`) and the checkpoint reader (`checkpoint`). Found by generating a real
run with each release (tests/test_compat.py) and by reading each release's save
path (`DeepSpeedEngine._save_checkpoint`, `_save_zero_checkpoint`,
`DeepSpeedZeroOptimizer_Stage3._rigid_state_dict`).

What differs between the releases tailor-tui reads:

- `sparse_tensor_module_names` (a Python `set`, pickled as `__builtin__.set`) is in
  model_states up to 0.18.x; 0.19 no longer saves it. tailor-tui does not use it.
- 0.19 adds the parallel-dims metadata to model_states and `ds_zero_partition_groups`
  to the optimizer state; both are carried over from the base unread.
- `ds_config` is whatever the training script passed as its config: usually a dict,
  but a path (str) or None when the config came from a file or the command line; the
  precision is then read from the checkpoint's own tensors (`checkpoint._dtype`).
- The fp16 loss scaler (`DynamicLossScaler`) keeps its `dtype`, a `torch.float16` in
  every release; bf16 and fp32 runs pickle the static `LossScaler`.
- `checkpoint_serialization: false` (0.17 and later) makes DeepSpeed write every `.pt`
  file in torch's legacy (non-zip) format; LLMTailor writes optim files that way too.
"""

from __future__ import annotations

import io
import pickletools
import re

# The releases whose checkpoints tailor-tui reads: from OLDEST up to, not including, BEYOND.
OLDEST = (0, 14, 0)
BEYOND = (0, 20, 0)
SUPPORTED = "DeepSpeed 0.14.0 to 0.19.x"

# Every class a ZeRO-3 checkpoint of a supported release pickles, as (module, name). None has
# moved between 0.14.0 and 0.19.x. Only these are ever resolved, and only to inert stand-ins
# (torch-free reader) or by torch.load(weights_only=True) with exactly these allowed.
DEEPSPEED_CLASSES = (
    ("deepspeed.runtime.zero.config", "ZeroStageEnum"),  # optim: zero_stage
    ("deepspeed.runtime.fp16.loss_scaler", "LossScaler"),  # optim: static scaler (bf16, fp32)
    ("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler"),  # optim: fp16's scaler
)

# Keys of a model_states file that tailor-tui reads (the rest is carried over unread).
PARAM_SHAPES = "param_shapes"
FROZEN_PARAM_SHAPES = "frozen_param_shapes"
FROZEN_PARAM_FRAGMENTS = "frozen_param_fragments"
DP_WORLD_SIZE = "dp_world_size"
BUFFER_NAMES = "buffer_names"
MODULE = "module"
GLOBAL_STEPS = "global_steps"
DS_CONFIG = "ds_config"
DS_VERSION = "ds_version"


def parse_version(text: str) -> tuple[int, int, int] | None:
    """(major, minor, patch) of a DeepSpeed version string such as `0.16.9` or
    `0.17.1+a1b2c3`, or None when it is not one."""
    found = re.match(r"\s*(\d+)\.(\d+)\.(\d+)", text or "")
    return tuple(int(x) for x in found.groups()) if found else None


def unsupported_version(ds_version: str) -> str | None:
    """Why checkpoints of `ds_version` are not read (one phrase), or None if they are.

    An empty or unparsable version (a checkpoint rewritten by another tool) is read: its
    structure is checked field by field anyway."""
    version = parse_version(ds_version)
    if version is None:
        return None
    if version < OLDEST:
        return (f"it was written by DeepSpeed {ds_version}, older than tailor-tui reads ({SUPPORTED}); "
                "its ZeRO-3 layout is not checked against that release")
    if version >= BEYOND:
        return (f"it was written by DeepSpeed {ds_version}, newer than this tailor-tui reads ({SUPPORTED}); "
                "upgrade tailor-tui")
    return None


def version_in_pickle(data: bytes) -> str | None:
    """The `ds_version` string in the pickles in `data` (one after another, as in a legacy
    torch file), read from their opcodes without unpickling them, for naming the release
    of a file that cannot be read; None if there is none."""
    stream, previous = io.BytesIO(data), None
    try:
        while stream.tell() < len(data):
            for opcode, arg, _pos in pickletools.genops(stream):
                if isinstance(arg, str):
                    if previous == DS_VERSION and opcode.name.endswith("UNICODE"):
                        return arg
                    previous = arg
                elif opcode.name not in ("BINPUT", "LONG_BINPUT", "MEMOIZE"):
                    previous = None
    except Exception:  # noqa: BLE001 - damaged, truncated, or storage bytes after the pickles
        return None
    return None
