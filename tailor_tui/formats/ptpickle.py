"""Pickle the torch-free reader's stand-ins exactly as torch.save pickles what they stand for.

`pickled` reads a checkpoint's structure into inert stand-ins (`TensorRef`, `StorageRef`,
`Size`, the loss scalers, …). `dumps` writes such a structure back as the `data.pkl` of a
torch zip archive (`ptwrite`): protocol 2, tensors as `torch._utils._rebuild_tensor_v2`,
storages as torch's persistent ids, numbered in the order they are first met, each
global named as torch names it. A structure read and dumped again gives back the very
bytes torch wrote (tests/test_ptwrite.py checks it on every real run, every DeepSpeed
release), so a structure changed here and dumped is what torch would write for the same
change, without importing torch.

Only the stand-ins of `pickled.ALLOWED` and Python's plain containers can be pickled;
anything else is a PicklingError.
"""

from __future__ import annotations

import collections
import copyreg
import io
import pickle
import types
from typing import Any, Callable, ClassVar, cast

from tailor_tui.formats.pickled import (
    ALLOWED,
    Opaque,
    PickledSet,
    Size,
    StorageRef,
    StorageType,
    TensorRef,
    TorchDtype,
    ZeroStageEnum,
    enum_member,
    rebuild_from_type_v2,
    rebuild_tensor_v2,
)

CPU = "cpu"
_STORAGE = "storage"  # one object, as torch's literal is: every persistent id shares it

# object -> (module, name) as torch's pickler names it
_GLOBALS: dict[int, tuple[str, str]] = {id(obj): key for key, obj in ALLOWED.items() if key[0] != "builtins"}
_GLOBALS[id(set)] = ("__builtin__", "set")  # protocol 2 names builtins so
_GLOBALS[id(rebuild_tensor_v2)] = ("torch._utils", "_rebuild_tensor_v2")
_GLOBALS[id(rebuild_from_type_v2)] = ("torch._tensor", "_rebuild_from_type_v2")
_GLOBALS[id(collections.OrderedDict)] = ("collections", "OrderedDict")
_GLOBALS[id(Opaque)] = ("torch", "Tensor")


def storage_type(type_name: str) -> StorageType:
    """The one StorageType the reader gives for `FloatStorage`, `HalfStorage`, …"""
    return cast(StorageType, ALLOWED["torch", type_name])  # the allow-list maps each storage type's name so


def tensor(storage: StorageRef, shape: tuple, *, requires_grad: bool = False) -> TensorRef:
    """A new contiguous tensor over the whole of `storage`, as torch pickles one it made."""
    stride, step = [], 1
    for d in reversed(shape):
        stride.append(step)
        step *= d
    return TensorRef(storage, 0, tuple(shape), tuple(reversed(stride)), requires_grad)


class _Pickler(pickle._Pickler):
    """Python's own pickler (the pure-Python one, whose output is the C one's), with torch's
    persistent ids and torch's names for the stand-ins' globals."""

    def __init__(self, file, location: str | None):
        super().__init__(file, protocol=2)
        self.location = location
        self.keys: dict[int, str] = {}
        self.storages: list[StorageRef] = []

    def persistent_id(self, obj):
        if type(obj) is not StorageRef:
            return None
        key = self.keys.get(id(obj))
        if key is None:
            key = self.keys[id(obj)] = str(len(self.keys))
            self.storages.append(obj)  # also keeps it alive, so its id stays its own
        return (_STORAGE, storage_type(obj.type_name), key, self.location or obj.location, obj.numel)

    def reducer_override(self, obj):
        kind = type(obj)
        if kind is TensorRef:
            args = (obj.storage, obj.storage_offset, obj.size, obj.stride, obj.requires_grad, obj.hooks,
                    *obj.metadata)
            if obj.from_type is None:
                return rebuild_tensor_v2, args
            new_type, state = obj.from_type
            return rebuild_from_type_v2, (rebuild_tensor_v2, new_type, args, state)
        if kind is Size:
            return Size, (tuple(obj),)
        if kind is PickledSet:
            return set, (list(obj.order),)
        if kind is ZeroStageEnum:  # by name, if it was pickled so (early Python 3.11 releases)
            return (ZeroStageEnum, (obj.value,)) if obj.name is None else (enum_member, (ZeroStageEnum, obj.name))
        if isinstance(obj, Opaque):
            return copyreg.__newobj__, (kind,), getattr(obj, "state", None)
        if kind is TorchDtype or kind is StorageType:
            return obj.name  # a global: `torch.float16`, `torch.FloatStorage`
        return NotImplemented

    def save_global(self, obj, name=None):
        if type(obj) in (TorchDtype, StorageType):
            where = ("torch", obj.name)
        else:
            where = _GLOBALS.get(id(obj))
        if where is None:
            raise pickle.PicklingError(f"{obj!r} is not a global a DeepSpeed checkpoint holds")
        module, name = where
        self.write(pickle.GLOBAL + f"{module}\n{name}\n".encode("ascii"))
        self.memoize(obj)

    dispatch: ClassVar[dict[type, Callable[..., Any]]] = dict(pickle._Pickler.dispatch)
    dispatch[types.FunctionType] = save_global


def dumps(obj, *, location: str | None = CPU) -> tuple[bytes, list[StorageRef]]:
    """(the pickle torch.save writes for `obj`, its storages in key order: `data/0`, …).
    `location`: the device every storage is recorded as saved from (torch.load with
    map_location="cpu" then save records "cpu"); None keeps each storage's own."""
    buffer = io.BytesIO()
    pickler = _Pickler(buffer, location)
    pickler.dump(obj)
    return buffer.getvalue(), pickler.storages


def storage_bytes(storage: StorageRef) -> int:
    return storage.numel * storage.itemsize
