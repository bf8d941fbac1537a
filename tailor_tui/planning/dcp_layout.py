"""How a ZeRO-3 rank's share of a PyTorch Distributed Checkpoint is laid out (`rank_job`): the chunks of the
parameters it holds, each a torch.save archive at its place in one `.distcp` file, decided once and filled by the
writer as the rank's bytes stream by (`export.dcp_rank`). The whole export of a composition (`export.dcp_export_plan`)
lays out every rank so; a DCP composition taking rows from a ZeRO-3 checkpoint (`dcp_plan`) lays out those rows'.
Torch-free.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from tailor_tui.checkpoints.checkpoint import RankFiles
from tailor_tui.checkpoints.layout import part, valid_elements
from tailor_tui.dcp.chunks import boxes, tensor_chunk
from tailor_tui.dcp.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageInfo,
    StorageMeta,
    TensorStorageMetadata,
)
from tailor_tui.errors import CheckpointError
from tailor_tui.events import JobCost
from tailor_tui.formats.ds_format import MASTERS, STATE
from tailor_tui.formats.dtypes import BY_NAME

MODEL, OPTIM = "model", "optim"  # the state dict's two parts, as dcp.save({"model": …, "optim": …}) names them


@dataclass(frozen=True)
class Piece:
    """One chunk: `count` elements from element `first` of a source tensor (a sub-group's flat tensor, a
    partial save's slice, a frozen fragment, a buffer), a `sizes` rectangle of a DCP entry, its archive
    from byte `at` of the job's file (the metadata names the entry)."""

    sizes: tuple[int, ...]
    first: int
    count: int
    at: int


@dataclass(frozen=True)
class DcpJob(JobCost):
    """One source rank's share of a DCP export (picklable): the chunks of its file `out_file`."""

    task: str
    files: RankFiles
    group_sizes: tuple[int, ...]
    out_file: str
    size: int  # the file's bytes
    flat: tuple[tuple[int, str, tuple[Piece, ...]], ...]  # (sub-group, flat key, its chunks): a full save's
    saved: tuple[tuple[str, str, int, tuple[Piece, ...]], ...]  # (parameter, flat key, elements, chunks): a partial's
    frozen: tuple[tuple[str, tuple[Piece, ...]], ...]  # (frozen parameter, chunks of its fragment), cast to fp32
    buffers: tuple[tuple[str, str, tuple[Piece, ...]], ...]  # (buffer, its dtype, its one chunk), as stored
    read_bytes: int
    write_bytes: int

    def files_read(self) -> tuple[Path, ...]:
        return (self.files.model_states, self.files.state_file)


class Entries:
    """The entries, chunks and files laid out so far."""

    def __init__(self) -> None:
        self.entries: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
        self.chunks: dict[str, list[ChunkStorageMetadata]] = {}
        self.kinds: dict[str, tuple[str, tuple[int, ...]]] = {}
        self.planner: dict[str, tuple] = {}
        self.storage: dict[MetadataIndex, StorageInfo] = {}

    def tensor(self, key: str, path: tuple, dtype: str, shape: tuple[int, ...]) -> None:
        self.kinds[key] = (dtype, shape)
        self.chunks.setdefault(key, [])
        self.planner[key] = path

    def chunk(self, key: str, offsets: tuple[int, ...], sizes: tuple[int, ...], *, file: str, at: int,
              length: int) -> None:
        self.chunks[key].append(ChunkStorageMetadata(tuple(offsets), tuple(sizes)))
        self.storage[MetadataIndex(key, tuple(offsets))] = StorageInfo(file, at, length)

    def value(self, key: str, path: tuple, file: str, at: int, length: int) -> None:
        self.entries[key] = BytesStorageMetadata()
        self.planner[key] = path
        self.storage[MetadataIndex(key, None)] = StorageInfo(file, at, length)

    def metadata(self, checkpoint_id: str) -> Metadata:
        for key, (dtype, shape) in self.kinds.items():
            covered = sum(math.prod(c.sizes) for c in self.chunks[key])
            if covered != math.prod(shape):
                raise AssertionError(f"{key}: chunks cover {covered} of {math.prod(shape)} elements")
            self.entries[key] = TensorStorageMetadata(dtype, shape, tuple(self.chunks[key]))
        ordered = {key: self.entries[key] for key in self.planner}
        return Metadata(ordered, dict(self.planner), dict(self.storage), StorageMeta(checkpoint_id, None, None, []))


@dataclass(frozen=True)
class ModelShapes:
    """What a rank's jobs lay out from (an export's, or a DCP composition's rows from ZeRO-3): the model's tensors,
    and the layout of the chunks so far."""

    shapes: dict[str, tuple[int, ...]]  # trainable parameters
    frozen: dict[str, tuple[int, ...]]
    buffers: dict[str, tuple[str, tuple[int, ...]]]  # (dtype, shape)
    state_keys: tuple[str, ...]  # the optimizer's state kept per element
    out: Entries
    masters: bool = True  # the fp32 masters laid out (as `model.<name>`); else the optimizer's state alone
    optim: str = OPTIM  # the first part of the optimizer's keys: `dcp.save({"optim": …})`'s, or the HF Trainer's


def rank_job(model: ModelShapes, ckpt, rank: int, files: RankFiles, *, name: str, label: str, mine: list[str],
         tied: list[tuple[str, str]], cold: list[str], held: list[str]) -> DcpJob | None:
    """Rank `rank` of source `ckpt`'s file `name`: the chunks of its parameters `mine`, of the tied names `tied`
    ((name, its parameter)), of the frozen parameters `cold` and the buffers `held`; None if it holds none."""
    shapes, frozen, buffers, state_keys, out = model.shapes, model.frozen, model.buffers, model.state_keys, model.out
    slots = {slot.name: slot for slot in ckpt.layout.slots}
    flat: dict[tuple[int, str], list[Piece]] = {}
    saved: list[tuple[str, str, int, tuple[Piece, ...]]] = []
    at, read = 0, 0

    def add(key: str, shape, first_element: int, count: int, start: int) -> list[Piece]:
        """The fp32 chunks of `key` holding its elements `first_element` on, which lie from element `start`
        of their source tensor."""
        nonlocal at
        found = []
        for offsets, sizes, first, n in boxes(tuple(shape), first_element, count):
            length = tensor_chunk("float32", tuple(sizes)).size
            found.append(Piece(tuple(sizes), start + first - first_element, n, at))
            out.chunk(key, offsets, sizes, file=name, at=at, length=length)
            at += length
        return found

    taken = []
    for entry, param in [(n, n) for n in mine] + [(a, t) for a, t in tied]:
        slot = slots.get(param)
        if slot is None:
            raise CheckpointError(f"{ckpt.path}: has no parameter {param}; it is from another model")
        if slot.valid(rank):
            taken.append((slot.group, slot.offset, entry, slot))
    by_group: dict[int, list] = {}
    for t in sorted(taken, key=lambda t: (t[0], t[1], t[2])):
        by_group.setdefault(t[0], []).append(t)
    # laid out in the order the job reads: a sub-group's flat tensor of each key in turn, so the file is
    # written from start to end (its writeback started as it goes)
    for g, held_here in by_group.items():
        for key in ((MASTERS,) if model.masters else ()) + tuple(state_keys):
            for _g, _offset, entry, slot in held_here:
                if key != MASTERS and entry != slot.name:
                    continue  # a tied name holds weights only
                dcp_key = f"{MODEL}.{entry}" if key == MASTERS else f"{model.optim}.{STATE}.{entry}.{key}"
                count = slot.valid(rank)
                if files.whole_records:
                    flat.setdefault((g, key), []).extend(
                        add(dcp_key, shapes[slot.name], rank * slot.part, count, slot.offset))
                else:
                    saved.append((slot.name, key, count,
                                  tuple(add(dcp_key, shapes[slot.name], rank * slot.part, count, 0))))
    read += sum(ckpt.layout.sizes_per_group[g] * 4 for g, _key in flat) if files.whole_records else \
        sum(p.count * 4 for _param, _key, _n, pieces in saved for p in pieces)
    fragments = []
    for param in cold:
        numel = math.prod(frozen[param])
        each = part(numel, ckpt.world_size)
        count = valid_elements(numel, each, rank)
        if count:
            fragments.append((param, tuple(add(f"{MODEL}.{param}", frozen[param], rank * each, count, 0))))
            read += each * (4 if ckpt.dtype == "fp32" else 2)
    kept = []
    for buffer in held:
        dtype, shape = buffers[buffer]
        key = f"{MODEL}.{buffer}"
        length = tensor_chunk(dtype, tuple(shape)).size
        kept.append((buffer, dtype, (Piece(tuple(shape), 0, math.prod(shape), at),)))
        out.chunk(key, (0,) * len(shape), shape, file=name, at=at, length=length)
        at += length
        read += math.prod(shape) * BY_NAME[dtype].itemsize
    if not at:
        return None
    return DcpJob(f"{label} rank {rank}", files, tuple(ckpt.layout.group_sizes()), name, at,
                  tuple((g, key, tuple(pieces)) for (g, key), pieces in flat.items()), tuple(saved),
                  tuple(fragments), tuple(kept), read, at)
