"""Read the structure of a DeepSpeed checkpoint pickle without torch and without running it.

The composer needs only structure from a `.pt` file: param shapes, world size and
counters from model_states, and where each flat tensor's bytes sit in optim_states.
Importing torch for that costs seconds in every process (and on a login node, every
scan). This unpickler resolves exactly the globals DeepSpeed ZeRO-3 checkpoints hold to
inert stand-ins (a tensor becomes a `TensorRef`: storage key, offset, shape) and refuses
every other global, so a hostile pickle can neither run code nor load a class.
"""

from __future__ import annotations

import collections
import io
import math
import pickle
from dataclasses import dataclass

ITEMSIZE = {
    "DoubleStorage": 8, "FloatStorage": 4, "HalfStorage": 2, "BFloat16Storage": 2,
    "LongStorage": 8, "IntStorage": 4, "ShortStorage": 2, "CharStorage": 1, "ByteStorage": 1,
    "BoolStorage": 1, "ComplexFloatStorage": 8, "ComplexDoubleStorage": 16, "UntypedStorage": 1,
}


@dataclass(frozen=True)
class StorageType:
    name: str

    @property
    def itemsize(self) -> int:
        return ITEMSIZE[self.name]


@dataclass(frozen=True)
class StorageRef:
    key: str
    itemsize: int
    numel: int


@dataclass
class TensorRef:
    """A tensor as pickled: which storage, where in it, what shape. No data."""

    storage: StorageRef
    storage_offset: int
    size: tuple
    stride: tuple
    requires_grad: bool = False

    def numel(self) -> int:
        return math.prod(self.size)

    def element_size(self) -> int:
        return self.storage.itemsize

    def is_contiguous(self) -> bool:
        expected, stride = 1, []
        for d in reversed(self.size):
            stride.append(expected)
            expected *= d
        return tuple(reversed(stride)) == tuple(self.stride) or self.numel() <= 1


class Size(tuple):
    """torch.Size."""


class Opaque:
    """A stand-in for an allow-listed object (loss scaler, tensor subclass): keeps its state."""

    def __init__(self, *args, **kwargs):
        self.args = args

    def __setstate__(self, state):
        self.state = state


class ZeroStageEnum(Opaque):
    """deepspeed.runtime.zero.config.ZeroStageEnum(3) -> keeps the value."""

    def __init__(self, value=None):
        self.value = value

    def __eq__(self, other):
        return getattr(other, "value", other) == self.value

    def __hash__(self):
        return hash(self.value)


class LossScaler(Opaque):
    pass


class DynamicLossScaler(Opaque):
    pass


def _rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad=False, *_rest):
    return TensorRef(storage, storage_offset, tuple(size), tuple(stride), bool(requires_grad))


def _rebuild_from_type_v2(func, new_type, args, state):
    return func(*args)  # a tensor subclass (e.g. a Parameter placeholder): the plain tensor will do


ALLOWED = {
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("torch", "Size"): Size,
    ("torch", "Tensor"): Opaque,
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor_v2,
    ("torch._tensor", "_rebuild_from_type_v2"): _rebuild_from_type_v2,
    ("deepspeed.runtime.zero.config", "ZeroStageEnum"): ZeroStageEnum,
    ("deepspeed.runtime.fp16.loss_scaler", "LossScaler"): LossScaler,
    ("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler"): DynamicLossScaler,
    **{("torch", name): StorageType(name) for name in ITEMSIZE},
}


class _Unpickler(pickle.Unpickler):
    def find_class(self, module, name):
        try:
            return ALLOWED[module, name]
        except KeyError:
            raise pickle.UnpicklingError(f"Unsupported GLOBAL {module}.{name} (not allow-listed)") from None

    def persistent_load(self, saved_id):
        kind, storage_type, key, _location, numel = saved_id
        if kind != "storage" or not isinstance(storage_type, StorageType):
            raise pickle.UnpicklingError(f"unexpected persistent id {kind!r}")
        return StorageRef(str(key), storage_type.itemsize, int(numel))


def read_pickle(data: bytes):
    """The object pickled in `data`, tensors as TensorRef; UnpicklingError for anything not allow-listed."""
    return _Unpickler(io.BytesIO(data)).load()
