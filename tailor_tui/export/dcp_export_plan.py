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

import struct
from dataclasses import dataclass

from tailor_tui.checkpoints.checkpoint import distinct_names
from tailor_tui.dcp.chunks import ITEMSIZE, scalar_chunk, value_chunk
from tailor_tui.dcp.metadata import (
    METADATA,
    Metadata,
)
from tailor_tui.errors import CheckpointError
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
from tailor_tui.formats.dtypes import STORAGE_DTYPE
from tailor_tui.formats.pickled import TensorRef, dtype_name
from tailor_tui.formats.ptwrite import Rewritable
from tailor_tui.planning.dcp_layout import MODEL, OPTIM, DcpJob, Entries, ModelShapes, Piece, rank_job
from tailor_tui.planning.plan import ComposePlan
from tailor_tui.resharding.partition import param_groups_of

# torch.optim.AdamW's param group keys and defaults (torch 2.13): a loading AdamW asks for every one
ADAMW_GROUP = {"lr": 0.001, "betas": (0.9, 0.999), "eps": 1e-08, "weight_decay": 0.01, "amsgrad": False,
               "maximize": False, "foreach": None, "capturable": False, "differentiable": False, "fused": None,
               "decoupled_weight_decay": True}
MAX_GROUP_VALUE = 4096  # characters of a param group value's repr: a longer one is no hyperparameter


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


def plan_dcp_export(plan: ComposePlan) -> DcpExport:
    """The DCP export of `plan`'s composition."""
    base = plan.base
    shapes = {name: shape for group in base.layout.groups for name, shape in group}
    frozen = dict(base.layout.frozen)
    aliases = {alias: target for row in base.rows for alias, target in row.aliases}
    source_of = plan.source_of_param()
    state_keys = tuple(k for k in plan.keys if k != MASTERS)
    out = Entries()
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
    model = ModelShapes(shapes, frozen, buffers, state_keys, out)
    jobs: list[DcpJob] = []
    labels = distinct_names([ckpt.path for ckpt in plan.sources])
    for s, ckpt in enumerate(plan.sources):
        mine = sorted(n for n in shapes if source_of.get(n) == s)
        tied = sorted((a, t) for a, t in aliases.items() if source_of.get(t) == s and t in shapes)
        cold = sorted(n for n in frozen if source_of.get(n) == s)
        held = sorted(n for n in buffers if source_of.get(n) == s)
        for rank, files in enumerate(ckpt.ranks):
            job = rank_job(model, ckpt, rank, files, name=f"__{len(jobs)}_0.distcp",
                       label=labels[s] if s else f"{labels[s]} (base)", mine=mine, tied=tied, cold=cold,
                       held=held if rank == 0 else [])
            if job is not None:
                jobs.append(job)
    small_file = f"__{len(jobs)}_0.distcp"
    small, optimizer = _optimizer_values(plan, shapes, state_keys, out, small_file)
    return DcpExport(plan, tuple(jobs), small_file, small, out.metadata(str(plan.output)), optimizer,
                     len(out.kinds), bool(base.peft))


def _buffer_kinds(plan: ComposePlan, source_of: dict[str, int]) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Every persistent buffer: its dtype and shape, as its row's source keeps it in rank 0's model_states."""
    found = {}
    for name, tensor in buffer_tensors(plan, source_of).items():
        found[name] = (STORAGE_DTYPE.get(tensor.storage.type_name, "float32"), tuple(tensor.size))
    return found


def _optimizer_values(plan: ComposePlan, shapes, state_keys: tuple[str, ...], out: Entries,
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
            out.chunk(key, (), (), file=file, at=len(data), length=len(chunk))
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
