"""What exporting a composition as a PyTorch Distributed Checkpoint (DCP) reads from where and writes
where, decided once (`tailor-tui --export X --to DIR --format dcp`).

The checkpoint holds what `torch.distributed.checkpoint.state_dict.get_state_dict(model, optimizer)`
returns for the model and a torch optimizer of the run's kind, saved under `model` and `optim` as
`dcp.save({"model": ..., "optim": ...})` saves them:

- `model.<name>`: every tensor of the model's state dict: each parameter's fp32 master weights (a frozen
  one's weights, cast to fp32: an fp32 model's), a tied name's weights again under its own name (as the
  state dict lists it), each persistent buffer as stored;
- `optim.state.<name>.<key>`: every trainable parameter's optimizer state kept per element (AdamW's
  `exp_avg`, `exp_avg_sq`; any optimizer's, `ds_format.state_keys`), and its `step` (float32, 0-d:
  torch's), the base's;
- `optim.param_groups.<i>.<key>`: the run's param groups in order, each with its hyperparameters and
  `params`, the names of its parameters; an Adam run's groups carry every key torch's AdamW group has
  (`ADAMW_GROUP`, the run's values where it has them), since DCP's load planner refuses a key the
  loading state dict has and the checkpoint lacks.

Each tensor is chunked as the ZeRO-3 source holds it: one source rank's range of a parameter is a few
rectangles (`dcp.chunks.boxes`). A `DcpJob` is one source rank's share: one `.distcp` file of its
chunks, each a torch.save archive laid out here (offset and length, for the metadata) and filled by the
job as the rank's bytes stream by (`dcp_rank`). The step tensors and the param groups' values are small:
written by the parent (`small_file`). Torch-free.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from pathlib import Path

from tailor_tui.checkpoints.checkpoint import RankFiles, distinct_names
from tailor_tui.checkpoints.layout import part, valid_elements
from tailor_tui.dcp.chunks import ITEMSIZE, boxes, scalar_chunk, tensor_chunk, value_chunk
from tailor_tui.dcp.metadata import (
    METADATA,
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
from tailor_tui.export.export_plan import buffer_tensors
from tailor_tui.formats.ds_format import (
    ADAM_STATE,
    MASTERS,
    MAX_NAME,
    MAX_STATES,
    OPTIMIZER_STATE_DICT,
    OPTIMIZERS,
    PARAM_GROUPS,
    STATE,
    STEP,
)
from tailor_tui.formats.dtypes import BY_NAME, STORAGE_DTYPE
from tailor_tui.formats.pickled import TensorRef, dtype_name
from tailor_tui.formats.ptwrite import Rewritable
from tailor_tui.planning.plan import ComposePlan
from tailor_tui.resharding.partition import param_groups_of

MODEL, OPTIM = "model", "optim"  # the state dict's two parts, as dcp.save({"model": …, "optim": …}) names them
# torch.optim.AdamW's param group keys and defaults (torch 2.13): a loading AdamW asks for every one
ADAMW_GROUP = {"lr": 0.001, "betas": (0.9, 0.999), "eps": 1e-08, "weight_decay": 0.01, "amsgrad": False,
               "maximize": False, "foreach": None, "capturable": False, "differentiable": False, "fused": None,
               "decoupled_weight_decay": True}
MAX_GROUP_VALUE = 4096  # characters of a param group value's repr: a longer one is no hyperparameter


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


@dataclass(frozen=True)
class DcpExport:
    plan: ComposePlan
    jobs: tuple[DcpJob, ...]
    small_file: str
    small: bytes  # the small file's bytes: the step tensors and the param groups' values
    metadata: Metadata
    optimizer: str  # what the param groups are for: "AdamW" or the run's own keys
    tensors: int
    peft: bool  # a PEFT run: the checkpoint holds its adapters, not the base model's weights (the pretrained ones)

    def bytes_to_write(self) -> int:
        return sum(job.size for job in self.jobs) + len(self.small)


class _Entries:
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

    def chunk(self, key: str, offsets: tuple[int, ...], sizes: tuple[int, ...], file: str, at: int,
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


def plan_dcp_export(plan: ComposePlan) -> DcpExport:
    """The DCP export of `plan`'s composition."""
    base = plan.base
    shapes = {name: shape for group in base.layout.groups for name, shape in group}
    frozen = dict(base.layout.frozen)
    aliases = {alias: target for row in base.rows for alias, target in row.aliases}
    source_of = plan.source_of_param()
    state_keys = tuple(k for k in plan.keys if k != MASTERS)
    out = _Entries()
    order = [name for row in base.rows for name in (*row.params, *(a for a, _t in row.aliases), *row.buffers)]
    buffers = _buffer_kinds(plan, source_of)
    for name in order:
        target = aliases.get(name, name)
        if target in shapes or target in frozen:
            out.tensor(f"{MODEL}.{name}", (MODEL, name), "float32", tuple(shapes.get(target) or frozen[target]))
        elif name in buffers:
            out.tensor(f"{MODEL}.{name}", (MODEL, name), buffers[name][0], buffers[name][1])
    for name in (n for n in order if n in shapes):
        for key in state_keys:
            out.tensor(f"{OPTIM}.{STATE}.{name}.{key}", (OPTIM, STATE, name, key), "float32", tuple(shapes[name]))
    model = _Model(shapes, frozen, buffers, state_keys, out)
    jobs: list[DcpJob] = []
    labels = distinct_names([ckpt.path for ckpt in plan.sources])
    for s, ckpt in enumerate(plan.sources):
        mine = sorted(n for n in shapes if source_of.get(n) == s)
        tied = sorted((a, t) for a, t in aliases.items() if source_of.get(t) == s and t in shapes)
        cold = sorted(n for n in frozen if source_of.get(n) == s)
        held = sorted(n for n in buffers if source_of.get(n) == s)
        for rank, files in enumerate(ckpt.ranks):
            job = _job(model, ckpt, rank, files, name=f"__{len(jobs)}_0.distcp",
                       label=labels[s] if s else f"{labels[s]} (base)", mine=mine, tied=tied, cold=cold,
                       held=held if rank == 0 else [])
            if job is not None:
                jobs.append(job)
    small_file = f"__{len(jobs)}_0.distcp"
    small, optimizer = _optimizer_values(plan, shapes, state_keys, out, small_file)
    return DcpExport(plan, tuple(jobs), small_file, small, out.metadata(str(plan.output)), optimizer,
                     len(out.kinds), bool(base.peft))


@dataclass(frozen=True)
class _Model:
    """What every job of an export lays out from: the model's tensors, and the layout of the chunks so far."""

    shapes: dict[str, tuple[int, ...]]  # trainable parameters
    frozen: dict[str, tuple[int, ...]]
    buffers: dict[str, tuple[str, tuple[int, ...]]]  # (dtype, shape)
    state_keys: tuple[str, ...]  # the optimizer's state kept per element
    out: _Entries


def _job(model: _Model, ckpt, rank: int, files: RankFiles, *, name: str, label: str, mine: list[str],
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
            out.chunk(key, offsets, sizes, name, at, length)
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
        for key in (MASTERS, *state_keys):
            for _g, _offset, entry, slot in held_here:
                if key != MASTERS and entry != slot.name:
                    continue  # a tied name holds weights only
                dcp_key = f"{MODEL}.{entry}" if key == MASTERS else f"{OPTIM}.{STATE}.{entry}.{key}"
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
        out.chunk(key, (0,) * len(shape), shape, name, at, length)
        at += length
        read += math.prod(shape) * BY_NAME[dtype].itemsize
    if not at:
        return None
    return DcpJob(f"{label} rank {rank}", files, tuple(ckpt.layout.group_sizes()), name, at,
                  tuple((g, key, tuple(pieces)) for (g, key), pieces in flat.items()), tuple(saved),
                  tuple(fragments), tuple(kept), read, at)


def _buffer_kinds(plan: ComposePlan, source_of: dict[str, int]) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Every persistent buffer: its dtype and shape, as its row's source keeps it in rank 0's model_states."""
    found = {}
    for name, tensor in buffer_tensors(plan, source_of).items():
        found[name] = (STORAGE_DTYPE.get(tensor.storage.type_name, "float32"), tuple(tensor.size))
    return found


def _optimizer_values(plan: ComposePlan, shapes, state_keys: tuple[str, ...], out: _Entries,
                      file: str) -> tuple[bytes, str]:
    """The small file: each trainable parameter's optimizer state that is not kept per element (AdamW's `step`,
    Adafactor's `step` and `RMS`): the base's, as its sub-group keeps it; each param group's values; and what
    the groups are for."""
    base = plan.base
    read = Rewritable(base.ranks[0].structure_file)
    try:
        inner = read.obj[OPTIMIZER_STATE_DICT][OPTIMIZER_STATE_DICT]
        state, groups = inner[STATE], inner[PARAM_GROUPS]
        members = param_groups_of(base)
        if len(groups) != len(members) or not isinstance(state, dict) or not all(isinstance(g, dict) for g in groups):
            raise TypeError
    except (KeyError, TypeError):
        raise CheckpointError(f"{read.path}: not a ZeRO-3 optimizer state with param groups; the file is from "
                              "another run or layout") from None
    adam = set(state_keys) <= {*ADAM_STATE, "max_exp_avg_sq"} and set(ADAM_STATE) <= set(state_keys)
    data = bytearray()

    def put(key: str, path: tuple, chunk: bytes, dtype: str | None) -> None:
        if dtype is None:  # a value saved as bytes
            out.value(key, path, file, len(data), len(chunk))
        else:
            out.tensor(key, path, dtype, ())
            out.chunk(key, (), (), file, len(data), len(chunk))
        data.extend(chunk)

    for i, held in enumerate(members):
        for g in held:
            scalars = _scalars(read, state.get(g, {}), g, state_keys)
            if adam and STEP not in scalars and type(groups[i].get(STEP)) in (int, float):
                scalars[STEP] = ("float32", struct.pack("<f", float(groups[i][STEP])))  # FusedAdam's: per group
            if adam and STEP not in scalars:
                raise CheckpointError(f"{read.path}: sub-group {g} of its Adam state has no step count; the file "
                                      "is corrupt or from another optimizer")
            for name, _shape in base.layout.groups[g]:
                for k, (dtype, value) in scalars.items():
                    key = f"{OPTIM}.{STATE}.{name}.{k}"
                    chunk = scalar_chunk(key, dtype, value) if dtype and isinstance(value, bytes) \
                        else value_chunk(key, value)
                    put(key, (OPTIM, STATE, name, k), chunk, dtype)
    for i, (group, held) in enumerate(zip(groups, members)):
        values = dict(ADAMW_GROUP) if adam else {}
        for k, v in group.items():
            if k == "params" or type(k) is not str:
                continue
            if not _plain(v) or len(repr(v)) > MAX_GROUP_VALUE:
                raise CheckpointError(f"{read.path}: param group {i}'s {k!r} is not a plain value; the file is "
                                      "corrupt or crafted")
            values[k] = tuple(v) if k == "betas" and isinstance(v, list) else v
        values["params"] = [name for g in held for name, _shape in base.layout.groups[g]]
        for k, v in values.items():
            key = f"{OPTIM}.{PARAM_GROUPS}.{i}.{k}"
            put(key, (OPTIM, PARAM_GROUPS, i, k), value_chunk(key, v), None)
    return bytes(data), "AdamW" if adam else OPTIMIZERS.get(tuple(sorted(state_keys)), "the run's optimizer")


def _scalars(read: Rewritable, entry, g: int, state_keys: tuple[str, ...]) -> dict[str, tuple[str | None, object]]:
    """{key: (dtype, raw bytes) of a 0-d tensor, or (None, number)} of sub-group `g`'s optimizer state that is
    not kept per element."""
    if not isinstance(entry, dict):
        raise CheckpointError(f"{read.path}: sub-group {g}'s optimizer state is not a mapping; the file is corrupt")
    found: dict[str, tuple[str | None, object]] = {}
    for key, value in entry.items():
        if key in state_keys:
            continue
        if type(key) is not str or not 0 < len(key) <= MAX_NAME or len(found) >= MAX_STATES:
            raise CheckpointError(f"{read.path}: sub-group {g}'s optimizer state holds entries no optimizer keeps; "
                                  "the file is corrupt or crafted")
        if type(value) in (int, float, bool):
            found[key] = (None, value)
        elif isinstance(value, TensorRef) and value.numel() == 1 and not value.size:
            dtype = dtype_name(value.storage.type_name)
            if dtype not in ITEMSIZE:
                raise CheckpointError(f"{read.path}: sub-group {g}'s {key} is a {dtype} value; the file is corrupt")
            found[key] = (dtype, read.data(value, 8))
        else:
            raise CheckpointError(f"{read.path}: sub-group {g}'s {key} is neither a number nor a 0-d tensor nor "
                                  "kept per element; tailor-tui cannot take it apart by parameter")
    return found


def _plain(value, depth: int = 0) -> bool:
    """A hyperparameter: a number, a string, a bool, None, or a short list or tuple of them."""
    if value is None or type(value) in (bool, int, float, str):
        return True
    return type(value) in (list, tuple) and depth < 2 and len(value) <= 64 and all(_plain(v, depth + 1) for v in value)


__all__ = ["METADATA", "DcpExport", "DcpJob", "Piece", "plan_dcp_export"]
