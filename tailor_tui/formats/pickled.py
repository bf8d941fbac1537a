"""Read the structure of a DeepSpeed checkpoint pickle without torch and without running it.

The composer needs only structure from a `.pt` file: param shapes, world size and counters from
model_states, and where each flat tensor's bytes sit in optim_states. Importing torch for that costs
seconds in every process (and on a login node, every scan). This unpickler resolves exactly the globals
DeepSpeed ZeRO-3 checkpoints hold (every supported release: `ds_format`) to inert stand-ins (a tensor
becomes a `TensorRef`: storage key, offset, shape) and refuses every other global, so a hostile pickle
can neither run code nor load a class. `getattr` resolves to `enum_member` alone: a member of an allowed
DeepSpeed enumeration by its name, as early Python 3.11 releases pickle one (`ds_format.enum_member_value`).
"""

from __future__ import annotations

import collections
import functools
import io
import math
import pickle
from dataclasses import dataclass, field

from tailor_tui.formats.ds_format import DEEPSPEED_CLASSES, ENUM_MEMBERS, enum_member_value
from tailor_tui.formats.dtypes import STORAGE_DTYPE, STORAGE_ITEMSIZE
from tailor_tui.formats.pickle_bounds import MAX_PICKLE_BYTES, Truncated, check_bounds_bytes


def dtype_name(what: str) -> str:
    """`float32` for a storage type (`FloatStorage`) or a torch dtype (`torch.float32`)."""
    return STORAGE_DTYPE.get(what, what.removeprefix("torch."))


@dataclass(frozen=True)
class StorageType:
    name: str

    @property
    def itemsize(self) -> int:
        return STORAGE_ITEMSIZE[self.name]


@dataclass(frozen=True)
class StorageRef:
    key: str
    itemsize: int
    numel: int
    type_name: str = "UntypedStorage"  # `FloatStorage`, `HalfStorage`, …: the elements' dtype
    location: str = "cpu"  # the device torch saved it from: `cpu`, `cuda:0`, …


@dataclass
class TensorRef:
    """A tensor as pickled: which storage, where in it, what shape. No data. The rest is what `ptpickle`
    needs to pickle it back exactly as it was: its backward hooks (always an empty OrderedDict), the
    metadata newer torch appends, and, for a tensor pickled as `_rebuild_from_type_v2`, its (type, state)."""

    storage: StorageRef
    storage_offset: int
    size: tuple
    stride: tuple
    requires_grad: bool = False
    hooks: object = field(default_factory=collections.OrderedDict, repr=False, compare=False)
    metadata: tuple = field(default=(), repr=False, compare=False)
    from_type: tuple | None = field(default=None, repr=False, compare=False)

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


MAX_DIMS = 64  # of a tensor's shape or strides: a longer one is no tensor's (and would be copied per use)


class Size(tuple):
    """torch.Size: at most MAX_DIMS whole numbers (not a copy of a huge memoized tuple per use)."""

    def __new__(cls, dims=()):
        if not isinstance(dims, (tuple, list)) or len(dims) > MAX_DIMS or not all(isinstance(d, int) for d in dims):
            raise pickle.UnpicklingError(f"a torch.Size that is not a shape (at most {MAX_DIMS} whole numbers)")
        return super().__new__(cls, dims)


class PickledSet(set):
    """A pickled set, with its items in the order they were pickled (a set's own order changes with the
    process's string hashing): `ptpickle` writes them back in that order."""

    order: list


class Opaque:
    """A stand-in for an allow-listed object (loss scaler, tensor subclass): keeps its state."""

    def __init__(self, *args, **kwargs):
        self.args = args

    def __setstate__(self, state):
        self.state = state


class ZeroStageEnum(Opaque):
    """deepspeed.runtime.zero.config.ZeroStageEnum(3) -> keeps the value; `name`: the member's name
    when it was pickled by name (`getattr(ZeroStageEnum, 'weights')`: `enum_member`), else None."""

    def __init__(self, value=None, name: str | None = None):
        self.value = value
        self.name = name

    def __eq__(self, other):
        return getattr(other, "value", other) == self.value

    def __hash__(self):
        return hash(self.value)


class LossScaler(Opaque):
    """DeepSpeed's static loss scaler: its state kept."""


class DynamicLossScaler(Opaque):
    """DeepSpeed's dynamic loss scaler: its state kept."""


@dataclass(frozen=True)
class TorchDtype:
    """A torch dtype (`torch.float16`): DeepSpeed's fp16 loss scaler keeps one."""

    name: str


SET_ITEMS = (str, int)  # what DeepSpeed keeps in the sets it pickles (module names)


def _set(items=()):
    """`__builtin__.set`, as DeepSpeed <= 0.18 pickles `sparse_tensor_module_names`: a set of names.
    Anything but a list of strings or ints is refused (nothing else is ever called)."""
    if not isinstance(items, list) or not all(type(x) in SET_ITEMS for x in items):
        raise pickle.UnpicklingError("a pickled set holds something other than names")
    found = PickledSet(items)
    found.order = items
    return found


FLOATING = frozenset({"DoubleStorage", "FloatStorage", "HalfStorage", "BFloat16Storage", "ComplexFloatStorage",
                      "ComplexDoubleStorage"})  # the storages whose tensors may require gradients


def rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad=False, hooks=None, *metadata):
    if not isinstance(storage, StorageRef):
        raise pickle.UnpicklingError("a tensor whose storage is not a storage")
    if not all(isinstance(t, tuple) and len(t) <= MAX_DIMS for t in (size, stride)):
        raise pickle.UnpicklingError(f"a tensor whose shape or strides are not tuples of at most {MAX_DIMS}")
    check_view(storage, storage_offset, size, stride)
    if requires_grad and storage.type_name not in FLOATING:
        raise pickle.UnpicklingError(f"a tensor of storage {storage.key} ({storage.type_name}) requires gradients: "
                                     "only floating-point tensors can (torch refuses it)")
    hooks = collections.OrderedDict() if hooks is None else hooks
    return TensorRef(storage, storage_offset, tuple(size), tuple(stride), bool(requires_grad), hooks, metadata)


def check_view(storage: StorageRef, offset, size: tuple, stride: tuple) -> None:
    """Refuse (UnpicklingError) a tensor view torch's `set_` would refuse: a shape, strides or offset that
    are not whole numbers >= 0, as many strides as dimensions, and its last element inside its storage."""
    if type(offset) is not int or offset < 0 or len(size) != len(stride) \
            or not all(type(n) is int and n >= 0 for n in (*size, *stride)):
        raise pickle.UnpicklingError(f"a tensor of storage {storage.key} whose shape {size}, strides {stride} or "
                                     f"offset {offset!r} are not a view torch makes")
    if 0 not in size and offset + sum((n - 1) * s for n, s in zip(size, stride)) >= storage.numel:
        raise pickle.UnpicklingError(f"a tensor (offset {offset}, shape {size}, strides {stride}) reaches past the "
                                     f"{storage.numel} elements of its storage {storage.key}")


def rebuild_from_type_v2(func, new_type, args, state):
    tensor = func(*args)  # a tensor subclass (e.g. a Parameter placeholder): the plain tensor will do
    if isinstance(tensor, TensorRef):
        tensor.from_type = (new_type, state)
    return tensor


_STAND_INS = {"ZeroStageEnum": ZeroStageEnum, "LossScaler": LossScaler, "DynamicLossScaler": DynamicLossScaler}
_ENUM_OF = {_STAND_INS[name]: (module, name) for module, name in ENUM_MEMBERS}  # stand-in -> (module, name)


def enum_member(cls, name):
    """`__builtin__.getattr`, as early Python 3.11 releases pickle an enum member (`ds_format.ENUM_MEMBERS`):
    the member `name` of an allowed DeepSpeed enumeration's stand-in, and nothing else (UnpicklingError)."""
    module, qualname = next((where for stand_in, where in _ENUM_OF.items() if stand_in is cls), ("", ""))
    return cls(enum_member_value(module, qualname, name), name)  # by identity: `cls` may be unhashable


ALLOWED = {
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("__builtin__", "set"): _set,  # protocol 2 names builtins so
    ("builtins", "set"): _set,
    ("__builtin__", "getattr"): enum_member,
    ("builtins", "getattr"): enum_member,
    ("torch", "Size"): Size,
    ("torch", "Tensor"): Opaque,
    ("torch", "float16"): TorchDtype("float16"),
    ("torch._utils", "_rebuild_tensor_v2"): rebuild_tensor_v2,
    ("torch._tensor", "_rebuild_from_type_v2"): rebuild_from_type_v2,
    **{(module, name): _STAND_INS[name] for module, name in DEEPSPEED_CLASSES},
    **{("torch", name): StorageType(name) for name in STORAGE_ITEMSIZE},
}


class _Unpickler(pickle.Unpickler):
    def __init__(self, file, storages: dict | None = None, stand_in=None):
        super().__init__(file)
        self.storages = storages  # key -> StorageRef of every storage met, when given
        self.met: dict[str, StorageRef] = {}  # one StorageRef per storage: sharing one is identity
        self.stand_in = stand_in  # (module, name) -> what stands in for that global, instead of ALLOWED

    def find_class(self, module, name):
        if self.stand_in is not None:
            return self.stand_in(module, name)
        try:
            return ALLOWED[module, name]
        except KeyError:
            raise pickle.UnpicklingError(f"Unsupported GLOBAL {module}.{name} (not allow-listed)") from None

    def persistent_load(self, saved_id):
        # zip format: (kind, type, key, location, numel); legacy format adds view metadata
        if not isinstance(saved_id, tuple) or len(saved_id) not in (5, 6):
            raise pickle.UnpicklingError("unexpected persistent id")
        kind, storage_type, key, location, numel, *view = saved_id
        if kind != "storage" or not isinstance(storage_type, StorageType) or type(numel) is not int \
                or type(key) not in (str, int):
            raise pickle.UnpicklingError(f"unexpected persistent id (a {type(kind).__name__})")
        if view and view[0] is not None:
            raise pickle.UnpicklingError("a storage view (torch before 1.0 wrote those)")
        if not isinstance(location, str):
            raise pickle.UnpicklingError("a storage's location is not a name")
        ref = StorageRef(str(key), storage_type.itemsize, numel, storage_type.name, location)
        ref = self.met.setdefault(ref.key, ref)
        if ref.itemsize != storage_type.itemsize or ref.numel != numel or ref.type_name != storage_type.name:
            raise pickle.UnpicklingError(f"storage {ref.key} is described twice, differently")
        if self.storages is not None:
            if self.storages.setdefault(ref.key, ref) != ref:
                raise pickle.UnpicklingError(f"storage {ref.key} is described twice, differently")
        return ref


_bounds_of_equal = functools.lru_cache(maxsize=16)(check_bounds_bytes)  # of bytes <= 1 MiB: see read_pickle


def read_pickle(data: bytes, storages: dict | None = None, stand_in=None):
    """The object pickled in `data`, tensors as TensorRef; UnpicklingError for anything not allow-listed or
    beyond a checkpoint's bounds (`check_bounds_bytes`; a checkpoint's ranks pickle the same structure byte for
    byte: equal bytes are checked once per process). `storages` receives every storage it refers to.
    `stand_in(module, name)`: what stands in for each global instead of the DeepSpeed allow-list (a side
    file's: `side_globals.stand_in`); the tensor and storage rules hold either way."""
    if len(data) > MAX_PICKLE_BYTES:
        raise pickle.UnpicklingError(f"its structure is larger than {MAX_PICKLE_BYTES >> 20} MiB")
    (_bounds_of_equal if type(data) is bytes and len(data) <= 1 << 20 else check_bounds_bytes)(data)
    return _Unpickler(io.BytesIO(data), storages, stand_in).load()


def read_pickle_from(f, storages: dict | None = None, stand_in=None):
    """The next object pickled in the open binary file `f`, as `read_pickle`; reads at most
    MAX_PICKLE_BYTES (more as the pickle goes on) and leaves `f` just after the pickle."""
    start, size = f.tell(), 1 << 16
    while True:
        f.seek(start)
        data = f.read(size)
        try:
            end = check_bounds_bytes(data)
            break
        except Truncated:
            if len(data) < size or size >= MAX_PICKLE_BYTES:
                raise
            size = min(size * 16, MAX_PICKLE_BYTES)
    f.seek(start + end)
    return _Unpickler(io.BytesIO(data[:end]), storages, stand_in).load()
