"""Re-checking a resharded output (`--verify` of a recipe with a world size), byte for byte.

For every output rank, each piece of every sub-group's fp32 master weights, exp_avg and
exp_avg_sq, and of every frozen parameter's fragment, equals the elements of the source rank
it comes from (located by that source's own layout, read independently of the writer), and
padding is zero bytes. Everything else must be what DeepSpeed at the new world size would
hold: the base's rank 0 with `partition_count`/`dp_world_size` the new world size, the new
`param_shapes` and param groups' sub-group lists, each new sub-group's state (its `step`)
that of the base's sub-group its first parameter came from, and buffers from their rows'
sources. Every record of every torch file read is checked against its CRC-32 (`load_pt`).

What it costs goes with the bytes, not with the pieces or the ranks (a 512-rank output of a small
model is hundreds of thousands of pieces of a few elements, nearly all padding, and 512 model_states
files of hundreds of parameter placeholders each): each output tensor is compared whole against its
pieces' bytes put side by side, and piece by piece only when it differs, so that each difference is
reported as before; a model_states file holding what one checked before (`SameContent`) is not
unpickled by torch again, nor its structure compared again, though every byte of it is read and checked.
"""

from __future__ import annotations

import collections
import os
import pickle
from pathlib import Path

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
from tailor_tui.errors import CheckpointError
from tailor_tui.formats.pickled import TensorRef, read_pickle
from tailor_tui.formats.ptfile import PICKLE_FAILURES, SMALL_FILE, ZIP_START, Unsupported, records_in
from tailor_tui.formats.safe_load import load_pt
from tailor_tui.reading import open_regular

OUTER = f"[{OPTIMIZER_STATE_DICT!r}]"
# paths in an optim file that differ from the base's by design; each is checked on its own
REPLACED = (f"{OUTER}[{FP32_FLAT_GROUPS!r}]", f"{OUTER}{OUTER}[{STATE!r}]", f"{OUTER}[{PARTITION_COUNT!r}]")


def verify_resharded(plan, composed, report, emit, cancelled) -> None:
    """Check every output rank of a resharded `plan` (`report`: verify.VerifyReport)."""
    base_optim = load_pt(optim_structure_file(plan.base.ranks[0]))
    base_states = load_pt(plan.base.ranks[0].model_states)
    buffers = {s: load_pt(plan.sources[s].ranks[0].model_states) for s in set(plan.buffer_sources().values())}
    same, loaded = SameContent(), {}
    for job in plan.rank_jobs():
        _verify_rank(plan, job, composed, report, emit, cancelled, base_optim, base_states, buffers, same, loaded)


def _verify_rank(plan, job, composed, report, emit, cancelled, base_file, base_states, buffer_states, same,
                 loaded) -> None:
    """`loaded`: source files loaded, by path: those the previous rank loaded are kept for this
    one where it takes from them too (neighbouring ranks take from the same source ranks)."""
    counter = ByteCounter(f"rank {job.rank}", job.write_bytes, emit, cancelled)
    reshard, rank = plan.reshard, job.rank
    mine = composed.ranks[rank].optim_states
    got_file = load_pt(mine)
    got = optimizer_state(got_file, mine, job.group_sizes)
    wanted = {path for files in job.files.values() for path in (files.optim_states, files.model_states)}
    for path in [path for path in loaded if path not in wanted]:
        del loaded[path]
    partial = PartialSlices()

    def source_of(p, key: str):
        """The source tensor piece `p` is taken from, and its first element there."""
        files = job.files[p.source, p.rank]
        if key == "frozen":
            if files.model_states not in loaded:
                loaded[files.model_states] = load_pt(files.model_states)
            return loaded[files.model_states][FROZEN_PARAM_FRAGMENTS][p.param], p.offset
        if files.rows is not None:  # the whole slice, checked, then the piece
            return partial.get(files.rows, f"{key}/{p.param}", p.whole), p.within
        if files.optim_states not in loaded:
            path = files.optim_states
            loaded[path] = optimizer_state(load_pt(path), path, job.source_sizes[p.source])
        return flat_tensor(loaded[files.optim_states], p.group, key), p.offset

    def check(tensor, pieces, key: str) -> None:
        for batch in _batches(pieces):
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
    _model_states(plan, job, composed, report, check, base_states, buffer_states, same)
    counter.finish()


def _replaced(where: str) -> bool:
    return where.startswith(REPLACED) or (
        where.startswith(f"{OUTER}{OUTER}[{PARAM_GROUPS!r}]") and where.endswith("['params']"))


def _model_states(plan, job, composed, report, check, base, buffer_states, same) -> None:
    rank = job.rank
    states, found = same.load(composed.ranks[rank].model_states, tuple(name for name, _pieces in job.frozen))
    if not found:  # what it holds is checked once per content, every rank's frozen pieces on their own
        found["layout"], found["rest"] = _states_problems(plan, states, base, buffer_states)
    for row, problem in found["layout"]:
        report.add(row, f"rank {rank}: {problem}")
    fragments = states.get(FROZEN_PARAM_FRAGMENTS) or {}
    for name, pieces in job.frozen:
        check(fragments[name].reshape(-1), pieces, "frozen")
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
        if not same_bytes(states[MODULE][name], buffer_states[s][MODULE][name]):
            rest.append((plan.base.param_to_row()[name], f"buffer {name} differs from {plan.sources[s].name}"))
    skip = {f"[{DP_WORLD_SIZE!r}]", f"[{PARAM_SHAPES!r}]", *(f"[{MODULE!r}][{b!r}]" for b in buffers)}
    for where in differences(states, base, skip=lambda w: w in skip or w.startswith(
            f"[{FROZEN_PARAM_FRAGMENTS!r}]"))[:5]:
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
    parts, padding, sources = [], 0, {}
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


class SameContent:
    """`load_pt` of the output's model_states files, torch's unpickling done once per content.

    A resharded output's model_states files are one structure under each rank's archive name
    (`ptwrite.SameArchives`), and torch's weights-only unpickler takes ~0.1 s for each of a wide
    run's (a placeholder tensor per parameter): most of a 512-rank verification. A file whose
    archive lists, in order, the records of one torch loaded (`load_pt`, every check it makes),
    each with the same name within the archive and the same bytes, each of them checked against
    its CRC-32, loads as that one did: its object is that one's. (`.data/serialization_id` aside:
    an id drawn per archive name, which torch only logs; its CRC-32 is checked too.) Frozen
    parameters' fragments are each rank's own: a record that holds one of them and nothing else (by
    its structure, which is the same byte for byte) may differ, and the object then holds this
    file's bytes for that fragment, laid out as torch laid out that one's. Any other file is loaded
    by `load_pt`. `load` returns the loaded object and a dict for what the caller found in it (what
    does not depend on the frozen fragments' values)."""

    def __init__(self, keep: int = 4):
        self.keep, self.known = keep, {}  # content -> (object, found): the last `keep` contents
        self.holding = {}  # (structure, frozen) -> `_fragment_records`: the last `keep` structures

    def load(self, path, frozen: tuple[str, ...] = ()) -> tuple[object, dict]:
        """`frozen`: the names of the frozen parameters whose fragments the file holds."""
        found = self.content(Path(path), frozen)
        if found is None:
            return load_pt(path), {}
        content, own = found
        states, problems = _remembered(self.known, content, self.keep, lambda: (load_pt(path), {}))
        return (_with_fragments(states, own) if own else states), problems

    def content(self, path: Path, frozen: tuple[str, ...] = ()) -> tuple | None:
        """(what `path` holds: every record's name within the archive and bytes, in the archive's
        order, but the bytes of the records that hold one of the `frozen` fragments alone; those
        bytes, by parameter), each record checked against its CRC-32; None when `path` is no small
        torch zip file, or fails a check (`load_pt` then says how)."""
        try:
            fd = open_regular(path)
            try:
                whole = os.pread(fd, SMALL_FILE + 1, 0)
            finally:
                os.close(fd)
            if len(whole) > SMALL_FILE or not whole.startswith(ZIP_START):
                return None
            records = list(records_in(path, whole))
        except (OSError, ValueError, CheckpointError, Unsupported):
            return None
        pickles = [e.name for e, _data in records if e.name.endswith("/data.pkl")]
        prefix = pickles[0][: -len("data.pkl")] if len(pickles) == 1 else ""
        if prefix.count("/") != 1 or prefix == "/":  # torch's: one folder, named after the archive
            return None
        holding = self._holding(next(data for e, data in records if e.name == pickles[0]), frozen)
        if holding is None:
            return None
        names, sizes, held, skip, own = [], [], [], len(prefix), {}
        for e, data in records:
            if e.packed != e.size or not e.name.startswith(prefix):
                return None
            if e.name[skip:] != ".data/serialization_id":
                names.append(e.name[skip:])
                sizes.append(e.size)
                if e.name[skip:] in holding:
                    own[holding[e.name[skip:]]] = bytes(data)
                else:
                    held.append(data)
        if len(own) != len(holding):
            return None
        return (tuple(names), tuple(sizes), b"".join(held)), own

    def _holding(self, pickled, frozen: tuple[str, ...]) -> dict[str, str] | None:
        """`_fragment_records`, worked out once per structure (the ranks' is one, byte for byte)."""
        if not frozen:
            return {}
        key = (bytes(pickled), frozen)
        return _remembered(self.holding, key, self.keep, lambda: _fragment_records(key[0], frozen))


def _remembered(memo: dict, key, keep: int, make):
    """`memo[key]`, made by `make()` the first time; past `keep` entries, the oldest is forgotten."""
    if key not in memo:
        if len(memo) >= keep:
            del memo[next(iter(memo))]
        memo[key] = make()
    return memo[key]


def _fragment_records(pickled: bytes, frozen: tuple[str, ...]) -> dict[str, str] | None:
    """{record name within the archive: frozen parameter} of the records that hold one of the `frozen`
    parameters' fragments and nothing else, from the structure `pickled` (data.pkl's bytes); None where a
    fragment is no plain tensor, shares its storage, or the structure holds what may hide one."""
    try:
        obj = read_pickle(pickled)
    except PICKLE_FAILURES + (pickle.UnpicklingError,):
        return None
    users = collections.Counter()  # storage key -> tensors that refer to it
    todo = [(obj, 0)]
    while todo:
        item, depth = todo.pop()
        if isinstance(item, TensorRef):
            users[item.storage.key] += 1
        elif isinstance(item, dict) and depth < 16:
            todo.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, (list, tuple)) and depth < 16:
            todo.extend((v, depth + 1) for v in item)
        elif not isinstance(item, (str, bytes, int, float, bool, type(None))):
            return None  # an object (or a structure deeper than a model_states file's) that may hold a tensor
    fragments = obj.get(FROZEN_PARAM_FRAGMENTS) if isinstance(obj, dict) else None
    holding = {}
    for name in frozen:
        ref = fragments.get(name) if isinstance(fragments, dict) else None
        if not isinstance(ref, TensorRef) or users[ref.storage.key] != 1:
            return None
        holding[f"data/{ref.storage.key}"] = name
    return holding


def _with_fragments(states: dict, own: dict[str, bytes]) -> dict:
    """`states` with each frozen fragment in `own` made of those bytes, laid out as its own is."""
    import torch

    fragments = dict(states[FROZEN_PARAM_FRAGMENTS])
    for name, data in own.items():
        known = fragments[name]
        storage = torch.frombuffer(bytearray(data), dtype=known.dtype) if data else known.new_empty(0)
        fragments[name] = storage.as_strided(known.size(), known.stride(), known.storage_offset())
    return {**states, FROZEN_PARAM_FRAGMENTS: fragments}
