"""Re-checking a resharded output (`--verify` of a recipe with a world size), byte for byte.

For every output rank, each piece of every sub-group's fp32 master weights, exp_avg and
exp_avg_sq, and of every frozen parameter's fragment, equals the elements of the source rank
it comes from (`pieces`: located by each checkpoint's own layout, worked out here, not taken from
the plan's jobs the writers follow), and padding is zero bytes. Everything else must be what
DeepSpeed at the new world size would hold: the base's rank 0 with `partition_count`/
`dp_world_size` the new world size, the new `param_shapes` and param groups' sub-group lists, each
new sub-group's state (its `step`) that of the base's sub-group its first parameter came from, and
buffers from their rows' sources. Every record of every torch file read is checked against its
CRC-32 (`torch_files`), every partial slice against the CRC-32 its save recorded (`rows_files`).

What it costs goes with the bytes, not with the pieces or the ranks (a 512-rank output of a small
model is hundreds of thousands of pieces of a few elements, nearly all padding, and 512 model_states
files of hundreds of parameter placeholders each): each output tensor is compared whole against its
pieces' bytes put side by side, and piece by piece only when it differs, so that each difference is
reported on its own; a model_states file holding what one checked before (`same_content`) is not
unpickled by torch again, nor its structure compared again, though every byte of it is read and checked.
"""

from __future__ import annotations

from pathlib import Path

from tailor_tui.errors import CheckpointError
from tailor_tui.events import ByteCounter
from tailor_tui.formats.ds_format import (
    DP_WORLD_SIZE,
    FP32_FLAT_GROUPS,
    FROZEN_PARAM_FRAGMENTS,
    MODULE,
    OPTIMIZER_STATE_DICT,
    PARAM_GROUPS,
    PARAM_SHAPES,
    PARTITION_COUNT,
    STATE,
    describe_state,
    flat_keys,
    flat_tensor,
    optimizer_state,
)
from tailor_tui.verifying.compare import differences, nonzero_bytes, same_bytes
from tailor_tui.verifying.dcp_sources import DcpTensors, is_dcp_rank
from tailor_tui.verifying.pieces import ZEROS, OutputPieces
from tailor_tui.verifying.recorded import FROZEN, Archives, RankRows, settle
from tailor_tui.verifying.rows_files import RowsFiles
from tailor_tui.verifying.same_content import SameContent
from tailor_tui.verifying.torch_files import load

OUTER = f"[{OPTIMIZER_STATE_DICT!r}]"
# paths in an optim file that differ from the base's by design; each is checked on its own
REPLACED = (f"{OUTER}[{FP32_FLAT_GROUPS!r}]", f"{OUTER}{OUTER}[{STATE!r}]", f"{OUTER}[{PARTITION_COUNT!r}]")


def verify_resharded(plan, composed, report, emit, cancelled, *, changed: set[int] = frozenset(),  # type: ignore[assignment]
                     taken: dict | None = None, archives: Archives | None = None) -> None:
    """Check every output rank of a resharded `plan` (`report`: recipe.VerifyReport). A source that changed
    since the composition (`changed`) is not read: the rows it gave are proven against what the
    composition recorded it took (`taken`, `verifying.recorded`), as every row is where the record holds it,
    and the rest of the rank files against the records the composition wrote (`archives`)."""
    first = plan.base.ranks[0]
    base_optim = base_states = None
    # (asked only where the base or a buffer's source changed: what else a source gave, its rows, the record proves)
    asked = 0 in changed or any(s in changed for s in plan.buffer_sources().values())
    written = archives is not None and asked and all(archives.proven(names) for names in plan.output_rank_files())
    if 0 not in changed:
        base_optim = load(first.structure_file)
        base_states = load(first.model_states)
    elif not written:
        report.unproven.append("the output's optimizer state but the rows' tensors, and its model_states but "
                               "the frozen fragments, not compared: the base changed since the composition")
    buffers = {s: load(plan.sources[s].ranks[0].model_states) for s in set(plan.buffer_sources().values())
               if s not in changed}
    for name, s in plan.buffer_sources().items():
        if s in changed and not written:
            report.unproven.append(f"buffer {name}: not compared: {plan.sources[s].name} changed since the "
                                   "composition")
    where, same = OutputPieces(plan), SameContent()
    loaded: dict[Path, object] = {}  # source files by path (`_verify_rank`)
    totals = {job.rank: job.write_bytes for job in plan.rank_jobs()}  # progress: what the plan writes
    for rank in range(plan.world_size):
        rows = RankRows()
        _verify_rank(plan, rank, where, composed, report, ByteCounter(f"rank {rank}", totals[rank], emit, cancelled),
                     base_optim, base_states, buffers, same, loaded, rows, changed, taken is not None)
        settle(report, rank, rows, taken, [src.name for src in plan.sources])


def _verify_rank(plan, rank, where, composed, report, counter, base_file, base_states, buffer_states, same,
                 loaded, rows: RankRows, changed: set[int], proving: bool) -> None:
    """`loaded`: source files loaded, by path: those the previous rank loaded are kept for this
    one where it takes from them too (neighbouring ranks take from the same source ranks). A source
    file that fails its checks now, which the composition read and checked, is a source changed since
    (`changed` gets it) where the output's record proves its rows (`proving`)."""
    reshard = plan.reshard
    groups, frozen = where.groups(rank), where.frozen(rank)
    mine = composed.ranks[rank].optim_states
    got_file = load(mine)
    got = optimizer_state(got_file, mine, tuple(reshard.layout.group_sizes()))
    if (found := flat_keys(got, mine, tuple(reshard.layout.group_sizes()))) != plan.keys:
        report.add(None, f"rank {rank}: its optimizer keeps {describe_state(found[1:])} per element, the "
                         f"checkpoints composed {describe_state(plan.keys[1:])}")
    wanted = {path for pieces in (*groups, *(ps for _n, ps in frozen)) for p in pieces if p.source != ZEROS
              for path in (plan.sources[p.source].ranks[p.rank].optim_states,
                           plan.sources[p.source].ranks[p.rank].model_states)}
    for path in [path for path in loaded if path not in wanted]:
        del loaded[path]
    partial, dcp = RowsFiles(), DcpTensors()

    def source_of(p, key: str):
        """The source tensor piece `p` is taken from, and its first element there."""
        try:
            return read_source(p, key)
        except CheckpointError as exc:
            if not proving:
                raise
            report.changed_in_place(f"{exc} (the composition read it and checked it)")
            changed.add(p.source)
            raise _Changed from None

    def read_source(p, key: str):
        files = plan.sources[p.source].ranks[p.rank]
        if key == FROZEN:
            if files.model_states not in loaded:
                loaded[files.model_states] = load(files.model_states)
            return loaded[files.model_states][FROZEN_PARAM_FRAGMENTS][p.param], p.offset
        if is_dcp_rank(files):  # a PyTorch Distributed Checkpoint: the parameter's whole tensor, then the piece
            return dcp.flat(files, key, p.param), p.within
        if not files.whole_records:  # a partial checkpoint: the whole slice, checked, then the piece
            return partial.slice(files.state_file, f"{key}/{p.param}", p.whole), p.within
        if files.optim_states not in loaded:
            path, sizes = files.optim_states, tuple(plan.sources[p.source].layout.group_sizes())
            loaded[path] = optimizer_state(load(path), path, sizes)
        return flat_tensor(loaded[files.optim_states], p.group, key), p.offset

    def check(tensor, pieces, key: str) -> None:
        for p in sorted(pieces, key=lambda p: p.at):  # what the output holds of each row, in its order
            if p.source != ZEROS:
                rows.crcs.add(p.row, key, tensor[p.at: p.at + p.length])
        while True:
            try:
                compare(tensor, pieces, key)
                break
            except _Changed:  # a source found changed: compared again without it
                continue
        for p in pieces:
            if p.source != ZEROS and p.source in changed:
                rows.from_changed[p.row] = p.source

    def compare(tensor, pieces, key: str) -> None:
        for batch in _batches([p for p in pieces if p.source not in changed]):
            if whole_matches(tensor, batch, lambda p: source_of(p, key)):
                counter.add(sum(p.length for p in batch) * 4)
                continue
            for p in batch:  # one piece, or it differs somewhere: where, piece by piece
                out = tensor[p.at: p.at + p.length]
                if p.source == ZEROS:
                    if nonzero_bytes(out):
                        report.add(p.row, f"rank {rank}: padding after {p.param} ({key}) is not zero bytes")
                else:
                    whole, at = source_of(p, key)
                    if not same_bytes(out, whole[at: at + p.length]):
                        rows.differs(p.row, f"rank {rank}: {key} of {p.param} (elements {p.at}…) differs from "
                                            f"{plan.sources[p.source].name} rank {p.rank}", p.source)
                counter.add(p.length * 4)

    for g, pieces in enumerate(groups):
        for key in plan.keys:
            if (tensor := flat_tensor(got, g, key)) is not None:
                check(tensor, pieces, key)

    for difference in differences(got_file, base_file, skip=_replaced)[:5] if base_file is not None else ():
        report.add(None, f"rank {rank}: optimizer state {difference} is not the base's")
    if got.get(PARTITION_COUNT) != reshard.world_size:
        report.add(None, f"rank {rank}: partition_count is {got.get(PARTITION_COUNT)!r}, not {reshard.world_size}")
    for i, (group, members) in enumerate(zip(got[OPTIMIZER_STATE_DICT][PARAM_GROUPS], reshard.param_groups)):
        if list(group.get("params", ())) != list(members):
            report.add(None, f"rank {rank}: param group {i} lists sub-groups {group.get('params')}, "
                             f"DeepSpeed at world size {reshard.world_size} has {list(members)}")
    state = got[OPTIMIZER_STATE_DICT][STATE]
    if sorted(state) != list(range(len(reshard.layout.groups))):
        report.add(None, f"rank {rank}: optimizer state of sub-groups {sorted(state)}, expected "
                         f"{len(reshard.layout.groups)}")
    group_of = {slot.name: slot.group for slot in plan.base.layout.slots}
    base_state = base_file[OPTIMIZER_STATE_DICT][OPTIMIZER_STATE_DICT][STATE] if base_file is not None else {}
    for g, params in enumerate(reshard.layout.groups if base_file is not None else ()):
        first = group_of[params[0][0]]
        unlike = differences(state.get(g), base_state.get(first), f"[{STATE!r}][{g}]",
                             skip=lambda w: w.endswith(tuple(f"[{key!r}]" for key in plan.keys[1:])))
        for difference in unlike[:2]:
            report.add(None, f"rank {rank}: optimizer state {difference} is not the base's sub-group {first}'s")
    _model_states(plan, rank, frozen, composed, report, check, base_states, buffer_states, same)
    counter.finish()


class _Changed(Exception):
    """A source file the composition read and checked fails its checks now (`changed` has it)."""


def _replaced(where: str) -> bool:
    return where.startswith(REPLACED) or (
        where.startswith(f"{OUTER}{OUTER}[{PARAM_GROUPS!r}]") and where.endswith("['params']"))


def _model_states(plan, rank, frozen, composed, report, check, base, buffer_states, same) -> None:
    states, found = same.load(composed.ranks[rank].model_states, tuple(name for name, _pieces in frozen))
    if not found:  # what it holds is checked once per content, every rank's frozen pieces on their own
        found["layout"], found["rest"] = _states_problems(plan, states, base, buffer_states)
    for row, problem in found["layout"]:
        report.add(row, f"rank {rank}: {problem}")
    fragments = states.get(FROZEN_PARAM_FRAGMENTS) or {}
    for name, pieces in frozen:
        check(fragments[name].reshape(-1), pieces, FROZEN)
    for row, problem in found["rest"]:
        report.add(row, f"rank {rank}: {problem}")


def _states_problems(plan, states, base, buffer_states) -> tuple[list, list]:
    """(row, problem) found in a loaded model_states file but in its frozen fragments: those
    found before its frozen fragments are checked, and those after (the order they are reported in)."""
    reshard, layout, rest = plan.reshard, [], []
    if states.get(DP_WORLD_SIZE) != reshard.world_size:
        layout.append((None, f"model_states dp_world_size is {states.get(DP_WORLD_SIZE)!r}, not {reshard.world_size}"))
    shapes = [tuple((name, tuple(shape)) for name, shape in group.items()) for group in states.get(PARAM_SHAPES) or ()]
    if tuple(shapes) != reshard.layout.groups:
        layout.append((None, f"model_states param_shapes are not DeepSpeed's sub-groups at world size "
                             f"{reshard.world_size}"))
    buffers = plan.buffer_sources()
    for name, s in buffers.items():
        if s in buffer_states and not same_bytes(states[MODULE][name], buffer_states[s][MODULE][name]):
            rest.append((plan.base.param_to_row()[name], f"buffer {name} differs from {plan.sources[s].name}"))
    skip = {f"[{DP_WORLD_SIZE!r}]", f"[{PARAM_SHAPES!r}]", *(f"[{MODULE!r}][{b!r}]" for b in buffers)}
    for where in differences(states, base, skip=lambda w: w in skip or w.startswith(
            f"[{FROZEN_PARAM_FRAGMENTS!r}]"))[:5] if base is not None else ():
        rest.append((None, f"model_states {where} is not the base's"))
    return layout, rest


BATCH = 1 << 18  # elements: the pieces compared at once hold at most this many, or are one piece


def _batches(pieces):
    """`pieces` in runs of consecutive pieces of at most BATCH elements together, or of one piece."""
    batch, held = [], 0
    for p in pieces:
        if batch and held + p.length > BATCH:
            yield batch
            batch, held = [], 0
        batch.append(p)
        held += p.length
    if batch:
        yield batch


def whole_matches(tensor, pieces, source_of) -> bool:
    """Whether the 1-D `tensor` holds the bytes of `pieces`, two or more pieces side by side
    (`source_of(piece)`: the tensor a source piece is taken from and its first element there;
    padding: zero bytes), compared at once. False too where that cannot be told so (one piece,
    pieces apart, a source that is no 1-D contiguous tensor of the tensor's dtype holding the
    piece, a tensor too short): the caller compares those piece by piece, reporting each difference."""
    import torch

    if len(pieces) < 2 or tensor.dim() != 1:
        return False
    size, first, end = tensor.element_size(), pieces[0].at, pieces[0].at
    parts, padding = [], 0
    sources: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id of a source tensor -> it, and its bytes
    for p in pieces:
        if p.at != end:
            return False
        end += p.length
        if p.source == ZEROS:
            padding += p.length  # joined with the padding next to it
            continue
        if padding:
            parts.append(torch.zeros(padding * size, dtype=torch.uint8))
            padding = 0
        whole, at = source_of(p)
        held = sources.get(id(whole))
        if held is None:
            if whole.dtype != tensor.dtype or whole.dim() != 1 or not whole.is_contiguous():
                return False
            held = sources[id(whole)] = (whole, whole.view(torch.uint8))  # (kept: its id stays its own)
        if at < 0 or at + p.length > len(held[0]):
            return False
        parts.append(held[1][at * size: (at + p.length) * size])
    if padding:
        parts.append(torch.zeros(padding * size, dtype=torch.uint8))
    if end > tensor.numel():
        return False
    mine = tensor[first:end]
    return torch.equal(mine.contiguous().view(torch.uint8), torch.cat(parts))
