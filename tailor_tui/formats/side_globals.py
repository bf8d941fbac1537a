"""What stands in for each global a run-level side file's pickle names: nothing named is imported or called.

The files training writes beside the weights (`rng_state_R.pth`, `scheduler.pt`, `training_args.bin`,
Accelerate's `random_states_R.pkl`, `scheduler.bin`, …) pickle more than DeepSpeed's classes: numpy's
RNG state, `transformers`' `TrainingArguments`, enumerations, `torch.device`. `side_pickles` reads
them with `pickled`'s unpickler and `stand_in` for every global, in three kinds:

- torch's tensor and storage rebuilders: `pickled`'s own (each view checked against its storage);
- the few torch, numpy and Python globals a side file holds, each by its exact name (`EXACT`): inert
  stand-ins that hold their arguments to the rules the real ones apply on loading (numpy's array and
  dtype states, `_codecs.encode`'s latin-1, a `torch.device`'s name), so that what they accept torch
  loads too;
- any class of the packages that train (`TRUSTED_PACKAGES`, more by `$TAILOR_TUI_TRUSTED_PICKLES`):
  `Inert`, whatever its name (whether that package has the name cannot be told without importing it).

Any other global (`os.system`, `builtins.eval`, a name of a package nobody named) is refused: the
resume would import and call it.
"""

from __future__ import annotations

import collections
import math
import os
import pickle
import re

from tailor_tui.formats.dtypes import BY_NAME, STORAGE_ITEMSIZE
from tailor_tui.formats.pickled import FLOATING, Size, StorageType, TensorRef, rebuild_from_type_v2, rebuild_tensor_v2

# the packages whose classes training pickles into its side files (TrainingArguments, DeepSpeedPlugin, …),
# and `__main__`: a training script's own TrainingArguments subclass, which a load finds in the loading
# program's own main module (the user's script), never in anything the file brings
TRUSTED_PACKAGES = ("transformers", "accelerate", "deepspeed", "peft", "trl", "__main__")
TRUSTED_ENV = "TAILOR_TUI_TRUSTED_PICKLES"  # more top-level packages, comma-separated (a training script's own)
# where torch restores a storage (`torch.serialization.default_restore_location`); a `torch.device` likewise
DEVICE = re.compile(r"(cpu|meta|mps|(cuda|xpu|hpu|npu|mtia|privateuseone)(:\d{1,4})?)", re.ASCII)
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")


class Inert:
    """Any object of a trusted package: takes whatever unpickling gives it and does nothing."""

    def __init__(self, *args, **kwargs):
        pass

    def __setstate__(self, state):
        pass

    def __setitem__(self, key, value):
        pass

    def append(self, item):
        pass

    def extend(self, items):
        pass

    def add(self, item):
        pass


def _refuse(why: str):
    raise pickle.UnpicklingError(why)


class NdarrayType:
    """numpy.ndarray, as numpy pickles an array: `_reconstruct(ndarray, (0,), b'b')`, then its state."""


NUMPY_TYPES = frozenset({"b1", "i1", "i2", "i4", "i8", "u1", "u2", "u4", "u8", "f2", "f4", "f8", "c8", "c16"})


class NumpyDtype:
    """numpy.dtype('u4', False, True), then its state: an element type numpy has, of `itemsize` bytes."""

    def __init__(self, spec=None, align=False, copy=True):
        if spec not in NUMPY_TYPES or type(align) is not bool or type(copy) is not bool:
            _refuse(f"numpy.dtype({str(spec)[:20]!r}, {align!r}, {copy!r}) is no element type numpy pickles")
        self.itemsize = int(spec[1:])

    def __setstate__(self, state):
        order = "|" if self.itemsize == 1 else "<>="
        if not (type(state) is tuple and len(state) == 8 and state[0] == 3 and type(state[1]) is str
                and len(state[1]) == 1 and state[1] in order and state[2:] == (None, None, None, -1, -1, 0)):
            _refuse(f"a numpy dtype whose state {str(state)[:60]} is not one numpy pickles")


class Ndarray:
    """A numpy array: its state (version 1, shape, dtype, Fortran order, bytes) holds as many bytes
    as its shape and dtype need (numpy refuses it otherwise)."""

    def __setstate__(self, state):
        if not (type(state) is tuple and len(state) == 5 and state[0] == 1 and type(state[1]) is tuple
                and all(type(n) is int and n >= 0 for n in state[1]) and isinstance(state[2], NumpyDtype)
                and type(state[3]) is bool and type(state[4]) is bytes):
            _refuse("a numpy array whose state is not one numpy pickles")
        if len(state[4]) != math.prod(state[1]) * state[2].itemsize:
            _refuse(f"a numpy array of shape {state[1]} whose data holds {len(state[4])} bytes, not "
                    f"{math.prod(state[1]) * state[2].itemsize}")


def _reconstruct(subtype=None, shape=None, typecode=None):
    if subtype is not NdarrayType or shape != (0,) or typecode != b"b":
        _refuse("numpy's _reconstruct with arguments numpy never pickles")
    return Ndarray()


def _scalar(dtype=None, data=None):
    if not isinstance(dtype, NumpyDtype) or type(data) is not bytes or len(data) != dtype.itemsize:
        _refuse("a numpy scalar whose bytes are not one of its type")
    return Inert()


def _encode(text=None, encoding=None):
    """_codecs.encode(text, 'latin1'), as numpy pickles an array's bytes: the bytes themselves."""
    if type(text) is not str or encoding not in ("latin1", "latin-1"):
        _refuse(f"_codecs.encode of a {type(text).__name__} as {str(encoding)[:20]!r}: not how numpy pickles bytes")
    return text.encode("latin-1")


def _device(kind=None, index=None):
    if type(kind) is not str or not DEVICE.fullmatch(kind) or not (index is None or type(index) is int and index >= 0):
        _refuse(f"torch.device({str(kind)[:20]!r}, {index!r}) is no device torch has")
    return Inert()


def _parameter(data=None, requires_grad=False, hooks=None, *state):
    if not isinstance(data, TensorRef):
        _refuse("a parameter whose data is not a tensor")
    if requires_grad and data.storage.type_name not in FLOATING:
        _refuse(f"a parameter of storage {data.storage.key} ({data.storage.type_name}) requires gradients: only "
                "floating-point tensors can (torch refuses it)")
    return data


def _rebuild_tensor(storage=None, offset=0, size=(), stride=()):
    return rebuild_tensor_v2(storage, offset, size, stride)


_MULTIARRAY = ("numpy.core.multiarray", "numpy._core.multiarray")
EXACT = {
    ("torch._utils", "_rebuild_tensor_v2"): rebuild_tensor_v2,
    ("torch._utils", "_rebuild_tensor"): _rebuild_tensor,
    ("torch._tensor", "_rebuild_from_type_v2"): rebuild_from_type_v2,
    ("torch._utils", "_rebuild_parameter"): _parameter,
    ("torch._utils", "_rebuild_parameter_with_state"): _parameter,
    ("torch.nn.parameter", "Parameter"): Inert,
    ("torch", "Tensor"): Inert,
    ("torch", "Size"): Size,
    ("torch", "device"): _device,
    **{("torch", name): StorageType(name) for name in STORAGE_ITEMSIZE},
    **{("torch", name): Inert() for name in (*BY_NAME, "uint16", "uint32", "uint64", "float8_e4m3fn",
                                              "float8_e5m2", "strided", "sparse_coo", "contiguous_format",
                                              "channels_last", "preserve_format")},
    **{(module, "_reconstruct"): _reconstruct for module in _MULTIARRAY},
    **{(module, "scalar"): _scalar for module in _MULTIARRAY},
    ("numpy", "ndarray"): NdarrayType,
    ("numpy", "dtype"): NumpyDtype,
    ("_codecs", "encode"): _encode,
    ("collections", "OrderedDict"): collections.OrderedDict,
    **{(builtins, name): value for builtins in ("builtins", "__builtin__")
       for name, value in (("set", set), ("frozenset", frozenset), ("slice", slice), ("complex", complex),
                           ("getattr", Inert), ("object", Inert))},
    ("copyreg", "_reconstructor"): Inert,
    **{("datetime", name): Inert for name in ("datetime", "date", "time", "timedelta", "timezone")},
    **{("pathlib", name): Inert for name in ("Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath")},
    ("argparse", "Namespace"): Inert,
    ("types", "SimpleNamespace"): Inert,
}


def trusted_packages() -> frozenset[str]:
    """TRUSTED_PACKAGES and those `$TAILOR_TUI_TRUSTED_PICKLES` names."""
    extra = (p.strip() for p in os.environ.get(TRUSTED_ENV, "").split(","))
    return frozenset(TRUSTED_PACKAGES).union(p for p in extra if _NAME.fullmatch(p) and "." not in p)


def stand_in(module, name):
    """What stands in for the global `module.name` of a side file's pickle (UnpicklingError: refused)."""
    try:
        return EXACT[module, name]
    except (KeyError, TypeError):
        pass
    if type(module) is str and type(name) is str and _NAME.fullmatch(module) and _NAME.fullmatch(name) \
            and module.split(".")[0] in trusted_packages():
        return Inert
    raise pickle.UnpicklingError(f"it names {str(module)[:50]}.{str(name)[:50]}, which no side file holds: loading "
                                 f"would import and call it (${TRUSTED_ENV} names packages to trust)")
