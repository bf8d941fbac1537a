"""Re-checking a resharded output (`--verify` of a recipe with a world size), byte for byte.

For every output rank, each piece of every sub-group's fp32 master weights, exp_avg and
exp_avg_sq, and of every frozen parameter's fragment, equals the elements of the source rank
it comes from (located by that source's own layout, read independently of the writer), and
padding is zero bytes. Everything else must be what DeepSpeed at the new world size would
hold: the base's rank 0 with `partition_count`/`dp_world_size` the new world size, the new
`param_shapes` and param groups' sub-group lists, each new sub-group's state (its `step`)
that of the base's sub-group its first parameter came from, and buffers from their rows'
sources. Every record of every torch file read is checked against its CRC-32 (`load_pt`).
"""

from __future__ import annotations

from tailor_tui.compose.compare import PartialSlices, differences, nonzero_bytes, same_bytes
from tailor_tui.formats.ds_format import (
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
    STATE,
    TENSORS,
    flat_tensor,
    optimizer_state,
)
from tailor_tui.events import ByteCounter
from tailor_tui.resharding.partition import ZEROS, optim_structure_file
from tailor_tui.formats.safe_load import load_pt

OUTER = f"[{OPTIMIZER_STATE_DICT!r}]"
# paths in an optim file that differ from the base's by design; each is checked on its own
REPLACED = (f"{OUTER}[{FP32_FLAT_GROUPS!r}]", f"{OUTER}{OUTER}[{STATE!r}]", f"{OUTER}[{PARTITION_COUNT!r}]")


def verify_resharded(plan, composed, report, emit, cancelled) -> None:
    """Check every output rank of a resharded `plan` (`report`: verify.VerifyReport)."""
    base_optim = load_pt(optim_structure_file(plan.base.ranks[0]))
    base_states = load_pt(plan.base.ranks[0].model_states)
    buffers = {s: load_pt(plan.sources[s].ranks[0].model_states) for s in set(plan.buffer_sources().values())}
    for job in plan.rank_jobs():
        _verify_rank(plan, job, composed, report, emit, cancelled, base_optim, base_states, buffers)


def _verify_rank(plan, job, composed, report, emit, cancelled, base_file, base_states, buffer_states) -> None:

    counter = ByteCounter(f"rank {job.rank}", job.write_bytes, emit, cancelled)
    reshard, rank = plan.reshard, job.rank
    mine = composed.ranks[rank].optim_states
    got_file = load_pt(mine)
    got = optimizer_state(got_file, mine, job.group_sizes)
    loaded, partial = {}, PartialSlices()

    def source_slice(p, key: str):
        files = job.files[p.source, p.rank]
        if key == "frozen":
            if files.model_states not in loaded:
                loaded[files.model_states] = load_pt(files.model_states)
            return loaded[files.model_states][FROZEN_PARAM_FRAGMENTS][p.param][p.offset: p.offset + p.length]
        if files.rows is not None:  # the whole slice, checked, then the piece
            return partial.get(files.rows, f"{key}/{p.param}", p.whole)[p.within: p.within + p.length]
        if files.optim_states not in loaded:
            path = files.optim_states
            loaded[path] = optimizer_state(load_pt(path), path, job.source_sizes[p.source])
        return flat_tensor(loaded[files.optim_states], p.group, key)[p.offset: p.offset + p.length]

    def check(tensor, pieces, key: str) -> None:
        for p in pieces:
            out = tensor[p.at: p.at + p.length]
            if p.source == ZEROS:
                if nonzero_bytes(out):
                    report.add(p.row, f"rank {rank}: padding after {p.param} ({key}) is not zero bytes")
            elif not same_bytes(out, source_slice(p, key)):
                report.add(p.row, f"rank {rank}: {key} of {p.param} (elements {p.at}…) differs from "
                                  f"{plan.sources[p.source].name} rank {p.rank}")
            counter.add(p.length * 4)

    for g, pieces in enumerate(job.groups):
        for key in TENSORS:
            check(flat_tensor(got, g, key), pieces, key)

    base_inner = base_file[OPTIMIZER_STATE_DICT]
    for where in differences(got_file, base_file, skip=_replaced)[:5]:
        report.add(None, f"rank {rank}: optimizer state {where} is not the base's")
    if got.get(PARTITION_COUNT) != reshard.world_size:
        report.add(None, f"rank {rank}: partition_count is {got.get(PARTITION_COUNT)!r}, not {reshard.world_size}")
    for i, (group, members) in enumerate(zip(got[OPTIMIZER_STATE_DICT][PARAM_GROUPS], reshard.param_groups)):
        if list(group.get("params", ())) != list(members):
            report.add(None, f"rank {rank}: param group {i} lists sub-groups {group.get('params')}, "
                             f"DeepSpeed at world size {reshard.world_size} has {list(members)}")
    state, base_state = got[OPTIMIZER_STATE_DICT][STATE], base_inner[OPTIMIZER_STATE_DICT][STATE]
    if sorted(state) != list(range(len(reshard.layout.groups))):
        report.add(None, f"rank {rank}: optimizer state of sub-groups {sorted(state)}, expected "
                         f"{len(reshard.layout.groups)}")
    group_of = {slot.name: slot.group for slot in plan.base.layout.slots}
    for g, params in enumerate(reshard.layout.groups):
        first = group_of[params[0][0]]
        found = differences(state.get(g), base_state.get(first), f"[{STATE!r}][{g}]",
                            skip=lambda w: w.endswith((f"[{EXP_AVG!r}]", f"[{EXP_AVG_SQ!r}]")))
        for where in found[:2]:
            report.add(None, f"rank {rank}: optimizer state {where} is not the base's sub-group {first}'s")
    _model_states(plan, job, composed, report, check, base_states, buffer_states)
    counter.finish()


def _replaced(where: str) -> bool:
    return where.startswith(REPLACED) or (
        where.startswith(f"{OUTER}{OUTER}[{PARAM_GROUPS!r}]") and where.endswith("['params']"))


def _model_states(plan, job, composed, report, check, base, buffer_states) -> None:
    rank, reshard = job.rank, plan.reshard
    states = load_pt(composed.ranks[rank].model_states)
    if states.get(DP_WORLD_SIZE) != reshard.world_size:
        report.add(None, f"rank {rank}: model_states dp_world_size is {states.get(DP_WORLD_SIZE)!r}, "
                         f"not {reshard.world_size}")
    shapes = [tuple((name, tuple(shape)) for name, shape in group.items()) for group in states.get(PARAM_SHAPES) or ()]
    if tuple(shapes) != reshard.layout.groups:
        report.add(None, f"rank {rank}: model_states param_shapes are not DeepSpeed's sub-groups at world size "
                         f"{reshard.world_size}")
    fragments = states.get(FROZEN_PARAM_FRAGMENTS) or {}
    for name, pieces in job.frozen:
        check(fragments[name].reshape(-1), pieces, "frozen")
    buffers = plan.buffer_sources()
    for name, s in buffers.items():
        if not same_bytes(states[MODULE][name], buffer_states[s][MODULE][name]):
            report.add(plan.base.param_to_row()[name], f"rank {rank}: buffer {name} differs from "
                                                       f"{plan.sources[s].name}")
    skip = {f"[{DP_WORLD_SIZE!r}]", f"[{PARAM_SHAPES!r}]", *(f"[{MODULE!r}][{b!r}]" for b in buffers)}
    for where in differences(states, base, skip=lambda w: w in skip or w.startswith(
            f"[{FROZEN_PARAM_FRAGMENTS!r}]"))[:5]:
        report.add(None, f"rank {rank}: model_states {where} is not the base's")
