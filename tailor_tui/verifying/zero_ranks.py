"""The output's rank files at the base's world size, claimed byte range by byte range (`rank_claims`).

For every rank, each slot of the base's layout holds, in the output's flat tensors (fp32 masters and the
optimizer's state kept per element), its row's source's elements at the same place (every checkpoint of the
recipe has the base's layout), then padding of zero bytes; everything else in the optim file (param groups,
loss scaler, steps, counters) and in model_states is the base's, but frozen fragments and buffers, which follow
their row. Where each of those lies is worked out here, from the plan's picks and each checkpoint's layout.

Each sub-group's flat tensor of each key is claimed as one `streamed.Spread` where every source of its rows holds
its own flat tensor of the same dtype and layout (a torch file's: every checkpoint of the recipe has the base's
layout): its segments the parts of a `streamed.Pattern` worked out once per class of ranks alike, each rank's
spread only where its tensors lie. Otherwise (a partial save's slices, a dtype not the output's) each segment is a
claim of its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from tailor_tui.formats.ds_format import (
    FP32_FLAT_GROUPS,
    FROZEN_PARAM_FRAGMENTS,
    MODULE,
    OPTIMIZER_STATE_DICT,
    STATE,
    describe_state,
    flat_keys,
    flat_tensor,
    optimizer_state,
)
from tailor_tui.formats.pickled import TensorRef
from tailor_tui.verifying import streamed
from tailor_tui.verifying.compare import structure_differences
from tailor_tui.verifying.rank_claims import MAX_SHOWN, RankClaims, SlicesFile, Tag, TorchFile, at_path
from tailor_tui.verifying.recorded import FROZEN


class ZeroRanks(RankClaims):
    """Every output rank of a plan at the base's world size."""

    def __init__(self, plan, report, *, changed: set[int], taken, archives) -> None:
        super().__init__(plan, report, changed=changed, taken=taken, archives=archives)
        self._ordered = sorted(plan.base.layout.slots, key=lambda slot: (slot.group, slot.offset))  # output order
        self._by_valid: dict[tuple, list[tuple[int, list[Segment]]]] = {}  # `_groups`' answers
        self._patterns: dict[tuple, streamed.Pattern] = {}  # `_spread`'s, per class of ranks, dtype, sources

    def add(self, rank: int, composed) -> None:
        plan, claims = self.plan, self.claims
        layout, label = plan.base.layout, f"rank {rank}"
        sizes = tuple(layout.group_sizes())
        mine = composed.ranks[rank].optim_states
        out = TorchFile(claims, mine, label=label, whole=True)
        self.outputs.add(out.f)
        got = optimizer_state(out.obj, mine, sizes)
        if (found := flat_keys(got, mine, sizes)) != plan.keys:
            self.report.add(None, f"rank {rank}: its optimizer keeps {describe_state(found[1:])} per element, the "
                                  f"checkpoints composed {describe_state(plan.keys[1:])}")
        files = {s: plan.sources[s].ranks[rank] for s in sorted({0} | {self._source_of[slot.name]
                                                                        for slot in layout.slots})}
        wanted = {}
        for s, f in files.items():
            found = self.torch_file(s, f.optim_states) if f.whole_records else self.slices_file(s, f.state_file)
            if found is not None:
                wanted[s] = (found, found.optimizer(sizes) if isinstance(found, TorchFile) else None)
        joinable = {s for s in files if not isinstance((wanted.get(s) or (None,))[0], SlicesFile)}
        for key in plan.keys:  # (each (row, key)'s slots in the output's order: what the record's CRC-32s cover)
            def padding(slot, key=key) -> str:
                return f"rank {rank}: padding after {slot.name} ({key}) is not zero bytes"

            for group, segments in self._groups(rank, joinable):
                tensor = flat_tensor(got, group, key)  # (None: a state the output lacks, said above)
                if tensor is None:
                    continue
                placed = out.place(tensor)
                if self._spread(rank, out, key, group, placed, segments, wanted, padding):
                    continue
                start, _n, dtype, size = placed
                for segment in segments:
                    if segment.row is None:
                        first_slot, first_row = segment.slots[0][:2]
                        self.claim(Tag("padding", rank, first_row, padding(first_slot),
                                       parts=segment.told(start, size, 0, padding)),
                                   out.f, start + segment.first * size, segment.count * size, streamed.ZERO)
                        continue
                    self._segment(rank, out, start, dtype, size, segment, key, wanted.get(segment.source),
                                  self._their_place(wanted.get(segment.source), group, key))
        self._structure(rank, out, files, wanted)
        self._model_states(rank, composed, label)

    def _groups(self, rank: int, joinable: set) -> list[tuple[int, list[Segment]]]:
        """`_segments` of `rank`, by sub-group (in the output's order), worked out once per class of ranks holding
        the same count of valid elements in each slot (`ZeroLayout.same_holdings`) and sources joinable (a wide
        run's ranks but the last few hold whole slots: their segments are alike)."""
        key = (self.plan.base.layout.same_holdings(rank), frozenset(joinable))
        found = self._by_valid.get(key)
        if found is None:
            groups: dict[int, list[Segment]] = {}
            for segment in _segments(tuple(slot.valid(rank) for slot in self._ordered), self._ordered,
                                     self._source_of, self._param_row, joinable):
                groups.setdefault(segment.group, []).append(segment)
            found = self._by_valid[key] = list(groups.items())
        return found

    @staticmethod
    def _their_place(source, group: int, key: str) -> tuple | None:
        """The `place` of a source's flat tensor of `key` and sub-group `group` (`source`: its file and inner
        optimizer dict), where it is a torch file's."""
        found_in, state = source if source is not None else (None, None)
        if isinstance(found_in, TorchFile) and state is not None:
            tensor = flat_tensor(state, group, key)
            return None if tensor is None else found_in.place(tensor)
        return None

    def _spread(self, rank: int, out: TorchFile, key: str, group: int, placed: tuple, segments: list[Segment],
                wanted: dict, padding: Callable) -> bool:
        """A sub-group's flat tensor of `key` (`placed`: the output's) claimed as one `streamed.Spread`, where every
        source of its rows holds its own of the same dtype and layout in a torch file (or changed since: its rows
        proven by the record alone); False where one does not (each segment claimed on its own)."""
        start, n, dtype, size = placed
        order = list(dict.fromkeys(segment.source for segment in segments if segment.row is not None))
        lo, hi = segments[0].first * size, (segments[-1].first + segments[-1].count) * size
        sources: list[tuple[int, int]] = []
        index: dict[int, int] = {}  # plan source -> its place in `sources`
        shifts: dict[int, int] = {}  # plan source -> its flat tensor's first byte less the output's
        for s in order:
            source = wanted.get(s)
            if source is None:  # (changed since the composition: its rows' bytes only CRC-checked)
                continue
            their = self._their_place(source, group, key)
            if their is None or (their[2], their[3]) != (dtype, size) or their[1] < hi:
                return False
            index[s], shifts[s] = len(sources), their[0] - start
            sources.append((source[0].f, their[0] + lo))
        if n < hi:
            return False
        pattern_key = (id(segments), size, tuple(index.get(s, -1) for s in order))
        pattern = self._patterns.get(pattern_key)
        if pattern is None:
            pattern = self._patterns[pattern_key] = streamed.Pattern(tuple(
                (segment.first * size - lo, segment.count * size,
                 streamed.ZERO if segment.row is None else index.get(segment.source, streamed.NOTHING))
                for segment in segments), len(sources))

        def told(j: int) -> list:
            segment = segments[j]
            if segment.row is None:
                return segment.told(start, size, 0, padding)()
            s = segment.source
            return segment.told(start, size, shifts.get(s, 0), self._differs(rank, key, s))()

        tag = Tag("spread", rank, None, "", key=key, segments=segments, told=told)
        self.spread(tag, out.f, start + lo, tuple(sources), pattern)
        return True

    def _differs(self, rank: int, key: str, s: int) -> Callable:
        """What is told of a slot (`part`) of a row whose `key` elements on `rank` differ from source `s`'s."""

        def differs(part) -> str:
            return f"rank {rank}: {key} of {part.name} differs from {self.names[s]}"
        return differs

    def _segment(self, rank: int, out: TorchFile, start: int, dtype: str, size: int, segment: Segment, key: str,
                 source, their_place) -> None:
        """A segment's elements of `key` (the output's flat tensor's first byte `start`) claimed from its source
        (`source`: its file and inner optimizer dict, None where it changed since; `their_place`: its flat tensor's
        `place`, where it is a torch file)."""
        s, at, n = segment.source, start + segment.first * size, segment.count * size
        slot = segment.slots[0][0]
        differs = self._differs(rank, key, s)
        tag = Tag("row", rank, segment.row, differs(slot), s, key=key)
        if source is None:  # from a source that changed since: its bytes proven by the record alone
            tag.parts = segment.told(start, size, 0, differs)
            self.claim(tag, out.f, at, n)
            return
        found, _state = source
        if isinstance(found, TorchFile):
            their_start, _n, their_dtype, their_size = their_place
            their_at = their_start + segment.first * their_size
        else:  # a partial save's slice of the parameter (a segment of one slot: slices lie apart)
            their_at = found.slice(f"{key}/{slot.name}", segment.count)
            their_dtype, their_size = "FloatStorage", 4
        tag.file = found.f
        if (their_dtype, their_size) != (dtype, size):
            tag.kind, tag.problem = "row-dtype", f"rank {rank}: {key} of {slot.name} is {dtype}, {self.names[s]}'s " \
                                                 f"{their_dtype}"
            self.claim(tag, out.f, at, n)
            return
        tag.parts = segment.told(start, size, their_at - at, differs)
        self.claim(tag, out.f, at, n, found.f, their_at)

    def _structure(self, rank: int, out: TorchFile, files, wanted) -> None:
        """Everything but the flat tensors is the base's: param groups, loss scaler, steps, counters."""
        if 0 not in wanted:
            return  # (the base changed since the composition: `check` says what proves it)
        base = wanted[0][0] if isinstance(wanted[0][0], TorchFile) else self.torch_file(0, files[0].structure_file)
        if base is None:
            return
        outer = f"[{OPTIMIZER_STATE_DICT!r}]"
        per_element = tuple(f"[{key!r}]" for key in self.plan.keys[1:])

        def flat(where: str) -> bool:
            return where.startswith(f"{outer}[{FP32_FLAT_GROUPS!r}]") or (
                where.startswith(f"{outer}{outer}[{STATE!r}]") and where.endswith(per_element))

        problem = f"rank {rank}: optimizer state {{where}} is not the base's"
        claim = self.tensor_claims(out, base, "state", rank, row=None, problem=problem, s=0)
        for where in self.compared("optim", out.obj, base.obj, flat, claim)[:MAX_SHOWN]:
            self.report.add(None, problem.replace("{where}", where, 1))

    def _model_states(self, rank: int, composed, label: str) -> None:
        """model_states: the base's, but frozen fragments and buffers, each from its row's source."""
        plan, claims = self.plan, self.claims
        states = TorchFile(claims, composed.ranks[rank].model_states, label=label, whole=True)
        self.outputs.add(states.f)
        loaded: dict[int, TorchFile | None] = {}

        def source(s: int) -> TorchFile | None:
            if s not in loaded:
                loaded[s] = self.torch_file(s, plan.sources[s].ranks[rank].model_states)
            return loaded[s]

        fragments = states.obj.get(FROZEN_PARAM_FRAGMENTS) or {} if isinstance(states.obj, dict) else {}
        followed = set()
        for name, _shape in plan.base.layout.frozen:
            where = f"[{FROZEN_PARAM_FRAGMENTS!r}][{name!r}]"
            followed.add(where)
            s, row = self._source_of[name], self._param_row[name]
            problem = f"rank {rank}: model_states {{where}} differs from {self.names[s]}"
            mine = fragments.get(name)
            theirs = source(s)
            if theirs is None:
                if isinstance(mine, TensorRef):
                    a, n, _dtype, _size = states.place(mine)
                    told = problem.replace("{where}", where, 1)
                    self.claim(Tag("frozen", rank, row, told, s, key=FROZEN), states.f, a, n)
                continue
            for difference in structure_differences(
                    mine, at_path(theirs.obj, where), where,
                    tensors=self.tensor_claims(states, theirs, "frozen", rank, row=row, problem=problem, s=s,
                                               key=FROZEN)):
                self.report.add(row, problem.replace("{where}", difference, 1))
        for row in plan.base.rows:
            for buffer in row.buffers:
                where = f"[{MODULE!r}][{buffer!r}]"
                followed.add(where)
                s = self._source_of[buffer]
                theirs = source(s)
                if theirs is None:
                    if not self.archives.proven(plan.output_rank_files()[rank]):
                        self.report.unproven.append(f"rank {rank}: model_states {where} ({row.name}) not compared: "
                                                    f"{self.names[s]} changed since the composition")
                    continue
                problem = f"rank {rank}: model_states {{where}} differs from {self.names[s]}"
                for difference in structure_differences(
                        at_path(states.obj, where), at_path(theirs.obj, where), where,
                        tensors=self.tensor_claims(states, theirs, "buffer", rank, row=row.name, problem=problem, s=s)):
                    self.report.add(row.name, problem.replace("{where}", difference, 1))
        base = source(0)
        if base is not None:
            problem = f"rank {rank}: model_states {{where}} is not the base's"
            claim = self.tensor_claims(states, base, "states", rank, row=None, problem=problem, s=0)
            for where in self.compared("states", states.obj, base.obj, lambda w: w in followed, claim)[:MAX_SHOWN]:
                self.report.add(None, problem.replace("{where}", where, 1))


@dataclass(slots=True)
class Segment:
    """A run of a rank's flat buffer claimed as one: a row's neighbouring slots from one source (`row`), or the
    padding of neighbouring slots (`row` None), elements `first` to `first + count` of sub-group `group`; `slots`:
    (slot, its row, its first element, its count) of each part."""

    group: int
    source: int
    row: str | None
    first: int
    count: int
    slots: list

    def told(self, key_start: int, size: int, shift: int, problem: Callable) -> Callable[[], list]:
        """The claim's parts for `RankClaims` to tell which differ, worked out only where the claim does: (row,
        `problem(slot)`, first byte, length, first byte in the source: `shift` from the output's), of a flat tensor
        whose first byte is `key_start`."""

        def parts() -> list:
            return [(row, problem(slot), key_start + first * size, count * size, key_start + first * size + shift)
                    for (slot, row, first, count) in self.slots]
        return parts


def _segments(valid_counts: tuple[int, ...], ordered, source_of: dict, param_row: dict,
              joinable: set) -> list[Segment]:
    """A rank's flat buffers as segments, in the output's order (`ordered`: the slots by sub-group and offset, each
    with its `valid_counts` elements of real data): each slot's valid elements joined to the segment before where
    they go on from it in the same row and source (read from a torch file: `joinable`), each slot's padding to the
    padding before it, wherever it is contiguous."""
    found: list[Segment] = []
    last = Segment(-1, -1, None, -1, 0, [])
    for slot, valid in zip(ordered, valid_counts):
        s, row = source_of[slot.name], param_row[slot.name]
        for first, count, kind in ((slot.offset, valid, row), (slot.offset + valid, slot.part - valid, None)):
            if not count:
                continue
            if (last.group == slot.group and last.row == kind and last.first + last.count == first
                    and (kind is None or (last.source == s and s in joinable))):
                last.slots.append((slot, row, first, count))
                last.count += count
            else:
                last = Segment(slot.group, s if kind is not None else -1, kind, first, count,
                               [(slot, row, first, count)])
                found.append(last)
    return found
