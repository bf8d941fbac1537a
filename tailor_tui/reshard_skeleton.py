"""The structure of a resharded output's rank files, written by torch, big tensors reserved.

For each output rank, its model_states and optim_states file as DeepSpeed at the new world
size would save them, but with the space of every big tensor (fp32 master weights, exp_avg,
exp_avg_sq of each sub-group, frozen parameters' fragments) reserved and not written
(`rank_torch.save_reserving`: sparse files, written in milliseconds whatever the model's
size); `rank_reshard` fills them in worker processes. Everything else is the base's rank 0
(every rank's is the same but for its slices): optimizer hyperparameters, loss scaler,
counters, scheduler, config; the new `partition_count`/`dp_world_size`, `param_shapes` and
param groups' sub-group lists; each new sub-group's `step` is that of the base's sub-groups
its parameters come from (they must agree); buffers follow their rows' sources.

Importing this module imports torch; the merge imports it only when it reshards.
"""

from __future__ import annotations

import math
import os
from collections import OrderedDict
from pathlib import Path

import torch

from .checkpoint import Checkpoint
from .ds_format import (
    DP_WORLD_SIZE,
    EXP_AVG,
    EXP_AVG_SQ,
    FP32_FLAT_GROUPS,
    FROZEN_PARAM_FRAGMENTS,
    MODULE,
    OPTIMIZER_STATE_DICT,
    PARAM_GROUPS,
    PARAM_SHAPES,
    PARTITION_COUNT,
    PARTITION_GROUPS,
    STATE,
    TENSORS,
    flat_tensor,
)
from .errors import CheckpointError
from .layout import part
from .ptfile import frozen_fragment_bytes, read_structure
from .rank_stream import flat_tensor_bytes
from .rank_torch import save_reserving
from .reshard import Reshard, optim_structure_file, output_names
from .safe_load import load_pt


def write_skeletons(base: Checkpoint, sources: tuple[Checkpoint, ...], buffer_sources: dict[str, int],
                    reshard: Reshard, tag_dir: Path, cancelled=lambda: False) -> None:
    """Every output rank's two files in `tag_dir`, big tensors reserved, rank by rank. Each file
    is written in a hidden folder beside `tag_dir` under its own name (torch names an archive's
    records after its file) and renamed into place whole: the workers filling them wait for
    them. `buffer_sources`: each buffer -> the index of the source its row is taken from."""
    optim = _optim_states(base, reshard)
    states = _model_states(base, sources, buffer_sources, reshard)
    staging = tag_dir.parent / ".skeletons"
    staging.mkdir()
    for model_name, optim_name in output_names(base, reshard.world_size):
        if cancelled():
            return
        for obj, name, big in ((optim, optim_name, _big_optim_tensors(optim)),
                               (states, model_name, states.get(FROZEN_PARAM_FRAGMENTS) or {})):
            save_reserving(obj, staging / name, _storages(big))
            os.rename(staging / name, tag_dir / name)
    staging.rmdir()


def _storages(tensors) -> set[int]:
    values = tensors.values() if isinstance(tensors, dict) else tensors
    return {t.untyped_storage()._cdata for t in values}


def _big_optim_tensors(optim: dict) -> list:
    inner = optim[OPTIMIZER_STATE_DICT]
    return [flat_tensor(inner, g, key) for g in range(len(inner[FP32_FLAT_GROUPS])) for key in TENSORS]


def _optim_states(base: Checkpoint, reshard: Reshard) -> dict:
    path = optim_structure_file(base.ranks[0])
    sizes = tuple(base.layout.group_sizes())
    if base.ranks[0].rows is None:  # a full base: its flat tensors are streamed by the workers, never by torch
        obj, records, prefix = read_structure(path)
        unread = {tb.record.name for tb in flat_tensor_bytes(obj, records, prefix, path, sizes).values()}
    else:
        unread = set()  # a partial checkpoint's skeleton holds no big tensors
    optim = load_pt(path, unread=frozenset(unread))
    try:
        inner = optim[OPTIMIZER_STATE_DICT]
        state, groups = inner[OPTIMIZER_STATE_DICT][STATE], inner[OPTIMIZER_STATE_DICT][PARAM_GROUPS]
        flat = inner[FP32_FLAT_GROUPS]
    except (KeyError, TypeError):
        raise CheckpointError(f"{path}: not a ZeRO-3 optimizer state; tailor-tui reshards ZeRO stage 3") from None
    if inner.get(PARTITION_GROUPS) is not None:
        raise CheckpointError(f"{path}: its sub-groups are partitioned over groups of their own (AutoEP "
                              "experts); DeepSpeed loads those only at the same placement: it cannot be resharded")
    if not isinstance(inner.get(PARTITION_COUNT), int):
        raise CheckpointError(f"{path}: its partition_count is {inner.get(PARTITION_COUNT)!r}, not a ZeRO-3 "
                              "world size; tailor-tui reshards ZeRO stage 3 checkpoints")
    group_of = {slot.name: slot.group for slot in base.layout.slots}
    new_flat, new_state = [], {}
    for g, (params, size) in enumerate(zip(reshard.layout.groups, reshard.layout.group_sizes(), strict=True)):
        olds = sorted({group_of[name] for name, _shape in params})
        first = olds[0]
        entry = {}
        for key, value in state[first].items():
            if key in (EXP_AVG, EXP_AVG_SQ):
                entry[key] = _reserved(size, value)
                continue
            if torch.is_tensor(value) and value.dim() > 0 and value.numel() == sizes[first] > 1:
                raise CheckpointError(f"{path}: sub-group {first} holds optimizer state '{key}' per element; "
                                      "tailor-tui reshards Adam's exp_avg and exp_avg_sq and nothing else")
            for other in olds[1:]:
                if not _same(state[other].get(key), value):
                    raise CheckpointError(
                        f"{path}: sub-groups {first} and {other} hold different '{key}' values, and DeepSpeed at "
                        f"world size {reshard.world_size} would put parameters of both into one sub-group; "
                        "it cannot be resharded")
            entry[key] = value.clone() if torch.is_tensor(value) else value
        new_state[g] = entry
        new_flat.append(_reserved(size, flat[first]))
    inner[FP32_FLAT_GROUPS] = new_flat
    inner[OPTIMIZER_STATE_DICT][STATE] = new_state
    for group, members in zip(groups, reshard.param_groups, strict=True):
        group["params"] = list(members)
    inner[PARTITION_COUNT] = reshard.world_size
    return optim


def _model_states(base: Checkpoint, sources: tuple[Checkpoint, ...], buffer_sources: dict[str, int],
                  reshard: Reshard) -> dict:
    path = base.ranks[0].model_states
    frozen = [name for name, _shape in base.layout.frozen]
    unread = {tb.record.name for tb in frozen_fragment_bytes(path, frozen).values()}
    states = load_pt(path, unread=frozenset(unread))
    shapes = states[PARAM_SHAPES]
    container = type(shapes[0]) if shapes else OrderedDict
    states[PARAM_SHAPES] = [container((name, torch.Size(shape)) for name, shape in group)
                            for group in reshard.layout.groups]
    states[DP_WORLD_SIZE] = reshard.world_size
    fragments = states.get(FROZEN_PARAM_FRAGMENTS) or {}
    for name, shape in base.layout.frozen:
        fragments[name] = _reserved(part(math.prod(shape), reshard.world_size), fragments[name])
    loaded = {}
    for name, s in buffer_sources.items():  # replicated on every rank: rank 0's
        if s not in loaded:
            loaded[s] = load_pt(sources[s].ranks[0].model_states, unread=frozenset(
                tb.record.name for tb in frozen_fragment_bytes(sources[s].ranks[0].model_states, frozen).values()))
        states[MODULE][name] = loaded[s][MODULE][name].clone()
    return states


def _reserved(size: int, like) -> torch.Tensor:
    """An uninitialised 1-D tensor of `size` elements like `like` (dtype, requires_grad): its
    pages are never touched, so it takes no memory; torch.save only reserves its space."""
    return torch.empty(size, dtype=like.dtype).requires_grad_(like.requires_grad)


def _same(a, b) -> bool:
    if torch.is_tensor(a) and torch.is_tensor(b):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    return type(a) is type(b) and a == b
