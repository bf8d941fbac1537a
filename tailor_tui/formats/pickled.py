"""Read the structure of a DeepSpeed checkpoint pickle without torch and without running it.

The composer needs only structure from a `.pt` file: param shapes, world size and counters from
model_states, and where each flat tensor's bytes sit in optim_states. Importing torch for that costs
seconds in every process (and on a login node, every scan). This unpickler resolves exactly the globals
DeepSpeed ZeRO-3 checkpoints hold (every supported release: `ds_format`) to inert stand-ins (a tensor
becomes a `TensorRef`: storage key, offset, shape) and refuses every other global, so a hostile pickle
can neither run code nor load a class.
"""

from __future__ import annotations

import collections
import functools
import io
import math
import pickle
import pickletools
from dataclasses import dataclass, field

from tailor_tui.formats.ds_format import DEEPSPEED_CLASSES
from tailor_tui.formats.dtypes import STORAGE_DTYPE, STORAGE_ITEMSIZE


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
    """deepspeed.runtime.zero.config.ZeroStageEnum(3) -> keeps the value."""

    def __init__(self, value=None):
        self.value = value

    def __eq__(self, other):
        return getattr(other, "value", other) == self.value

    def __hash__(self):
        return hash(self.value)


class LossScaler(Opaque):
    """DeepSpeed's static loss scaler: its state kept."""


class DynamicLossScaler(Opaque):
    """DeepSpeed's dynamic loss scaler: its state kept."""


@dataclass(frozen=True)
class DType:
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


def rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad=False, hooks=None, *metadata):
    if not isinstance(storage, StorageRef):
        raise pickle.UnpicklingError("a tensor whose storage is not a storage")
    if not all(isinstance(t, tuple) and len(t) <= MAX_DIMS for t in (size, stride)):
        raise pickle.UnpicklingError(f"a tensor whose shape or strides are not tuples of at most {MAX_DIMS}")
    hooks = collections.OrderedDict() if hooks is None else hooks
    return TensorRef(storage, storage_offset, tuple(size), tuple(stride), bool(requires_grad), hooks, metadata)


def rebuild_from_type_v2(func, new_type, args, state):
    tensor = func(*args)  # a tensor subclass (e.g. a Parameter placeholder): the plain tensor will do
    if isinstance(tensor, TensorRef):
        tensor.from_type = (new_type, state)
    return tensor


_STAND_INS = {"ZeroStageEnum": ZeroStageEnum, "LossScaler": LossScaler, "DynamicLossScaler": DynamicLossScaler}
ALLOWED = {
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("__builtin__", "set"): _set,  # protocol 2 names builtins so
    ("builtins", "set"): _set,
    ("torch", "Size"): Size,
    ("torch", "Tensor"): Opaque,
    ("torch", "float16"): DType("float16"),
    ("torch._utils", "_rebuild_tensor_v2"): rebuild_tensor_v2,
    ("torch._tensor", "_rebuild_from_type_v2"): rebuild_from_type_v2,
    **{(module, name): _STAND_INS[name] for module, name in DEEPSPEED_CLASSES},
    **{("torch", name): StorageType(name) for name in STORAGE_ITEMSIZE},
}


class _Unpickler(pickle.Unpickler):
    def __init__(self, file, storages: dict | None = None):
        super().__init__(file)
        self.storages = storages  # key -> StorageRef of every storage met, when given
        self.met: dict[str, StorageRef] = {}  # one StorageRef per storage: sharing one is identity

    def find_class(self, module, name):
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


# A ZeRO-3 checkpoint's pickle is small whatever the model size (shapes, counters, where tensors sit):
# about 300 bytes and 60 opcodes per parameter, so a few MiB for a 70B model and ~15 MiB for a 47k-parameter
# MoE. Anything beyond these bounds is refused before one object is built: reading any structure stays under
# 256 MiB of memory.
MAX_PICKLE_BYTES = 64 << 20
MAX_OBJECT_BYTES = 160 << 20  # estimated memory of the objects the pickle would build, unfolded
MAX_MEMO = 1 << 22  # memo slots (a crafted LONG_BINPUT 400000000 would allocate 3 GiB)
MAX_NESTING = 100  # open MARKs
_CHEAP = {"BINPUT", "LONG_BINPUT", "PUT", "MEMOIZE", "BINGET", "LONG_BINGET", "GET", "MARK", "STOP",
          "PROTO", "FRAME", "POP", "POP_MARK", "DUP", "BININT1", "NONE", "NEWTRUE", "NEWFALSE"}
# opcodes that call a constructor: each builds an object (a tensor stand-in with its tuples and hooks, a Size)
# whatever its arguments' cost was (they may all be one memoized tuple)
_BUILDS = {"REDUCE", "BUILD", "NEWOBJ", "NEWOBJ_EX", "OBJ", "INST"}
BUILD_COST = 512
# what an opcode makes that a later one may add to (APPEND…, BUILD: -1, the items up to the MARK)
_CONTAINERS = {"EMPTY_LIST", "EMPTY_DICT", "EMPTY_SET", "LIST", "DICT", "OBJ", "INST", "REDUCE", "NEWOBJ", "NEWOBJ_EX"}
_ADDS = {"APPEND": 1, "SETITEM": 2, "BUILD": 1, "APPENDS": -1, "SETITEMS": -1, "ADDITEMS": -1}
# How check_bounds_bytes steps over an opcode's argument, and what it does to the stack
_FIXED, _MEMO_INDEX, _MEMO_LINE, _SIZED, _LINES, _UNKNOWN = range(6)
_MAKE, _ADD, _GET, _PUT, _MARK, _POP, _POP_MARK, _STOP, _REFUSE = range(9)


class Truncated(pickle.UnpicklingError):
    """The pickle goes on past the bytes given."""


def _opcode_table() -> list[tuple]:
    """code byte -> (how its argument is laid out, its bytes or lines, base cost, what it does to the stack,
    how many items it takes (-1: to the MARK), what it leaves (0 nothing, 1 a value, 2 a container), name)."""
    table = [(_UNKNOWN, 0, 0, _REFUSE, 0, 0, "")] * 256
    special = {"MARK": _MARK, "POP": _POP, "POP_MARK": _POP_MARK, "STOP": _STOP, "DUP": _REFUSE, "MEMOIZE": _PUT}
    for op in pickletools.opcodes:
        arg, name, n = op.arg, op.name, 0
        if arg is None or arg.n >= 0:
            n = arg.n if arg is not None else 0
            kind = _MEMO_INDEX if name.endswith(("PUT", "GET")) else _FIXED
        elif arg.n == pickletools.UP_TO_NEWLINE:
            kind, n = _MEMO_LINE if name in ("PUT", "GET") else _LINES, 2 if arg.name.endswith("_pair") else 1
        else:
            kind = _SIZED
            n = {pickletools.TAKEN_FROM_ARGUMENT1: 1, pickletools.TAKEN_FROM_ARGUMENT4: -4,
                 pickletools.TAKEN_FROM_ARGUMENT4U: 4, pickletools.TAKEN_FROM_ARGUMENT8U: 8}[arg.n]
        takes = -1 if pickletools.markobject in op.stack_before else len(op.stack_before)
        action = special.get(name, _GET if name.endswith("GET") else _PUT if name.endswith("PUT") else
                             _ADD if name in _ADDS else _MAKE)
        base = 8 if name in _CHEAP else BUILD_COST if name in _BUILDS else 64
        leaves = 2 if name in _CONTAINERS else 1 if op.stack_after else 0
        table[op.code.encode("latin-1")[0]] = (kind, n, base, action, _ADDS.get(name, takes), leaves, name)
    return table


_OPCODES = _opcode_table()


def check_bounds_bytes(data: bytes) -> int:
    """The index just past the STOP of the pickle `data` starts with; refuses (UnpicklingError) one whose
    memo, nesting or estimated object memory, unfolded, exceeds what a checkpoint ever needs: a memo fetch
    costs all that the object fetched holds (one tuple used a million times costs a million tuples: hashing,
    printing or walking it costs that). A container changed once fetched (a structure that holds itself) is
    refused: no checkpoint holds one. One pass over the bytes, arguments not decoded."""
    cost = i = 0
    end, stack, marks, memo = len(data), [], [], {}  # stack: a value's weight, or a container's [weight, fetched]
    table, find, from_bytes, max_memo = _OPCODES, data.find, int.from_bytes, MAX_MEMO
    FIXED, MEMO_INDEX, MAKE, ADD, GET, PUT = _FIXED, _MEMO_INDEX, _MAKE, _ADD, _GET, _PUT  # noqa: N806 (fast locals)
    while True:
        try:
            kind, n, base, action, takes, leaves, name = table[data[i]]
        except IndexError:  # i is past the last byte
            raise Truncated("the pickle ends before its STOP opcode (truncated)") from None
        i += 1
        weight, index = base, -1
        if kind == FIXED:
            i += n
        elif kind == MEMO_INDEX:
            index, i = from_bytes(data[i: i + n], "little"), i + n
            if index >= max_memo:
                raise pickle.UnpicklingError(f"memo index {index} is beyond what any checkpoint uses")
        elif kind == _SIZED:
            width = n if n > 0 else -n
            size = from_bytes(data[i: i + width], "little", signed=n < 0)
            if size > MAX_PICKLE_BYTES:
                raise pickle.UnpicklingError(f"its structure is larger than {MAX_PICKLE_BYTES >> 20} MiB")
            if size < 0 or i + width + size > end:
                raise Truncated(f"{name} at byte {i} claims {size} bytes past the end (truncated)")
            i += width + size
            weight += size
        elif kind == _MEMO_LINE:
            j = find(b"\n", i)
            try:
                index = int(data[i:j]) if j >= 0 else -1
            except ValueError:
                index = -1
            if index < 0:
                raise Truncated(f"{name} at byte {i} has no index (truncated?)")
            if index >= max_memo:
                raise pickle.UnpicklingError(f"memo index {index} is beyond what any checkpoint uses")
            i = j + 1
        elif kind == _LINES:
            for _ in range(n):
                j = find(b"\n", i)
                if j < 0:
                    raise Truncated(f"{name} at byte {i} has no end of line (truncated)")
                weight += j - i
                i = j + 1
        else:
            raise pickle.UnpicklingError(f"unknown opcode {data[i - 1]:#04x} at byte {i - 1}")
        cost += weight
        if action == MAKE and not takes:  # a value of its own (the most frequent): a reference to it weighs 8
            if leaves:
                stack.append(8 if leaves == 1 else [weight, False])
        elif action == MAKE or action == ADD:
            if takes < 0 and not marks:
                raise pickle.UnpicklingError(f"{name} at byte {i - 1} has no MARK")
            start = marks.pop() if takes < 0 else len(stack) - takes
            if start < (marks[-1] if marks and takes >= 0 else 0):
                raise pickle.UnpicklingError(f"{name} at byte {i - 1} takes more than the stack holds")
            taken = stack[start:]
            del stack[start:]
            for item in taken:
                weight += item if item.__class__ is int else item[0]
            if action == ADD:
                held = stack[-1] if stack and (not marks or len(stack) > marks[-1]) else None
                if held is None or held.__class__ is int or held[1]:
                    raise pickle.UnpicklingError(f"{name} at byte {i - 1} adds to what is no new container")
                held[0] += weight
            else:
                stack.append([weight, False] if leaves == 2 else weight)
        elif action == GET:
            try:
                item = memo[index]
            except KeyError:
                raise pickle.UnpicklingError(f"{name} at byte {i - 1} fetches memo {index}, never set") from None
            if item.__class__ is not int:
                item[1] = True
                cost += item[0]
            else:
                cost += item
            stack.append(item)
        elif action == PUT:
            memo[len(memo) if index < 0 else index] = stack[-1]  # at most MAX_MEMO + 1 entries
            continue
        elif action == _MARK:
            marks.append(len(stack))
            if len(marks) > MAX_NESTING:
                raise pickle.UnpicklingError(f"nested more than {MAX_NESTING} deep")
            continue
        elif action == _POP:  # the MARK when nothing lies above it
            (marks if marks and len(stack) == marks[-1] else stack).pop()
        elif action == _POP_MARK:
            if not marks:
                raise pickle.UnpicklingError(f"{name} at byte {i - 1} has no MARK")
            del stack[marks.pop():]
        elif action == _STOP:
            return i
        else:
            raise pickle.UnpicklingError(f"{name} at byte {i - 1}, which no checkpoint uses")
        if cost > MAX_OBJECT_BYTES:
            raise pickle.UnpicklingError(f"it would build more than {MAX_OBJECT_BYTES >> 20} MiB of objects")


_bounds_of_equal = functools.lru_cache(maxsize=16)(check_bounds_bytes)  # of bytes <= 1 MiB: see read_pickle


def read_pickle(data: bytes, storages: dict | None = None):
    """The object pickled in `data`, tensors as TensorRef; UnpicklingError for anything not allow-listed or
    beyond a checkpoint's bounds (`check_bounds_bytes`; a checkpoint's ranks pickle the same structure byte for
    byte: equal bytes are checked once per process). `storages` receives every storage it refers to."""
    if len(data) > MAX_PICKLE_BYTES:
        raise pickle.UnpicklingError(f"its structure is larger than {MAX_PICKLE_BYTES >> 20} MiB")
    (_bounds_of_equal if type(data) is bytes and len(data) <= 1 << 20 else check_bounds_bytes)(data)
    return _Unpickler(io.BytesIO(data), storages).load()


def read_pickle_from(f, storages: dict | None = None):
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
    return _Unpickler(io.BytesIO(data[:end]), storages).load()
