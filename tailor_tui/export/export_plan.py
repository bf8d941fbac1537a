"""What exporting a recipe as a plain HF model reads from where and writes to where, decided once.

Every parameter of the composition is one tensor of the exported model, named as the model
names it (and as `save_pretrained` writes it: a tied lm_head has no weights of its own and is
not written). Its values are the fp32 master weights of the checkpoint its row is taken
from: ZeRO-3 keeps each parameter flattened and cut into one part per rank (`layout.Slot`),
so a tensor is put together from one slice of every rank's flat fp32 buffer (a frozen
parameter: of every rank's fragment in model_states). An `ExportJob` is one source rank's
share: for each sub-group's flat buffer (or frozen fragment, or a partial checkpoint's saved
slice) the element ranges to take and the output bytes they go to. Sources are read by
their own layouts, whatever their world size. Persistent buffers (which save_pretrained writes
beside the weights) come from rank 0's model_states of their row's source, as stored. The
files are those save_pretrained shards the model's state dict into (`safetensors_out.lay_out`),
the tensors taken in the state dict's order as the base's model_states records it.

Torch-free; `export_rank` does the jobs.
"""

from __future__ import annotations

import functools
import math
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from tailor_tui.checkpoints.checkpoint import RankFiles, distinct_names
from tailor_tui.checkpoints.layout import part, valid_elements
from tailor_tui.checkpoints.model_states import read_metadata
from tailor_tui.errors import CheckpointError, IncompatibleError
from tailor_tui.events import JobCost
from tailor_tui.formats.ds_format import MODULE
from tailor_tui.formats.pickled import TensorRef, dtype_name
from tailor_tui.formats.safetensors_out import DTYPES, ITEMSIZE, NAMED, Placed, ShardFile, lay_out
from tailor_tui.planning.plan import ComposePlan


@dataclass(frozen=True)
class Span:
    """`count` elements from element `first` of a source tensor, to byte `out_offset` of `out_file`."""

    first: int
    count: int
    out_file: str
    out_offset: int


@dataclass(frozen=True)
class ExportJob(JobCost):
    """One source rank's share of an export (picklable)."""

    task: str
    files: RankFiles  # the source rank's files (a partial checkpoint's: its rows file, no optim file)
    group_sizes: tuple[int, ...]
    groups: tuple[tuple[int, tuple[Span, ...]], ...]  # (sub-group, spans of its flat fp32 buffer)
    saved: tuple[tuple[str, Span], ...]  # (parameter, span) from the partial rows file
    frozen: tuple[tuple[str, Span], ...]  # (parameter, span) of its fragment in model_states
    buffers: tuple[tuple[str, Span], ...]  # (buffer, span) in model_states' module, written as stored
    out_dtype: str  # the weights' safetensors name: F32, BF16, F16
    read_bytes: int
    write_bytes: int

    def files_read(self) -> tuple[Path, ...]:
        """The source files it reads: model_states and the file holding the optimizer state."""
        return (self.files.model_states, self.files.state_file)


@dataclass(frozen=True)
class Export:
    plan: ComposePlan
    dtype: str  # fp32, bf16, fp16
    files: tuple[ShardFile, ...]
    placed: dict[str, Placed]
    index: dict | None
    jobs: tuple[ExportJob, ...]

    def bytes_to_write(self) -> int:
        return sum(f.size for f in self.files)


def plan_export(plan: ComposePlan, dtype: str | None, max_shard: int) -> Export:
    """The export of `plan`'s composition in `dtype` (None: the training dtype)."""
    base = plan.base
    if base.peft:
        raise IncompatibleError(
            f"{base.path}: a PEFT (LoRA) run: its trainable weights are an adapter on a base model, not a plain "
            "HF model; compose it with --apply (the output's adapter_model.safetensors holds each row's adapter "
            "from its pick) and load that with PeftModel.from_pretrained")
    dtype = dtype or base.dtype
    shapes = {name: shape for group in base.layout.groups for name, shape in group} | dict(base.layout.frozen)
    source_of = plan.source_of_param()
    modules = _module_reader(plan)
    buffers = _buffers(plan, source_of, modules)  # name -> (shape, its own dtype): written as stored
    tensors = {name: (shape, DTYPES[dtype]) for name, shape in shapes.items()} | buffers
    files, placed, index = lay_out([(name, *tensors[name]) for name in _state_dict_order(plan, tensors, modules)],
                                   max_shard)
    jobs = []
    labels = distinct_names([ckpt.path for ckpt in plan.sources])
    for s, ckpt in enumerate(plan.sources):
        mine = {name for name, src in source_of.items() if src == s and name in shapes}
        held = tuple((name, Span(0, math.prod(placed[name].shape), placed[name].file, placed[name].offset))
                     for name in sorted(buffers) if source_of[name] == s)
        if mine or held:
            jobs += _jobs_of(ckpt, mine, placed, labels[s] if s else f"{labels[s]} (base)", held, DTYPES[dtype])
    return Export(plan, dtype, tuple(files), placed, index, tuple(jobs))


def _module_reader(plan: ComposePlan) -> Callable[[int], dict | None]:
    """Source s -> the module state dict it saved in its rank-0 model_states (None: none), each
    read once."""
    @functools.cache
    def module(s: int) -> dict | None:
        found = read_metadata(plan.sources[s].ranks[0].model_states).get(MODULE)
        return found if isinstance(found, dict) else None

    return module


def _state_dict_order(plan: ComposePlan, tensors: dict, modules: Callable[[int], dict | None]) -> list[str]:
    """The tensors' names in the model's state dict order, the order save_pretrained shards them
    in: the order of the module state dict DeepSpeed saved in the base's rank-0 model_states
    (`model.state_dict()`'s: a module's parameters, its persistent buffers, then its children's);
    a name it does not list (a frozen parameter a save left out) follows, in the rows' order."""
    listed = [name for name in modules(0) or () if name in tensors]
    rows = [name for row in plan.base.rows for name in (*row.params, *row.buffers) if name in tensors]
    return list(dict.fromkeys([*listed, *rows, *tensors]))


def _buffers(plan: ComposePlan, source_of: dict[str, int],
             modules: Callable[[int], dict | None]) -> dict[str, tuple[tuple[int, ...], str]]:
    """Every buffer the model saves (save_pretrained writes persistent buffers beside the
    weights): its shape and safetensors dtype as its row's source keeps it in rank 0's model_states."""
    return {name: (tensor.size, NAMED[dtype_name(tensor.storage.type_name)])
            for name, tensor in buffer_tensors(plan, source_of, modules).items()}


def buffer_tensors(plan: ComposePlan, source_of: dict[str, int],
                   modules: Callable[[int], dict | None] | None = None) -> dict[str, TensorRef]:
    """Every persistent buffer of the model, as its row's source keeps it in rank 0's model_states (a tensor of
    a dtype safetensors names, of whole-number dimensions; else CheckpointError naming the file)."""
    modules = modules or _module_reader(plan)
    found = {}
    for row in plan.base.rows:
        for name in row.buffers:
            s = source_of[name]
            path = plan.sources[s].ranks[0].model_states
            module = modules(s)
            tensor = module.get(name) if module is not None else None
            if (not isinstance(tensor, TensorRef) or NAMED.get(dtype_name(tensor.storage.type_name)) is None
                    or not all(type(d) is int and d >= 0 for d in tensor.size)):
                raise CheckpointError(f"{path}: has no readable buffer {name}; the file is damaged or from "
                                      "another model")
            found[name] = tensor
    return found


def _jobs_of(ckpt, names: set[str], placed: dict[str, Placed], label: str,
             buffers: tuple[tuple[str, Span], ...], out_dtype: str) -> list[ExportJob]:
    slots = {slot.name: slot for slot in ckpt.layout.slots}
    frozen = dict(ckpt.layout.frozen)
    sizes = tuple(ckpt.layout.group_sizes())
    jobs = []
    for rank, files in enumerate(ckpt.ranks):
        groups, saved, fragments, read, written = defaultdict(list), [], [], 0, 0
        for name in sorted(names):
            out = placed[name]
            size = ITEMSIZE[out.dtype]
            if name in frozen:
                numel = math.prod(frozen[name])
                each = part(numel, ckpt.world_size)
                count = valid_elements(numel, each, rank)
                if count:
                    fragments.append((name, Span(0, count, out.file, out.offset + rank * each * size)))
                    written += count * size
                    read += each * (4 if ckpt.dtype == "fp32" else 2)  # the fragment is read whole
                continue
            slot = slots.get(name)
            if slot is None:
                raise CheckpointError(f"{ckpt.path}: has no parameter {name}; it is from another model")
            count = slot.valid(rank)
            if not count:
                continue
            span = Span(slot.offset, count, out.file, out.offset + rank * slot.part * size)
            written += count * size
            if not files.whole_records:  # a partial save's slices, by parameter
                saved.append((name, Span(0, count, span.out_file, span.out_offset)))
                read += count * 4
            else:
                groups[slot.group].append(span)
        read += sum(sizes[g] * 4 for g in groups)  # a sub-group's flat buffer is read whole (its CRC-32)
        mine = buffers if rank == 0 else ()  # replicated on every rank: rank 0's
        read += sum(placed[name].nbytes for name, _span in mine)
        written += sum(placed[name].nbytes for name, _span in mine)
        jobs.append(ExportJob(f"{label} rank {rank}", files, sizes,
                              tuple(sorted((g, tuple(spans)) for g, spans in groups.items())), tuple(saved),
                              tuple(fragments), mine, out_dtype, read, written))
    return jobs
