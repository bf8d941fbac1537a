"""Read the structure of a DeepSpeed checkpoint pickle without torch and without running it.

The composer needs only structure from a `.pt` file: param shapes, world size and
counters from model_states, and where each flat tensor's bytes sit in optim_states.
Importing torch for that costs seconds in every process (and on a login node, every
scan). This unpickler resolves exactly the globals DeepSpeed ZeRO-3 checkpoints hold
(every supported release: `ds_format`) to inert stand-ins (a tensor becomes a
`TensorRef`: storage key, offset, shape) and refuses every other global, so a hostile
pickle can neither run code nor load a class.
"""

from __future__ import annotations

import collections
import io
import math
import pickle
from dataclasses import dataclass

from .ds_format import DEEPSPEED_CLASSES

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
    type_name: str = "UntypedStorage"  # `FloatStorage`, `HalfStorage`, …: the elements' dtype


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


@dataclass(frozen=True)
class DType:
    """A torch dtype (`torch.float16`): DeepSpeed's fp16 loss scaler keeps one."""

    name: str


SET_ITEMS = (str, int)  # what DeepSpeed keeps in the sets it pickles (module names)


def _set(items=()):
    """`__builtin__.set`, as DeepSpeed <= 0.18 pickles `sparse_tensor_module_names`: a set of
    names. Anything but a list of strings or ints is refused (nothing else is ever called)."""
    if not isinstance(items, list) or not all(type(x) in SET_ITEMS for x in items):
        raise pickle.UnpicklingError("a pickled set holds something other than names")
    return set(items)


def _rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad=False, *_rest):
    return TensorRef(storage, storage_offset, tuple(size), tuple(stride), bool(requires_grad))


def _rebuild_from_type_v2(func, new_type, args, state):
    return func(*args)  # a tensor subclass (e.g. a Parameter placeholder): the plain tensor will do


_STAND_INS = {"ZeroStageEnum": ZeroStageEnum, "LossScaler": LossScaler, "DynamicLossScaler": DynamicLossScaler}
ALLOWED = {
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("__builtin__", "set"): _set,  # protocol 2 names builtins so
    ("builtins", "set"): _set,
    ("torch", "Size"): Size,
    ("torch", "Tensor"): Opaque,
    ("torch", "float16"): DType("float16"),
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor_v2,
    ("torch._tensor", "_rebuild_from_type_v2"): _rebuild_from_type_v2,
    **{(module, name): _STAND_INS[name] for module, name in DEEPSPEED_CLASSES},
    **{("torch", name): StorageType(name) for name in ITEMSIZE},
}


class _Unpickler(pickle.Unpickler):
    def __init__(self, file, storages: dict | None = None):
        super().__init__(file)
        self.storages = storages  # key -> StorageRef of every storage met, when given

    def find_class(self, module, name):
        try:
            return ALLOWED[module, name]
        except KeyError:
            raise pickle.UnpicklingError(f"Unsupported GLOBAL {module}.{name} (not allow-listed)") from None

    def persistent_load(self, saved_id):
        # zip format: (kind, type, key, location, numel); legacy format adds view metadata
        if not isinstance(saved_id, tuple) or len(saved_id) not in (5, 6):
            raise pickle.UnpicklingError("unexpected persistent id")
        kind, storage_type, key, _location, numel, *view = saved_id
        if kind != "storage" or not isinstance(storage_type, StorageType) or type(numel) is not int:
            raise pickle.UnpicklingError(f"unexpected persistent id {kind!r}")
        if view and view[0] is not None:
            raise pickle.UnpicklingError("a storage view (torch before 1.0 wrote those)")
        ref = StorageRef(str(key), storage_type.itemsize, numel, storage_type.name)
        if self.storages is not None:
            if self.storages.setdefault(ref.key, ref) != ref:
                raise pickle.UnpicklingError(f"storage {ref.key} is described twice, differently")
        return ref


# A ZeRO-3 checkpoint's pickle is small whatever the model size (shapes, counters, where
# tensors sit): a 70B model's model_states pickle is a few MiB. Reading stops beyond this.
MAX_PICKLE_BYTES = 256 << 20


class _Bounded:
    """The file as the unpickler reads it: at most MAX_PICKLE_BYTES in all, so a crafted
    length cannot make it allocate more; no read-ahead, so `f` is left just after the pickle."""

    def __init__(self, f):
        self.f, self.left = f, MAX_PICKLE_BYTES

    def _take(self, n: int) -> int:
        if n > self.left:
            raise pickle.UnpicklingError(f"its structure is larger than {MAX_PICKLE_BYTES >> 20} MiB")
        self.left -= n
        return n

    def read(self, n: int = -1) -> bytes:
        return self.f.read(self._take(n if n >= 0 else self.left + 1))

    def readinto(self, buffer) -> int:
        return self.f.readinto(memoryview(buffer)[: self._take(len(buffer))])

    def readline(self) -> bytes:
        line = self.f.readline(self.left + 1)
        self._take(len(line))
        return line


def read_pickle(data: bytes):
    """The object pickled in `data`, tensors as TensorRef; UnpicklingError for anything not allow-listed."""
    return _Unpickler(io.BytesIO(data)).load()


def read_pickle_from(f, storages: dict | None = None):
    """The next object pickled in the open binary file `f`, tensors as TensorRef; reads at
    most MAX_PICKLE_BYTES and leaves `f` just after the pickle. `storages`, if given,
    receives every storage the pickle refers to (key -> StorageRef)."""
    return _Unpickler(_Bounded(f), storages).load()
