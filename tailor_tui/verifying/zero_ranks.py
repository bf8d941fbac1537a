"""The output's rank files at the base's world size, compared with their sources streamed (`streamed`).

For every rank, each slot of the base's layout holds, in the output's flat tensors (fp32 masters and the
optimizer's state kept per element), its row's source's elements at the same place (every checkpoint of the
recipe has the base's layout), then padding of zero bytes; everything else in the optim file (param groups,
loss scaler, steps, counters) and in model_states is the base's, but frozen fragments and buffers, which follow
their row. What the output must hold where is worked out here, from the plan's picks and each checkpoint's
layout; the files' structures are read without torch (`formats.ptfile`: allow-listed stand-ins, where each
tensor's bytes lie), and nothing is loaded: each claim on an output byte range is compared with its source's
bytes as the output is read, every record of every file relied on checked against its stored CRC-32 on the
way (a partial save's slice against the CRC-32 its save recorded), each file read once.

A source that changed since the composition (`changed`) is not read: the rows it gave are proven against what
the composition recorded it took (`verifying.recorded`), as every row is where the record holds it; so is one
whose records fail their CRC-32s now though the composition read and checked them (bit rot), where the output's
record can prove its rows, and the rest of its files against the records the composition wrote (`Archives`).
"""

from __future__ import annotations

import ast
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from tailor_tui.checked.evidence import record_failed
from tailor_tui.errors import CheckpointError
from tailor_tui.events import ByteCounter, Emit
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
from tailor_tui.formats.pickled import StorageRef, TensorRef
from tailor_tui.formats.ptfile import Unsupported, locate, read_structure
from tailor_tui.formats.safetensors_in import safetensors_header, tensor_places
from tailor_tui.verifying import streamed
from tailor_tui.verifying.compare import structure_differences
from tailor_tui.verifying.recorded import FROZEN, Archives, RankRows, settle
from tailor_tui.verifying.rows_files import recorded_slices

MAX_SHOWN = 5  # differences of the structure around the rows told per rank and file


@dataclass
class _Tag:
    """What a claim stands for: `kind` (row, frozen, padding, state, buffer, states), the rank, the row, the
    problem told where its bytes differ, the plan's source and the file it is read from (-1: none)."""

    kind: str
    rank: int
    row: str | None
    problem: str
    source: int = 0
    file: int = -1
    key: str = ""
    claim: int = -1


class _TorchFile:
    """A torch file's structure, read once: (object, records, prefix) and its index among the claims' files."""

    def __init__(self, claims: streamed.Comparison, path: Path, *, label: str | None = None, whole: bool = False):
        self.path = path
        self.obj, self.records, self.prefix = read_structure(path, shared=True)  # (only read: shared)
        self.f = claims.file(path, label=label)
        self.claims, self.evidenced = claims, set[str]()
        if whole:  # an output file: every record of it read and checked
            for name in self.records:
                self.evidence(name)

    def evidence(self, name: str) -> None:
        if name not in self.evidenced:
            self.evidenced.add(name)
            r = self.records[name]
            self.claims.evidence(self.f, r.data_offset, r.size, r.crc, r.name)

    def place(self, ref) -> tuple[int, int, str, int]:
        """(first byte, length, dtype, itemsize) of a tensor (a contiguous one) or a storage, its record evidenced."""
        if isinstance(ref, StorageRef):
            name = f"{self.prefix}data/{ref.key}"
            if name not in self.records:
                raise CheckpointError(f"{self.path}: storage {ref.key} has no record; the file is corrupt")
            r = self.records[name]
            self.evidence(name)
            return r.data_offset, min(r.size, ref.numel * ref.itemsize), ref.type_name, ref.itemsize
        try:
            tb = locate(ref, self.records, self.prefix)
        except Unsupported as exc:
            raise CheckpointError(f"{self.path}: a tensor tailor-tui cannot compare ({exc}); the file is not one "
                                  "DeepSpeed writes") from None
        self.evidence(tb.record.name)
        return tb.offset, tb.numel * tb.itemsize, tb.dtype, tb.itemsize


class _SlicesFile:
    """A partial save's rows file: each slice's place and the CRC-32 its save recorded."""

    def __init__(self, claims: streamed.Comparison, path: Path):
        header, start = safetensors_header(path)
        self.path, self.places = path, tensor_places(header, start)
        self.crcs = recorded_slices(path, header.get("__metadata__") or {})
        self.f = claims.file(path)
        self.claims, self.evidenced = claims, set[str]()

    def slice(self, name: str, valid: int) -> int:
        """The first byte of slice `name`'s `valid` fp32 elements, evidenced by its recorded CRC-32."""
        found = self.places.get(name)
        if found is None:
            raise CheckpointError(f"{self.path}: has no tensor {name}; the partial checkpoint is damaged or "
                                  "incomplete, re-copy it")
        dtype, shape, begin, _end = found
        if dtype != "F32" or len(shape) != 1 or shape[0] < valid:
            raise CheckpointError(f"{self.path}: tensor {name} is {dtype} {list(shape)}, not F32 of at least {valid} "
                                  "elements; the partial checkpoint is damaged or incomplete, re-copy it")
        if name not in self.evidenced:
            self.evidenced.add(name)
            self.claims.evidence(self.f, begin, valid * 4, self.crcs.get(name), f"tensor {name}")
        return begin


class ZeroRanks:
    """Every output rank of a plan at the base's world size: claims built (`add`), then run and settled (`check`)."""

    def __init__(self, plan, report, *, changed: set[int], taken, archives: Archives):
        self.plan, self.report, self.changed, self.taken, self.archives = plan, report, changed, taken, archives
        self.claims = streamed.Comparison()
        self.tags: list[_Tag] = []
        self.outputs: set[int] = set()
        self.file_source: dict[int, int] = {}  # claims' file -> the plan's source it is of
        self.sizes: dict[str, int] = {}  # progress label -> bytes
        self.names = [src.name for src in plan.sources]
        self._param_row = plan.base.param_to_row()
        self._source_of = plan.source_of_param()

    def _claim(self, tag: _Tag, out: int, at: int, n: int, source: int = streamed.NOTHING, source_at: int = 0) -> None:
        tag.claim = self.claims.claim(out, at, n, source, source_at, len(self.tags))
        self.tags.append(tag)

    def _source(self, s: int, load):
        """What `load()` reads of source `s` (a _TorchFile, a _SlicesFile), None where it changed since the composition:
        its files fail a check now the composition passed (`changed` gets it, where the record proves its rows)."""
        if s in self.changed:
            return None
        try:
            found = load()
        except CheckpointError as exc:
            if self.taken is None:
                raise
            self.report.changed_in_place(f"{exc} (the composition read it whole and checked it)")
            self.changed.add(s)
            return None
        self.file_source[found.f] = s
        return found

    def add(self, rank: int, composed) -> None:
        plan, claims = self.plan, self.claims
        layout, label = plan.base.layout, f"rank {rank}"
        sizes = tuple(layout.group_sizes())
        mine = composed.ranks[rank].optim_states
        out = _TorchFile(claims, mine, label=label, whole=True)
        self.outputs.add(out.f)
        got = optimizer_state(out.obj, mine, sizes)
        if (found := flat_keys(got, mine, sizes)) != plan.keys:
            self.report.add(None, f"rank {rank}: its optimizer keeps {describe_state(found[1:])} per element, the "
                                  f"checkpoints composed {describe_state(plan.keys[1:])}")
        files = {s: plan.sources[s].ranks[rank] for s in sorted({0} | {self._source_of[slot.name]
                                                                        for slot in layout.slots})}
        wanted = {}
        for s, f in files.items():
            found = self._source(s, (lambda f=f: _TorchFile(claims, f.optim_states)) if f.whole_records
                                 else (lambda f=f: _SlicesFile(claims, f.state_file)))
            if found is not None:
                wanted[s] = (found, optimizer_state(found.obj, f.optim_states, sizes)
                             if isinstance(found, _TorchFile) else None)
        for slot in sorted(layout.slots, key=lambda slot: (slot.group, slot.offset)):
            s, valid, row = self._source_of[slot.name], slot.valid(rank), self._param_row[slot.name]
            for key in plan.keys:
                tensor = flat_tensor(got, slot.group, key)
                if tensor is None:
                    continue  # (a state the output lacks: said above)
                start, _n, dtype, size = out.place(tensor)
                if valid:
                    self._slot(rank, out, start + slot.offset * size, valid, dtype, size, slot, key, row, s,
                               wanted.get(s))
                if valid < slot.part:
                    self._claim(_Tag("padding", rank, row, f"rank {rank}: padding after {slot.name} ({key}) is "
                                                          "not zero bytes"),
                                out.f, start + (slot.offset + valid) * size, (slot.part - valid) * size,
                                streamed.ZERO)
        self._structure(rank, out, files, wanted)
        self._model_states(rank, composed, label)

    def _slot(self, rank: int, out: _TorchFile, at: int, valid: int, dtype: str, size: int, slot, key: str, row: str,
              s: int, source) -> None:
        tag = _Tag("row", rank, row, f"rank {rank}: {key} of {slot.name} differs from {self.names[s]}", s, key=key)
        if source is None:  # from a source that changed since: its bytes proven by the record alone
            self._claim(tag, out.f, at, valid * size)
            return
        found, state = source
        if isinstance(found, _TorchFile):
            theirs = flat_tensor(state, slot.group, key)
            their_start, _n, their_dtype, their_size = found.place(theirs)
            their_at = their_start + slot.offset * their_size
        else:  # a partial save's slice of the parameter
            their_at, their_dtype, their_size = found.slice(f"{key}/{slot.name}", valid), "FloatStorage", 4
        tag.file = found.f
        if (their_dtype, their_size) != (dtype, size):
            tag.problem = f"rank {rank}: {key} of {slot.name} is {dtype}, {self.names[s]}'s {their_dtype}"
            self._claim(tag, out.f, at, valid * size)
            self.tags[-1].kind = "row-dtype"
            return
        self._claim(tag, out.f, at, valid * size, found.f, their_at)

    def _structure(self, rank: int, out: _TorchFile, files, wanted) -> None:
        """Everything but the flat tensors is the base's: param groups, loss scaler, steps, counters."""
        if 0 not in wanted:
            return  # (the base changed since the composition: `check` says what proves it)
        base = wanted[0][0] if isinstance(wanted[0][0], _TorchFile) else self._source(
            0, lambda: _TorchFile(self.claims, files[0].structure_file))
        if base is None:
            return
        outer = f"[{OPTIMIZER_STATE_DICT!r}]"
        per_element = tuple(f"[{key!r}]" for key in self.plan.keys[1:])

        def flat(where: str) -> bool:
            return where.startswith(f"{outer}[{FP32_FLAT_GROUPS!r}]") or (
                where.startswith(f"{outer}{outer}[{STATE!r}]") and where.endswith(per_element))

        problem = f"rank {rank}: optimizer state {{where}} is not the base's"
        for where in structure_differences(out.obj, base.obj, skip=flat,
                                           tensors=self._tensors(out, base, "state", rank, None, problem, 0))[:MAX_SHOWN]:
            self.report.add(None, problem.format(where=where))

    def _tensors(self, out: _TorchFile, theirs: _TorchFile, kind: str, rank: int, row: str | None, problem: str, s: int,
                 key: str = ""):
        """A `structure_differences` callback: the bytes of a pair of tensors alike in all else, claimed."""

        def claim(where: str, mine, their) -> None:
            a, n, _dtype, _size = out.place(mine)
            b, m, _dtype, _size = theirs.place(their)
            tag = _Tag(kind, rank, row, problem.format(where=where), s, theirs.f, key)
            if n != m or (isinstance(mine, TensorRef) and not mine.is_contiguous()
                          and mine.storage_offset != their.storage_offset):
                self.report.add(row, tag.problem)
            elif n:
                self._claim(tag, out.f, a, n, theirs.f, b)
        return claim

    def _model_states(self, rank: int, composed, label: str) -> None:
        """model_states: the base's, but frozen fragments and buffers, each from its row's source."""
        plan, claims = self.plan, self.claims
        states = _TorchFile(claims, composed.ranks[rank].model_states, label=label, whole=True)
        self.outputs.add(states.f)
        loaded: dict[int, _TorchFile | None] = {}

        def source(s: int) -> _TorchFile | None:
            if s not in loaded:
                loaded[s] = self._source(s, lambda: _TorchFile(claims, plan.sources[s].ranks[rank].model_states))
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
                    self._claim(_Tag("frozen", rank, row, problem, s, key=FROZEN), states.f, a, n)
                continue
            for difference in structure_differences(
                    mine, _at(theirs.obj, where), where,
                    tensors=self._tensors(states, theirs, "frozen", rank, row, problem, s, FROZEN)):
                self.report.add(row, problem.format(where=difference))
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
                        _at(states.obj, where), _at(theirs.obj, where), where,
                        tensors=self._tensors(states, theirs, "buffer", rank, row.name, problem, s)):
                    self.report.add(row.name, problem.format(where=difference))
        base = source(0)
        if base is not None:
            problem = f"rank {rank}: model_states {{where}} is not the base's"
            for where in structure_differences(states.obj, base.obj, skip=lambda w: w in followed,
                                               tensors=self._tensors(states, base, "states", rank, None, problem,
                                                                     0))[:MAX_SHOWN]:
                self.report.add(None, problem.format(where=where))

    def check(self, emit: Emit, cancelled: Callable[[], bool], workers: int) -> None:
        """Run the claims (every byte read once, compared) and settle what they found, rank by rank."""
        claims = self.claims
        sizes: dict[str, int] = {}
        for f in sorted(self.outputs):
            sizes[claims.labels[f]] = sizes.get(claims.labels[f], 0) + claims.size(f)
        counters = {label: ByteCounter(label, size, emit, cancelled) for label, size in sizes.items()}
        lock = threading.Lock()

        def on_bytes(label: str, n: int) -> None:
            with lock:
                counters[label].add(n)

        def on_sources(total: int) -> None:  # what is left of the sources' records once the outputs are read
            counters["sources"] = ByteCounter("sources", total, emit, cancelled)

        outcome = streamed.run(claims, workers=workers, on_bytes=on_bytes, on_sources=on_sources,
                              cancelled=cancelled)
        for counter in counters.values():
            counter.finish()
        if outcome.moved:
            raise CheckpointError(f"{outcome.moved[0]}: changed while it was verified (written to, or replaced); "
                                  "what was read of it proves nothing: run --verify again once nothing writes to it")
        bad: set[int] = set()
        for stretch, value in outcome.failed:
            path = claims.paths[stretch.file]
            if stretch.file in self.outputs:  # the output damaged since it was written: a failed verification
                self.report.add(None, f"{path}: record {stretch.name} fails its CRC-32 check (stored "
                                      f"{stretch.crc:08x}, its bytes give {value:08x}): the output is damaged; "
                                      "compose it again")
                continue
            failure = record_failed(path, stretch, value)
            if self.taken is None:
                raise failure
            self.report.changed_in_place(f"{failure} (the composition read it whole and checked it)")
            bad.add(stretch.file)
            self.changed.add(self.file_source[stretch.file])
        self._settle(outcome, bad)

    def _settle(self, outcome: streamed.Outcome, bad: set[int]) -> None:
        plan, report = self.plan, self.report
        rows = [RankRows() for _ in range(plan.base.world_size)]
        shown: dict[tuple[int, str], int] = {}
        for i, tag in enumerate(self.tags):
            mine, row = rows[tag.rank], tag.row or ""
            if tag.kind in ("row", "row-dtype", "frozen") and tag.key:
                mine.crcs.add_crc(row, tag.key, outcome.crcs.get(tag.claim, 0),
                                  self.claims.claims[tag.claim].length)
            if tag.kind in ("row", "row-dtype", "frozen"):
                if tag.file < 0 or tag.file in bad:
                    mine.from_changed[row] = tag.source
                elif tag.kind == "row-dtype" or i in outcome.differing:
                    mine.differs(row, tag.problem, tag.source)
            elif tag.kind == "padding":
                if i in outcome.differing:
                    report.add(tag.row, tag.problem)
            elif tag.file in bad:  # compared with a file that fails its checks now: what proves it, if anything
                if not self.archives.proven(plan.output_rank_files()[tag.rank]):
                    line = (f"rank {tag.rank}: its optimizer state but the rows' tensors, and its model_states but "
                            "what follows a row: not compared, a source changed since the composition")
                    report.unproven += [line] if line not in report.unproven else []
            elif i in outcome.differing:
                count = shown[tag.rank, tag.kind] = shown.get((tag.rank, tag.kind), 0) + 1
                if count <= MAX_SHOWN:
                    report.add(tag.row, tag.problem)
        if 0 in self.changed:
            for rank in range(plan.base.world_size):
                if not self.archives.proven(plan.output_rank_files()[rank]):
                    line = ("every rank's optimizer state but the rows' tensors, and its model_states but what "
                            "follows a row: not compared, the base changed since the composition")
                    report.unproven += [line] if line not in report.unproven else []
        for rank, found in enumerate(rows):
            settle(report, rank, found, self.taken, self.names)


def verify_ranks(plan, composed, report, emit: Emit, cancelled: Callable[[], bool], *, changed: set[int], taken,
                 archives: Archives, workers: int = 2) -> None:
    """Check every output rank of `plan` (at the base's world size) into `report` (`against_recipe.VerifyReport`)."""
    ranks = ZeroRanks(plan, report, changed=changed, taken=taken, archives=archives)
    for rank in range(plan.base.world_size):
        ranks.add(rank, composed)
    ranks.check(emit, cancelled, workers)


def _at(states, where: str):
    """The value at a path such as ['module']['model.x'] (None if absent)."""
    value: object = states
    for key in where[1:-1].split("]["):
        value = (value or {}).get(ast.literal_eval(key)) if isinstance(value, dict) else None
    return value

