"""A PyTorch Distributed Checkpoint as the source of rows of a ZeRO-3 composition: read as a ZeRO-3 checkpoint
of one rank whose every parameter lies whole on that rank (`DcpRankFiles`), each of its tensors (`model.<name>`,
`optim.state.<name>.<key>`) cut into the chunks FSDP2 saved, each chunk a slice checked apiece against the CRC-32
its archive stores (`DcpRankReader`). The resharding planner cuts every piece at the chunks' edges
(`RankFiles.cuts`), so each piece lies in one chunk. Its fp32 masters are the source of the output's 16-bit
weights (`DcpMasterWeights`: cast to the file's dtype, as ZeRO-3 casts them). Frozen parameters and buffers have
no place in a ZeRO-3 rank's flat tensors: a row holding them is refused by the plan. Torch-free.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from tailor_tui.checked.evidence import SliceCheck
from tailor_tui.checked.files import FileIdentity, changed_error, open_regular
from tailor_tui.dcp.metadata import ChunkStorageMetadata, Metadata, MetadataIndex, TensorStorageMetadata
from tailor_tui.dcp.reading import ChunkBytes, locate_chunk
from tailor_tui.errors import CheckpointError, IncompatibleError
from tailor_tui.formats.ds_format import MASTERS, MAX_STATES
from tailor_tui.formats.dtypes import BY_NAME, SAFETENSORS_NAME
from tailor_tui.kinds.base import RankBytes, RankFiles, RankReader, SaveKind, WeightPiece, WeightSource

MODEL = "model."
FLOATS = ("float32", "bfloat16", "float16")  # the dtypes of weights cast into a model file


@dataclass(frozen=True)
class DcpSave(SaveKind):
    """A PyTorch Distributed Checkpoint, every row saved; no 16-bit weights of its own (its fp32 masters are cast)."""

    kind: ClassVar[str] = "PyTorch Distributed Checkpoint"
    sliced: ClassVar[bool] = True
    masters_only: ClassVar[bool] = True
    keeps_latest: ClassVar[bool] = False
    own_files: ClassVar[frozenset[str]] = frozenset()

    def holds(self, row: str) -> bool:
        return True

    def summary(self, rows: int) -> str | None:
        return "a PyTorch Distributed Checkpoint (FSDP2)"


def contiguous_start(chunk: ChunkStorageMetadata, shape: tuple[int, ...]) -> int | None:
    """The first element of `chunk` in its row-major tensor of `shape`, where its elements lie side by side there
    (one dimension cut anyhow, every one before it one wide, every one after it whole: FSDP2's row shards, and the
    rest of a row or the start of one that a DCP export of ZeRO-3 writes); None where they do not."""
    dims = len(shape)
    if dims and not any(all(chunk.sizes[j] == 1 for j in range(k))
                        and all(chunk.sizes[j] == shape[j] for j in range(k + 1, dims)) for k in range(dims)):
        return None
    start, stride = 0, 1
    for d in reversed(range(dims)):
        start += chunk.offsets[d] * stride
        stride *= shape[d]
    return start


@dataclass(frozen=True)
class DcpRankFiles(RankFiles):
    """A DCP checkpoint read as the one rank of a ZeRO-3 checkpoint: `folder` its folder, `metadata` its parts
    read as one (`dcp_checkpoint.read_parts`), `optim` the first part of its optimizer's keys, `identities` each of
    its files as opened."""

    folder: Path = Path()
    metadata: Metadata | None = None
    optim: str = "optim."
    identities: dict = field(default_factory=dict, compare=False, hash=False)

    kind: ClassVar[str] = "PyTorch Distributed Checkpoint"
    whole_records: ClassVar[bool] = False

    @property
    def state_file(self) -> Path:
        """Its optimizer's `.metadata` (its tensors lie in the `.distcp` files it names: `DcpRankReader.paths`)."""
        return self.optim_states

    @property
    def structure_file(self) -> Path:
        raise IncompatibleError(f"{self.folder}: a PyTorch Distributed Checkpoint is no ZeRO-3 base; base the recipe "
                                "on a ZeRO-3 checkpoint and take rows from it, or compose DCP checkpoints only")

    def existing(self) -> tuple[Path, ...]:
        return tuple(sorted(self.identities))

    def reader(self, group_sizes: tuple[int, ...], optim: bytes | None = None, *, small: bool = False) -> RankReader:
        return DcpRankReader(self, group_sizes)

    def key_of(self, key: str, param: str) -> str:
        """The DCP key of flat tensor `key` (the masters, or a state kept per element) of parameter `param`."""
        return MODEL + param if key == MASTERS else f"{self.optim}state.{param}.{key}"

    def entry(self, name: str) -> TensorStorageMetadata:
        assert self.metadata is not None, "read with its metadata"
        found = self.metadata.state_dict_metadata.get(name)
        if not isinstance(found, TensorStorageMetadata):
            raise IncompatibleError(f"{self.folder}: has no tensor {name}; it is another model, or another "
                                    "optimizer's state")
        return found

    def cuts(self, param: str) -> tuple[int, ...]:
        """Where a chunk of `param`'s weights or state starts (its first element, flat): no piece spans one."""
        assert self.metadata is not None, "read with its metadata"
        names = [n for n in self.metadata.state_dict_metadata
                 if n == MODEL + param or n.startswith(f"{self.optim}state.{param}.")]
        found = set()
        for name in names:
            entry = self.metadata.state_dict_metadata[name]
            if isinstance(entry, TensorStorageMetadata) and entry.size:
                found |= {self._start(name, entry, c) for c in entry.chunks}
        return tuple(sorted(found - {0}))

    def _start(self, name: str, entry: TensorStorageMetadata, chunk: ChunkStorageMetadata) -> int:
        start = contiguous_start(chunk, entry.size)
        if start is None:
            raise IncompatibleError(f"{self.folder}: {name} is saved in a chunk ({list(chunk.sizes)} at "
                                    f"{list(chunk.offsets)}) whose elements do not lie side by side; tailor-tui "
                                    "takes rows into ZeRO-3 from chunks of whole rows (FSDP2's)")
        return start

    def chunks(self, name: str) -> list[tuple[int, ChunkBytes]]:
        """(first element, where its bytes lie) of each chunk of tensor `name`, in order; each file checked to be
        the one opened when the checkpoint was (its identity)."""
        entry = self.entry(name)
        assert self.metadata is not None, "read with its metadata"
        found = []
        for chunk in entry.chunks:
            info = self.metadata.storage_data[MetadataIndex(name, chunk.offsets)]
            path = self.folder / info.relative_path
            fd = open_regular(path, follow=False)
            try:
                now = FileIdentity.of(os.fstat(fd))
                if path in self.identities and now != self.identities[path]:
                    raise changed_error(path, self.identities[path], now, "since the checkpoint was opened")
                found.append((self._start(name, entry, chunk), locate_chunk(self.folder, fd, entry, chunk, info)))
            finally:
                os.close(fd)
        return sorted(found, key=lambda f: f[0])


class DcpRankReader(RankReader):
    """Where a parameter's elements lie in a DCP checkpoint's chunks (`DcpRankFiles`), each chunk's archive read
    once."""

    files: DcpRankFiles

    def __init__(self, files: DcpRankFiles, group_sizes: tuple[int, ...]):
        super().__init__(files, group_sizes)
        self._located: dict[str, list[tuple[int, ChunkBytes]]] = {}

    def place(self, key: str, *, param: str | None, group: int | None, offset: int, valid: int, within: int = 0,
              count: int = 0) -> RankBytes:
        assert param is not None, "a DCP checkpoint's tensors are by parameter"
        name = self.files.key_of(key, param)
        if name not in self._located:
            self._located[name] = self.files.chunks(name)
        for start, found in self._located[name]:
            if start <= within and within + max(count, 1) <= start + found.numel:
                storage, itemsize = BY_NAME[found.dtype].storage, BY_NAME[found.dtype].itemsize
                record = found.record
                check = SliceCheck(found.path, f"{name} (elements {start:,}…)", record.data_offset, record.size,
                                   record.crc)
                return RankBytes(found.path, record.data_offset + (within - start) * itemsize, None, storage,
                                 itemsize, check)
        raise CheckpointError(f"{self.files.folder}: elements {within:,}…{within + count:,} of {name} lie in no one "
                              "chunk (internal error: pieces are cut at the chunks' edges)")

    def paths(self) -> tuple[Path, ...]:
        return self.files.existing()

    def keys(self) -> tuple[str, ...]:
        """The masters, then every state the optimizer keeps per element of each trainable parameter (sorted)."""
        metadata = self.files.metadata
        assert metadata is not None, "read with its metadata"
        prefix = self.files.optim + "state."
        per_param: dict[str, set[str]] = {}
        for name, entry in metadata.state_dict_metadata.items():
            if not name.startswith(prefix) or not isinstance(entry, TensorStorageMetadata):
                continue
            param, _, key = name[len(prefix):].rpartition(".")
            model = metadata.state_dict_metadata.get(MODEL + param)
            if isinstance(model, TensorStorageMetadata) and entry.size == model.size and math.prod(entry.size) > 1:
                per_param.setdefault(param, set()).add(key)
        kinds = {tuple(sorted(keys)) for keys in per_param.values()}
        if len(kinds) != 1 or len(next(iter(kinds))) > MAX_STATES:
            raise IncompatibleError(f"{self.files.folder}: its parameters keep different optimizer states per "
                                    f"element ({sorted(kinds)[:3]}); tailor-tui takes rows from one optimizer's")
        return (MASTERS, *next(iter(kinds)))

    def fragments(self, names):
        raise IncompatibleError(f"{self.files.folder}: frozen parameters ({', '.join(list(names)[:3])}) from a "
                                "PyTorch Distributed Checkpoint have no ZeRO-3 fragment to fill; take those rows "
                                "from a ZeRO-3 checkpoint")


@dataclass(frozen=True)
class DcpMasterWeights(WeightSource):
    """A DCP checkpoint as the source of an output's model-file tensors: each `model.<name>` tensor's chunks side by
    side, each checked against its archive's CRC-32, cast to the file's dtype (a trainable parameter's fp32 master:
    exactly the 16-bit weight ZeRO-3 casts from it)."""

    name: str
    rank: DcpRankFiles

    @property
    def files(self) -> tuple[Path, ...]:
        return self.rank.existing()

    def pieces(self, tensor: str, param: str, dtype: str, shape: tuple[int, ...]) -> tuple[WeightPiece, ...] | None:
        entry = self.rank.entry(MODEL + param)  # (IncompatibleError where it has none)
        if tuple(entry.size) != tuple(shape) or entry.dtype not in FLOATS:
            raise CheckpointError(f"{self.rank.folder}: holds {param} as {list(entry.size)} {entry.dtype}, the "
                                  f"output's file {list(shape)}")
        found = []
        for start, where in self.rank.chunks(MODEL + param):
            record = where.record
            check = SliceCheck(where.path, f"{MODEL}{param} (elements {start:,}…)", record.data_offset, record.size,
                               record.crc)
            found.append(WeightPiece(where.path, record.data_offset, where.numel, SAFETENSORS_NAME[entry.dtype], start,
                                     check))
        return tuple(found)

