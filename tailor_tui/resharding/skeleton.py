"""The structure of a resharded output's rank files, big tensors reserved, written without torch.

For each output rank, its model_states and optim_states file as DeepSpeed at the new world
size would save them, but with the space of every big tensor (fp32 master weights, exp_avg,
exp_avg_sq of each sub-group, frozen parameters' fragments) reserved and not written (holes
of a sparse file, written in milliseconds whatever the model's size). Each worker writes the
files of its ranks (`write_rank_file`), then fills them (`rank_reshard`). Everything else is
the base's rank 0 (every rank's is the same but for its slices): optimizer hyperparameters,
loss scaler, counters, scheduler, config; the new `partition_count`/`dp_world_size`,
`param_shapes` and param groups' sub-group lists; each new sub-group's `step` is that of the
base's sub-groups its parameters come from (they must agree); buffers follow their rows' sources.

The base's structure is read by the torch-free reader (`ptfile`), changed as stand-ins, and
written as torch.save would write it (`ptpickle`, `ptwrite`: the same bytes, tested against
torch). Every output rank's two files hold the same structure but their names: each is
pickled once (`skeleton`, where the work is planned) and shared by every job.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import NamedTuple

from tailor_tui.checkpoints.checkpoint import Checkpoint
from tailor_tui.checkpoints.layout import part
from tailor_tui.errors import CheckpointError
from tailor_tui.fileio import Target
from tailor_tui.formats.ds_format import (
    DP_WORLD_SIZE,
    FP32_FLAT_GROUPS,
    FROZEN_PARAM_FRAGMENTS,
    MODULE,
    OPTIMIZER_STATE_DICT,
    PARAM_GROUPS,
    PARAM_SHAPES,
    PARTITION_COUNT,
    PARTITION_GROUPS,
    STATE,
    flat_tensor,
)
from tailor_tui.formats.pickled import Size, TensorRef
from tailor_tui.formats.ptfile import TensorBytes
from tailor_tui.formats.ptpickle import dumps
from tailor_tui.formats.ptwrite import Rewritable, SameArchives, reserved
from tailor_tui.resharding.partition import Reshard, optim_structure_file

# A per-group optimizer value other than the moments (`step`) is compared between sub-groups
# that are merged; none is larger than this in any optimizer DeepSpeed wraps.
MAX_COMPARED_BYTES = 1 << 20


@dataclass(frozen=True)
class Skeleton:
    """What every output rank's two files hold but their names (picklable, computed once and shared
    by every job): each file's pickled structure and where its storages' bytes come from (`Copied`
    from a source, or `Reserved` for the worker to fill), and which storage holds each tensor the
    workers fill: the flat fp32 weights and moments of each sub-group, each frozen fragment."""

    optim: SameArchives  # the optim_states file's pickle and storages
    model: SameArchives  # the model_states file's
    flat: dict  # (sub-group, key: the masters or a state kept per element) -> Hole in the optim_states file
    fragments: dict  # frozen parameter -> Hole in the model_states file


class Hole(NamedTuple):
    """A reserved storage: `data/{index}` of its archive, `numel` elements of `dtype` (torch's
    storage type name) and `itemsize` bytes each."""

    index: int  # type: ignore[assignment]  # a field named as tuple.index, which it hides (a NamedTuple may)
    numel: int
    itemsize: int
    dtype: str

    def located(self, records: dict, archive: str) -> TensorBytes:
        """Where its bytes lie in a file written with `records` (`write_archive`'s)."""
        record = records[f"{archive}/data/{self.index}"]
        return TensorBytes(record, record.data_offset, self.numel, self.itemsize, self.dtype)


def skeleton(base: Checkpoint, sources: tuple[Checkpoint, ...], buffer_sources: dict[str, int],
             reshard: Reshard, keys: tuple[str, ...]) -> Skeleton:
    """The structure every output rank's two files share (CheckpointError when the base's cannot
    be resharded). `buffer_sources`: each buffer -> the index of the source its row is taken from; `keys`: the flat
    tensors of every sub-group (`ComposePlan.keys`: the masters, the optimizer's state kept per element)."""
    fills: dict[int, object] = {}  # id(StorageRef) -> Copied | Reserved: where its bytes come from
    optim = _optim_states(base, reshard, fills, keys)
    states = _model_states(base, sources, buffer_sources, reshard, fills)
    kinds, index = [], {}
    for obj in (optim, states):  # every rank's file holds the same structure: pickled once
        data, storages = dumps(obj)
        index.update({id(s): Hole(k, s.numel, s.itemsize, s.type_name) for k, s in enumerate(storages)})
        kinds.append(SameArchives(data, [fills[id(s)] for s in storages]))
    inner = optim[OPTIMIZER_STATE_DICT]
    flat = {(g, key): index[id(flat_tensor(inner, g, key).storage)]
            for g in range(len(reshard.layout.groups)) for key in keys}
    fragments = {name: index[id(states[FROZEN_PARAM_FRAGMENTS][name].storage)] for name, _ in base.layout.frozen}
    return Skeleton(kinds[0], kinds[1], flat, fragments)


def write_rank_file(path: Target, kind: SameArchives, buffer: memoryview) -> tuple[str, dict]:
    """Write one output rank file of a `Skeleton` (`kind`: its optim or model files'), big tensors
    reserved; (its archive name, its records). Not fsynced: the caller fills it, then fsyncs."""
    archive = path.stem  # torch names an archive's records after its file
    return archive, kind.write(path, archive, buffer)


def _optim_states(base: Checkpoint, reshard: Reshard, fills: dict, keys: tuple[str, ...]) -> dict:
    read = Rewritable(optim_structure_file(base.ranks[0]))
    path, optim = read.path, read.obj
    fills.update(read.fills)
    try:
        inner = optim[OPTIMIZER_STATE_DICT]
        state, groups = inner[OPTIMIZER_STATE_DICT][STATE], inner[OPTIMIZER_STATE_DICT][PARAM_GROUPS]
        flat = inner[FP32_FLAT_GROUPS]
        if not isinstance(state, dict) or not all(isinstance(v, dict) for v in state.values()):
            raise TypeError
    except (KeyError, TypeError):
        raise CheckpointError(f"{path}: not a ZeRO-3 optimizer state; tailor-tui reshards ZeRO stage 3") from None
    if inner.get(PARTITION_GROUPS) is not None:
        raise CheckpointError(f"{path}: its sub-groups are partitioned over groups of their own (AutoEP "
                              "experts); DeepSpeed loads those only at the same placement: it cannot be resharded")
    if type(inner.get(PARTITION_COUNT)) is not int:
        raise CheckpointError(f"{path}: its partition_count is {inner.get(PARTITION_COUNT)!r}, not a ZeRO-3 "
                              "world size; tailor-tui reshards ZeRO stage 3 checkpoints")
    group_of = {slot.name: slot.group for slot in base.layout.slots}
    new_flat, new_state = [], {}
    try:
        for g, (params, size) in enumerate(zip(reshard.layout.groups, reshard.layout.group_sizes(), strict=True)):
            olds = sorted({group_of[name] for name, _shape in params})
            first = olds[0]
            entry = {}
            for key, value in state[first].items():
                if key in keys:  # kept per element: re-partitioned as the masters are
                    entry[key] = reserved(size, value, fills)
                    continue
                for other in olds[1:]:
                    if not _same(read, state[other].get(key), value):
                        raise CheckpointError(
                            f"{path}: sub-groups {first} and {other} hold different '{key}' values, and DeepSpeed "
                            f"at world size {reshard.world_size} would put parameters of both into one sub-group; "
                            "it cannot be resharded")
                entry[key] = read.clone(value, fills) if isinstance(value, TensorRef) else value
            new_state[g] = entry
            new_flat.append(reserved(size, flat[first], fills))
    except (KeyError, IndexError, TypeError, AttributeError):
        raise CheckpointError(f"{path}: its optimizer state does not hold the sub-groups its layout has; "
                              "the file is corrupt or from another run") from None
    inner[FP32_FLAT_GROUPS] = new_flat
    inner[OPTIMIZER_STATE_DICT][STATE] = new_state
    for group, members in zip(groups, reshard.param_groups, strict=True):
        group["params"] = list(members)
    inner[PARTITION_COUNT] = reshard.world_size
    return optim


def _model_states(base: Checkpoint, sources: tuple[Checkpoint, ...], buffer_sources: dict[str, int],
                  reshard: Reshard, fills: dict) -> dict:
    read = Rewritable(base.ranks[0].model_states)
    states = read.obj
    fills.update(read.fills)
    try:
        shapes = states[PARAM_SHAPES]
        container = type(shapes[0]) if shapes else OrderedDict
        states[PARAM_SHAPES] = [container((name, Size(shape)) for name, shape in group)
                                for group in reshard.layout.groups]
        states[DP_WORLD_SIZE] = reshard.world_size
        fragments = states.get(FROZEN_PARAM_FRAGMENTS) or {}
        for name, shape in base.layout.frozen:
            fragments[name] = reserved(part(math.prod(shape), reshard.world_size), fragments[name], fills)
        loaded = {}
        for name, s in buffer_sources.items():  # replicated on every rank: rank 0's
            if s not in loaded:
                loaded[s] = Rewritable(sources[s].ranks[0].model_states)
            states[MODULE][name] = loaded[s].clone(loaded[s].obj[MODULE][name], fills)
    except (KeyError, IndexError, TypeError, AttributeError):
        raise CheckpointError(f"{read.path}: its model states do not hold the parameters and buffers its "
                              "layout has; the file is corrupt or from another run") from None
    return states


def _same(read: Rewritable, a, b) -> bool:
    if isinstance(a, TensorRef) and isinstance(b, TensorRef):
        return (a.storage.type_name == b.storage.type_name and a.size == b.size
                and read.data(a, MAX_COMPARED_BYTES) == read.data(b, MAX_COMPARED_BYTES))
    return type(a) is type(b) and a == b
