"""A DCP checkpoint's `.metadata`, pickled without torch as torch's `FileSystemWriter.finish` pickles it.

torch.distributed.checkpoint (torch 2.13, `metadata.py` and `filesystem.py`) keeps, in one pickle:
`Metadata(state_dict_metadata, planner_data, storage_data, storage_meta, version)`, where

- `state_dict_metadata` maps each flat key of the saved state dict (`model.<name>`,
  `optim.state.<name>.exp_avg`, `optim.param_groups.0.lr`) to a `TensorStorageMetadata` (dtype, size,
  and the rectangular chunks that cover it, each `ChunkStorageMetadata(offsets, sizes)`) or, for a value
  saved as bytes, a `BytesStorageMetadata`;
- `planner_data` maps each flat key to its path in the nested state dict (`("optim", "param_groups", 0,
  "lr")`), as `flatten_state_dict` found it;
- `storage_data` maps each chunk (`MetadataIndex(fqn, offset)`) to where its bytes lie:
  `_StorageInfo(relative_path, offset, length)` in a `.distcp` file.

The classes here stand in for torch's and pickle under torch's names (`dumps`); unpickled with torch,
they are torch's. Torch-free.
"""

from __future__ import annotations

import copyreg
import io
import pickle
from dataclasses import dataclass, field
from typing import Any, ClassVar

METADATA = ".metadata"  # the file's name in a DCP checkpoint folder
VERSION = "1.0.0"  # torch's CURRENT_DCP_VERSION
_MODULE = "torch.distributed.checkpoint.metadata"
_FILESYSTEM = "torch.distributed.checkpoint.filesystem"
_CONTIGUOUS = 0  # _MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT
# the dtypes a chunk holds, by torch's names (`torch.float32`), from the names tailor-tui gives them
TORCH_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16", "float64": "float64",
                "int64": "int64", "int32": "int32", "uint8": "uint8", "bool": "bool"}


class _Global:
    """A global of torch's, pickled by its name (`torch.Size`, `torch.float32`); callable, as pickle wants
    the callable of a reduction to be."""

    def __init__(self, module: str, name: str):
        self.module, self.name = module, name

    def __call__(self, *args):  # never called here: torch's, when the pickle is loaded
        raise TypeError(f"{self.module}.{self.name} is torch's")


_SIZE = _Global("torch", "Size")
_GET_LAYOUT = _Global("torch.serialization", "_get_layout")
_MEM_FORMAT = _Global(_MODULE, "_MEM_FORMAT_ENCODING")
_DTYPES: dict[str, _Global] = {name: _Global("torch", name) for name in TORCH_DTYPES.values()}


class _Stand:
    """A dataclass of torch's: pickled as `copyreg.__newobj__(cls)` and its state."""

    torch_name: ClassVar[tuple[str, str]]

    def state(self):
        return dict(self.__dict__)


@dataclass(frozen=True)
class ChunkStorageMetadata(_Stand):
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    torch_name = (_MODULE, "ChunkStorageMetadata")

    def state(self):
        return {"offsets": _TorchSize(self.offsets), "sizes": _TorchSize(self.sizes)}


@dataclass(frozen=True)
class TensorStorageMetadata(_Stand):
    dtype: str  # float32, bfloat16, …
    size: tuple[int, ...]
    chunks: tuple[ChunkStorageMetadata, ...]
    torch_name = (_MODULE, "TensorStorageMetadata")

    def state(self):
        properties = _Properties(self.dtype)
        return {"properties": properties, "size": _TorchSize(self.size), "chunks": list(self.chunks)}


@dataclass(frozen=True)
class BytesStorageMetadata(_Stand):
    torch_name = (_MODULE, "BytesStorageMetadata")

    def state(self):
        return None


@dataclass(frozen=True)
class _Properties(_Stand):
    dtype: str
    torch_name = (_MODULE, "TensorProperties")

    def state(self):  # TensorProperties.__getstate__: (dtype, layout, requires_grad, memory format, pin_memory)
        return (_DTYPES[TORCH_DTYPES[self.dtype]], _Reduction(_GET_LAYOUT, ("torch.strided",)), False,
                _Reduction(_MEM_FORMAT, (_CONTIGUOUS,)), False)


@dataclass(frozen=True)
class MetadataIndex(_Stand):
    fqn: str
    offset: tuple[int, ...] | None
    index: int = field(default=0, compare=False, hash=False)  # a hint only, as torch's
    torch_name = (_MODULE, "MetadataIndex")

    def state(self):
        return {"fqn": self.fqn, "index": self.index,
                "offset": None if self.offset is None else _TorchSize(self.offset)}


@dataclass(frozen=True)
class StorageInfo(_Stand):
    relative_path: str
    offset: int
    length: int
    torch_name = (_FILESYSTEM, "_StorageInfo")


@dataclass(frozen=True)
class StorageMeta(_Stand):
    checkpoint_id: str | None = None
    save_id: str | None = None
    load_id: str | None = None
    modules: list[str] = field(default_factory=list)
    torch_name = (_MODULE, "StorageMeta")


@dataclass(frozen=True)
class Metadata(_Stand):
    state_dict_metadata: dict[str, TensorStorageMetadata | BytesStorageMetadata]
    planner_data: dict[str, tuple]
    storage_data: dict[MetadataIndex, StorageInfo]
    storage_meta: StorageMeta
    version: str = VERSION
    torch_name = (_MODULE, "Metadata")


class _TorchSize(tuple):
    """torch.Size"""


@dataclass(frozen=True)
class _Reduction:
    """`func(*args)`, pickled as a reduction (`torch.serialization._get_layout("torch.strided")`)."""

    func: _Global
    args: tuple


class _MetadataPickler(pickle._Pickler):
    """Python's own pickler at protocol 4 (torch's `pickle.dump` default), naming the stand-ins' classes and
    torch's globals by torch's names."""

    def reducer_override(self, obj):
        kind = type(obj)
        if kind is _TorchSize:
            return _SIZE, (tuple(obj),)
        if kind is _Reduction:
            return obj.func, obj.args
        if isinstance(obj, _Stand):
            state = obj.state()
            return (copyreg.__newobj__, (kind,)) if state is None else (copyreg.__newobj__, (kind,), state)
        return NotImplemented

    def save_named(self, obj):
        module, name = obj.torch_name if isinstance(obj, type) else (obj.module, obj.name)
        self.save(module)
        self.save(name)
        self.write(pickle.STACK_GLOBAL)
        self.memoize(obj)

    dispatch: ClassVar[dict[type, Any]] = dict(pickle._Pickler.dispatch)
    dispatch[_Global] = save_named

    def save_global(self, obj, name=None):
        if isinstance(obj, type) and issubclass(obj, _Stand):
            return self.save_named(obj)
        raise pickle.PicklingError(f"{obj!r} is not one of torch's DCP metadata classes")


def dumps(metadata: Metadata) -> bytes:
    """The bytes of `.metadata` for `metadata`, as torch pickles its own."""
    out = io.BytesIO()
    _MetadataPickler(out, protocol=4).dump(metadata)
    return out.getvalue()
