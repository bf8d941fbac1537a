"""What DeepSpeed ZeRO-3 checkpoints hold, release by release, and which releases tailor-tui reads.

The checkpoint's vocabulary, named once (as DeepSpeed's `deepspeed/checkpoint/constants.py`
names it for DeepSpeed): file names, the keys of model_states and optim_states files,
the classes they pickle, and small accessors over the loaded structures. Torch-free; used
by the readers (`pickled`, `safe_load`, `checkpoint`), the writers and the verifier. Found by generating a real
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
  precision is then read from the checkpoint's own tensors (`checkpoint._precision`).
- The fp16 loss scaler (`DynamicLossScaler`) keeps its `dtype`, a `torch.float16` in
  every release; bf16 and fp32 runs pickle the static `LossScaler`.
- `checkpoint_serialization: false` (0.17 and later) makes DeepSpeed write every `.pt`
  file in torch's legacy (non-zip) format; LLMTailor writes optim files that way too.
"""

from __future__ import annotations

import math
import pickle
import re

from tailor_tui.errors import CheckpointError, IncompatibleError
from tailor_tui.formats.dtypes import STORAGE_DTYPE

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

# The enumerations among DEEPSPEED_CLASSES: each member's name and value (aliases, such as
# ZeroStageEnum.max_stage, are never pickled: a member pickles under its own name). Python pickles a
# member as `ZeroStageEnum(3)`, except early 3.11 releases (3.11.2, Debian 12's python3, is one), whose
# Enum.__reduce_ex__ pickles it by name: `getattr(ZeroStageEnum, 'weights')`, GLOBAL `__builtin__ getattr`.
ENUM_MEMBERS = {
    ("deepspeed.runtime.zero.config", "ZeroStageEnum"): {"disabled": 0, "optimizer_states": 1, "gradients": 2,
                                                          "weights": 3},
}


def enum_member_value(module: str, qualname: str, name) -> int:
    """The value of the member `name` of the DeepSpeed enumeration `module.qualname`: what the
    pickled call `getattr(that class, name)` stands for. The readers resolve `getattr` to this
    alone, so it is honoured exactly where Python uses it to pickle: a member of an allowed
    enumeration, by its name as a string. Anything else is refused (pickle.UnpicklingError)."""
    members = ENUM_MEMBERS.get((module, qualname))
    if members is None or type(name) is not str or name not in members:
        what = f"{module}.{qualname}" if members is not None else "something other than a DeepSpeed enumeration"
        raise pickle.UnpicklingError(f"getattr({what}, {str(name)[:40]!r}) is not a member of a DeepSpeed "
                                     "enumeration taken by its name; nothing else is looked up")
    return members[name]

# File names in a tag folder (rank r, model-parallel rank 0), and beside it in a save_dir.
MODEL_STATES = "zero_pp_rank_{rank}_mp_rank_00_model_states.pt"
OPTIM_STATES = "{prefix}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"  # prefix: "bf16_" or ""
RECOVERY_SCRIPTS = ("zero_to_fp32.py", "zero_to_torch.py")

# Keys of a model_states file that tailor-tui reads (the rest is carried over unread).
PARAM_SHAPES = "param_shapes"
FROZEN_PARAM_SHAPES = "frozen_param_shapes"
FROZEN_PARAM_FRAGMENTS = "frozen_param_fragments"
DP_WORLD_SIZE = "dp_world_size"
BUFFER_NAMES = "buffer_names"
SHARED_PARAMS = "shared_params"  # {state-dict name: the parameter it is tied to}
MODULE = "module"
GLOBAL_STEPS = "global_steps"
DS_CONFIG = "ds_config"
DS_VERSION = "ds_version"

# Keys of an optim_states file: {OPTIMIZER_STATE_DICT: {FP32_FLAT_GROUPS: [flat per sub-group],
# OPTIMIZER_STATE_DICT: {STATE: {group: {STEP, EXP_AVG, EXP_AVG_SQ}}, PARAM_GROUPS: [...]}, …}, …}
OPTIMIZER_STATE_DICT = "optimizer_state_dict"
FP32_FLAT_GROUPS = "fp32_flat_groups"
PARTITION_COUNT = "partition_count"  # ZeRO-3: the data-parallel world size (an int)
PARTITION_GROUPS = "ds_zero_partition_groups"  # 0.19: only with AutoEP expert groups
STATE = "state"
PARAM_GROUPS = "param_groups"
STEP = "step"
EXP_AVG = "exp_avg"
EXP_AVG_SQ = "exp_avg_sq"
MASTERS = "fp32"  # tailor-tui's name of the fp32 master weights' flat tensor (DeepSpeed's FP32_FLAT_GROUPS)
# Adam's state kept per element: the keys of a checkpoint written before tailor-tui read the state's keys from it
# (a partial save's rows file names its own), and the moments the health statistics read first
ADAM_STATE = (EXP_AVG, EXP_AVG_SQ)
# The flat tensors of every sub-group of an Adam run that a row's slices live in, by tailor-tui's names; a run of
# another optimizer has its own (`flat_keys`)
TENSORS = (MASTERS, *ADAM_STATE)

# What optimizers keep in their state of one flat partition (torch's, transformers' and bitsandbytes' names), to
# name the optimizer in a message: the sorted keys of its tensors (0-d ones, such as `step`, left out)
OPTIMIZERS = {ADAM_STATE: "Adam or AdamW", (EXP_AVG, EXP_AVG_SQ, "max_exp_avg_sq"): "AdamW with amsgrad",
              ("momentum_buffer",): "SGD with momentum", ("sum",): "Adagrad", ("square_avg",): "RMSprop",
              ("momentum_buffer", "square_avg"): "RMSprop with momentum", ("grad_avg", "square_avg"): "centered RMSprop",
              ("grad_avg", "momentum_buffer", "square_avg"): "centered RMSprop with momentum",
              (EXP_AVG,): "Lion, or Adafactor with momentum", (EXP_AVG_SQ,): "Adafactor",
              (EXP_AVG, EXP_AVG_SQ + "_col", EXP_AVG_SQ + "_row"): "factored Adafactor with momentum",
              (EXP_AVG_SQ + "_col", EXP_AVG_SQ + "_row"): "factored Adafactor", ("acc_delta", "square_avg"): "Adadelta",
              ("exp_inf",): "Adamax", ("qmap1", "state1"): "an 8-bit optimizer (bitsandbytes)",
              ("absmax1", "qmap1", "state1"): "an 8-bit optimizer (bitsandbytes)",
              ("qmap1", "qmap2", "state1", "state2"): "8-bit Adam (bitsandbytes)",
              ("absmax1", "absmax2", "qmap1", "qmap2", "state1", "state2"): "8-bit Adam (bitsandbytes)",
              (): "SGD without momentum"}
# Bounds on a sub-group's state as read from a file: the tensors it keeps (4 for AMSGrad, 6 for 8-bit Adam), the
# length of their names
MAX_STATES, MAX_NAME = 16, 64
# The states these keep per element: one of another size is damage, never another optimizer's
PER_ELEMENT_NAMES = frozenset({EXP_AVG, EXP_AVG_SQ, "max_exp_avg_sq", "momentum_buffer", "sum", "square_avg", "grad_avg",
                               "acc_delta", "exp_inf"})


# The state whose largest magnitude the health statistics show beside the masters' RMS (`v max`): the first of these
# an optimizer keeps (a second moment, else a momentum); its every state counted for NaN/Inf
HEALTH_STATE = (EXP_AVG_SQ, "square_avg", "sum", "max_exp_avg_sq", "momentum_buffer", EXP_AVG)


def health_state(keys) -> str | None:
    """The state of `keys` (an optimizer's state kept per element) the health statistics show the largest
    magnitude of (`HEALTH_STATE`), or None (SGD without momentum keeps none)."""
    return next((key for key in HEALTH_STATE if key in keys), None)


def per_element(value, size: int) -> bool:
    """Whether an optimizer-state entry of a sub-group of `size` elements is kept per element: a tensor (torch's,
    or as pickled: `pickled.TensorRef`) of at least one dimension and `size` elements, not a 0-d `step`."""
    shape = _shape(value)
    return shape is not None and len(shape) > 0 and math.prod(shape) == size


def _shape(value) -> tuple | None:
    """The shape of a tensor (torch's `torch.Size` is a tuple) or a pickled one (`pickled.TensorRef.size`); None:
    not a tensor."""
    shape = value.shape if hasattr(value, "shape") else getattr(value, "size", None)
    return tuple(shape) if isinstance(shape, tuple) else None


def _dtype(value) -> str:
    """`float32`, … of a torch tensor or a pickled one (a storage pickled without its type: taken as fp32)."""
    storage = getattr(value, "storage", None)
    name = getattr(storage, "type_name", None)
    if isinstance(name, str):
        return "float32" if name == "UntypedStorage" else STORAGE_DTYPE.get(name, name)
    return str(getattr(value, "dtype", "float32")).removeprefix("torch.")


def named_optimizer(keys) -> str:
    """' (the optimizer)' that keeps tensors `keys` in its state, where known; else ''."""
    named = OPTIMIZERS.get(tuple(sorted(keys)))
    return f" ({named})" if named else ""


def state_keys(inner: dict, path, group_sizes: tuple[int, ...]) -> tuple[str, ...]:
    """The keys of the optimizer state kept per element (sorted) of the inner optimizer dict of an optim_states
    file: on ZeRO-3's flat partitions, every state tensor of a sub-group's size (Adam's exp_avg and exp_avg_sq,
    AMSGrad's max_exp_avg_sq, SGD's momentum_buffer, Adagrad's sum, RMSprop's square_avg, …), each a row's slices
    like the fp32 masters'; every other entry (`step`, Adafactor's `RMS`: one per sub-group) is the base's.
    Refused in one line naming `path`: a state tensor that is not one fp32 value per element (a factored or
    block-wise state, an 8-bit one), which cannot be taken apart by row (IncompatibleError); sub-groups that
    keep different states, or a state of one of the optimizers above of another size (CheckpointError: damage)."""
    state = inner[OPTIMIZER_STATE_DICT][STATE]
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: its optimizer state is not a mapping; the file is corrupt or from another run")
    found: tuple[str, ...] | None = None
    for g, size in enumerate(group_sizes):
        entry = state.get(g, {})
        if not isinstance(entry, dict):
            raise CheckpointError(f"{path}: sub-group {g}'s optimizer state is not a mapping; the file is corrupt "
                                  "or from another run")
        tensors = {k: v for k, v in entry.items() if (shape := _shape(v)) is not None and len(shape) > 0}
        if len(tensors) > MAX_STATES or not all(type(k) is str and 0 < len(k) <= MAX_NAME for k in tensors):
            raise CheckpointError(f"{path}: sub-group {g}'s optimizer state holds {len(tensors)} tensors under keys "
                                  f"no optimizer uses (at most {MAX_STATES} names of at most {MAX_NAME} characters); "
                                  "the file is corrupt or crafted")
        for key, value in sorted(tensors.items()):
            if not per_element(value, size) and key in PER_ELEMENT_NAMES:
                raise CheckpointError(f"{path}: sub-group {g} {key} holds {math.prod(_shape(value) or ())} elements, "
                                      f"the layout says {size}; the file is truncated, corrupt or from another run")
            if not per_element(value, size):
                raise IncompatibleError(
                    f"{path}: its optimizer{named_optimizer(tensors)} keeps {key!r} of shape "
                    f"{list(_shape(value) or ())} for a sub-group of {size:,} elements, not one value per element (a "
                    "factored or block-wise state): it cannot be taken apart by row; compose checkpoints of an "
                    "optimizer whose state is per element (AdamW, SGD, Adagrad, RMSprop, Lion, unfactored Adafactor)")
            if (dtype := _dtype(value)) != "float32":
                raise IncompatibleError(
                    f"{path}: its optimizer{named_optimizer(tensors)} keeps {key!r} per element as {dtype}, not fp32 "
                    "(a quantized or low-precision state): tailor-tui composes fp32 optimizer states; compose checkpoints of an "
                    "optimizer that keeps them (AdamW, SGD, Adagrad, RMSprop, Lion, Adafactor)")
        keys = tuple(sorted(tensors))
        if found is not None and keys != found:
            raise CheckpointError(f"{path}: sub-group {g} keeps {_listed(keys)} per element, sub-group 0 "
                                  f"{_listed(found)}; the file is truncated, corrupt or from another run")
        found = keys
    return found or ()


def _listed(keys: tuple[str, ...]) -> str:
    return ", ".join(map(repr, keys)) or "nothing"


def describe_state(keys: tuple[str, ...]) -> str:
    """How a message names an optimizer state kept per element (`state_keys`): its keys and the optimizer."""
    return _listed(keys) + named_optimizer(keys)


def bytes_per_element(keys: tuple[str, ...]) -> int:
    """The bytes of a rank's files per element of its flat sub-groups: 4 per flat tensor of `keys` (the fp32
    masters, each state the optimizer keeps per element: 12 for Adam's)."""
    return 4 * len(keys)


def flat_keys(inner: dict, path, group_sizes: tuple[int, ...]) -> tuple[str, ...]:
    """The flat tensors of every sub-group that a row's slices live in: the fp32 masters, then `state_keys`."""
    return (MASTERS, *state_keys(inner, path, group_sizes))


def optimizer_state(obj, path, group_sizes: tuple[int, ...]) -> dict:
    """The inner optimizer dict of a loaded optim_states file (`obj`), checked to hold the
    flat tensors of every sub-group at the layout's sizes (CheckpointError naming `path`), and an
    optimizer state tailor-tui composes (`state_keys`)."""
    try:
        inner = obj[OPTIMIZER_STATE_DICT]
        flat = inner[FP32_FLAT_GROUPS]
        inner[OPTIMIZER_STATE_DICT][STATE]  # noqa: B018 (must be there)
    except (KeyError, TypeError):
        raise CheckpointError(
            f"{path}: not a ZeRO-3 optim_states file (no {FP32_FLAT_GROUPS}); "
            "tailor-tui composes ZeRO stage 3 checkpoints"
        ) from None
    if len(flat) != len(group_sizes):
        raise CheckpointError(
            f"{path}: holds {len(flat)} optimizer sub-groups, its model_states describe "
            f"{len(group_sizes)}; the file belongs to another run or is corrupt"
        )
    for g, size in enumerate(group_sizes):
        t = flat[g]
        if not per_element(t, size):
            raise CheckpointError(
                f"{path}: sub-group {g} {MASTERS} holds {math.prod(_shape(t) or (0,))} elements, the layout says "
                f"{size}; the file is truncated, corrupt or from another run"
            )
    state_keys(inner, path, group_sizes)
    return inner


def flat_tensor(inner: dict, group: int, key: str):
    """Sub-group `group`'s flat tensor `key` (one of TENSORS) of an inner optimizer dict."""
    if key == "fp32":
        return inner[FP32_FLAT_GROUPS][group]
    return inner[OPTIMIZER_STATE_DICT][STATE].get(group, {}).get(key)


def set_flat_tensor(inner: dict, group: int, key: str, value) -> None:
    if key == "fp32":
        inner[FP32_FLAT_GROUPS][group] = value
    else:
        inner[OPTIMIZER_STATE_DICT][STATE][group][key] = value


def parse_version(text: str) -> tuple[int, int, int] | None:
    """(major, minor, patch) of a DeepSpeed version string such as `0.16.9` or
    `0.17.1+a1b2c3`, or None when it is not one."""
    found = re.match(r"\s*(\d+)\.(\d+)\.(\d+)", text or "")
    return (int(found[1]), int(found[2]), int(found[3])) if found else None


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


# `ds_version` as a pickled key (protocol 2's BINUNICODE, or SHORT_BINUNICODE), maybe memoized,
# then the string its value is
_VERSION_AFTER_KEY = re.compile(b"(?:X" + re.escape(len(DS_VERSION).to_bytes(4, "little")) + b"|\x8c"
                                + re.escape(bytes([len(DS_VERSION)])) + b")" + re.escape(DS_VERSION.encode())
                                + rb"(?:q.|r.{4}|\x94)?(?:X(.{4})|\x8c(.))", re.S)


def version_in_pickle(data: bytes) -> str | None:
    """The `ds_version` string in the pickles in `data` (one after another, as in a legacy
    torch file), found by the bytes of its opcodes without unpickling them or walking every
    opcode (linear in `data` whatever it holds), for naming the release of a file that cannot
    be read; None if there is none."""
    for found in _VERSION_AFTER_KEY.finditer(data):
        size = int.from_bytes(found.group(1) or found.group(2), "little")
        try:
            if size <= 64 and found.end() + size <= len(data):  # a release's name
                return data[found.end(): found.end() + size].decode()
        except UnicodeDecodeError:
            pass
    return None
    return None
