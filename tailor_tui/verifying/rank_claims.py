"""What every check of the output's rank files shares: claims on their bytes, built rank by rank, then run
(`streamed`) and settled row by row.

The files' structures are read without torch (`formats.ptfile`: allow-listed stand-ins, where each tensor's bytes
lie), each file once (`TorchFile`, `SlicesFile`: a partial save's rows file, its slices' recorded CRC-32s), and
nothing is loaded: each claim on an output byte range (`Tag`: what it stands for, the problem told where its bytes
differ) is compared with its source's bytes as the output is read, every record of every file relied on checked
against its stored CRC-32 on the way, each file read once. Where a row's bytes lie is the subclasses' own reading
of the recipe and each checkpoint's layout (`zero_ranks`: at the base's world size; `resharded`: at another).

A source that changed since the composition (`changed`) is not read: the rows it gave are proven against what the
composition recorded it took (`verifying.recorded`), as every row is where the record holds it; so is one whose
records fail their CRC-32s now though the composition read and checked them (bit rot), where the output's record
can prove its rows, and the rest of its files against the records the composition wrote (`Archives`).
"""

from __future__ import annotations

import ast
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from tailor_tui.checked.evidence import record_failed
from tailor_tui.errors import RECOPY, CheckpointError
from tailor_tui.events import ByteCounter, Emit
from tailor_tui.formats.ds_format import optimizer_state
from tailor_tui.formats.pickled import StorageRef, TensorRef
from tailor_tui.formats.ptfile import Unsupported, locate, stored, structure_as
from tailor_tui.formats.safetensors_in import safetensors_header, tensor_places
from tailor_tui.verifying import streamed
from tailor_tui.verifying.compare import structure_differences
from tailor_tui.verifying.recorded import Archives, RankRows, settle
from tailor_tui.verifying.rows_files import recorded_slices

MAX_SHOWN = 5  # differences of the structure around the rows told per rank and kind


@dataclass(slots=True)
class Tag:
    """What a claim stands for: `kind` (row, frozen, padding, state, buffer, states; weight: a model file's tensor,
    copied: a run-level file copied from the base, taken: one whose CRC-32 must be `expected`), the rank (-1: none),
    the row, the problem told where its bytes differ, the plan's source and the file it is read from (-1: none)."""

    kind: str
    rank: int
    row: str | None
    problem: str
    source: int = 0
    file: int = -1
    key: str = ""
    claim: int = -1
    expected: int | None = None  # a "taken" claim's: the CRC-32 its bytes must have (the provenance record's)
    parts: list | Callable[[], list] | None = None  # a claim joining neighbours (`RankClaims.joined`): (row, problem,
    # at, length, source at) of each; a callable: worked out where asked
    segments: list | None = None  # a "spread" (`claim`: the spread's index): each part's segment (row, source)
    told: Callable[[int], list] | None = None  # a spread's: `parts` of its part j, worked out where asked


class TorchFile:
    """A torch file's structure, read once: (object, records, prefix) and its index among the claims' files."""

    def __init__(self, claims: streamed.Comparison, path: Path, *, label: str | None = None, whole: bool = False):
        self.path = path
        # its layout (only read: shared) and which file it was read of, one open (a small file read whole)
        (self.obj, self.records, self.prefix), seen = structure_as(path)
        self.f = claims.file(path, label=label, seen=seen)  # (its bytes held to the file its structure was read of)
        self.claims, self.evidenced = claims, set[str]()
        self._placed: dict[int, tuple[int, int, str, int]] = {}  # id of a tensor of `obj` -> `place`'s answer
        self._optimizer: dict | None = None  # `optimizer`'s answer
        if whole:  # an output file: every record of it read and checked (one of no bytes: its CRC-32 is 0's)
            for r in stored(self.records):
                self.evidence(r.name)

    def optimizer(self, group_sizes) -> dict:
        """The inner optimizer dict of an optim file, checked to hold the flat tensors of sub-groups of `group_sizes`
        (`ds_format.optimizer_state`: CheckpointError naming the file), worked out once."""
        if self._optimizer is None:
            self._optimizer = optimizer_state(self.obj, self.path, tuple(group_sizes))
        return self._optimizer

    def evidence(self, name: str) -> None:
        if name not in self.evidenced:
            self.evidenced.add(name)
            r = self.records[name]
            self.claims.evidence(self.f, r.data_offset, r.size, r.crc, r.name)

    def place(self, ref) -> tuple[int, int, str, int]:
        """(first byte, length, dtype, itemsize) of a tensor (a contiguous one) or a storage, its record evidenced."""
        found = self._placed.get(id(ref))
        if found is None:
            found = self._placed[id(ref)] = self._place(ref)  # (`ref` is of `obj`, kept: its id stays its own)
        return found

    def _place(self, ref) -> tuple[int, int, str, int]:
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


class SlicesFile:
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


class RankClaims:
    """Claims on every output rank's files (a subclass's `add`, rank by rank), then run and settled (`check`)."""

    def __init__(self, plan, report, *, changed: set[int], taken, archives: Archives):
        self.plan, self.report, self.changed, self.taken, self.archives = plan, report, changed, taken, archives
        self.claims = streamed.Comparison()
        self.tags: list[Tag] = []
        self.outputs: set[int] = set()
        self.copied: dict[int, Path] = {}  # an output file copied from the base -> the base's
        self.file_source: dict[int, int] = {}  # claims' file -> the plan's source it is of
        self.names = [src.name for src in plan.sources]
        self.files: dict[Path, TorchFile | SlicesFile] = {}  # every file read, by path: its structure read once
        self._compared: dict[tuple, tuple] = {}  # `compared`'s walks
        self._pending: tuple | None = None  # a claim `joined` may go on
        self.parts = 0  # parts of the spreads claimed
        self._param_row = plan.base.param_to_row()
        self._source_of = plan.source_of_param()

    def add(self, rank: int, composed) -> None:
        """Claim every byte of the output's rank `rank` (`composed`: the output, opened)."""
        raise NotImplementedError

    def drop(self) -> None:
        """Let go of the claims, their tags and the files' structures, once checked (they refer to each other)."""
        self.tags, self.claims, self.files, self._compared = [], streamed.Comparison(), {}, {}
        self.copied, self.parts = {}, 0

    def claim(self, tag: Tag, out: int, at: int, n: int, source: int = streamed.NOTHING, source_at: int = 0, *,
              cast: str = "") -> None:
        self.flush()
        self._claim(tag, out, at, n, source, source_at, cast)

    def _claim(self, tag: Tag, out: int, at: int, n: int, source: int, source_at: int, cast: str = "") -> None:
        tag.claim = self.claims.claim(out, at, n, source, source_at, len(self.tags), cast=cast)
        self.tags.append(tag)

    def spread(self, tag: Tag, out: int, at: int, sources: tuple[tuple[int, int], ...],
               pattern: streamed.Pattern) -> None:
        """Claim output bytes [at, at+pattern.length) as a `streamed.Spread` (`tag.segments`: each part's)."""
        self.flush()
        tag.claim = self.claims.spread(out, at, sources, pattern, len(self.tags))
        self.tags.append(tag)
        self.parts += len(pattern.parts)

    def held(self) -> int:
        """How many claims and spreads' parts are held (what a batch of ranks is bounded by)."""
        return len(self.tags) + self.parts

    def joined(self, tag: Tag, out: int, at: int, n: int, source: int = streamed.NOTHING, source_at: int = 0) -> None:
        """`claim`, joined to the claim before it where it goes on where that one ends, in the output and in the same
        source (a row's next parameter, the next padding): a wide run's ranks are tens of thousands of slots of a few
        elements each, compared as a few claims. Which of the joined differ is found when the whole does (`settle`)."""
        held = self._pending
        if held is not None:
            first, (h_out, h_at, h_n, h_source, h_source_at) = held
            if (h_out == out and h_at + h_n == at and h_source == source and first.kind == tag.kind
                    and first.rank == tag.rank and first.key == tag.key and first.source == tag.source
                    and first.file == tag.file and (tag.kind == "padding" or first.row == tag.row)
                    and (source < 0 or h_source_at + h_n == source_at)):
                first.parts.append((tag.row, tag.problem, at, n, source_at))
                self._pending = (first, (h_out, h_at, h_n + n, h_source, h_source_at))
                return
            self.flush()
        tag.parts = [(tag.row, tag.problem, at, n, source_at)]
        self._pending = (tag, (out, at, n, source, source_at))

    def flush(self) -> None:
        """The joined claim held, made."""
        if self._pending is not None:
            tag, (out, at, n, source, source_at) = self._pending
            self._pending = None
            self._claim(tag, out, at, n, source, source_at)

    def torch_file(self, s: int, path: Path):
        """Source `s`'s torch file `path`, read once (None: `s` changed since the composition, `_source`)."""
        return self._source(s, lambda: self.files[path] if path in self.files else TorchFile(self.claims, path))

    def slices_file(self, s: int, path: Path):
        """Source `s`'s rows file `path` (a partial save's), read once (None: `s` changed since the composition)."""
        return self._source(s, lambda: self.files[path] if path in self.files else SlicesFile(self.claims, path))

    def _source(self, s: int, load):
        """What `load()` reads of source `s` (a TorchFile, a SlicesFile), None where it changed since the composition:
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
        self.files[found.path] = found
        return found

    def tensor_claims(self, out: TorchFile, theirs: TorchFile, kind: str, rank: int, *, row: str | None,
                      problem: str, s: int, key: str = ""):
        """A `structure_differences` callback: the bytes of a pair of tensors alike in all else, claimed
        (`problem`: what is told where they differ, its "{where}" their place; replaced, never formatted: names
        in it are a file's)."""

        def claim(where: str, mine, their) -> None:
            if _empty(mine) and _empty(their):  # (a parameter's placeholder: no bytes to compare)
                return
            a, n, _dtype, _size = out.place(mine)
            b, m, _dtype, _size = theirs.place(their)
            tag = Tag(kind, rank, row, problem.replace("{where}", where, 1), s, theirs.f, key)
            if n != m:
                self.report.add(row, tag.problem)
            elif n:
                self.claim(tag, out.f, a, n, theirs.f, b)
        return claim

    def compared(self, site: str, mine, theirs, skip: Callable[[str], bool], claim) -> list[str]:
        """`structure_differences(mine, theirs, skip=skip)`, each pair of tensors handed to `claim` (`tensor_claims`),
        the walk done once per pair of objects (`site`: the caller's, whose `skip` is always the same): a wide run's
        files share their structures (`formats.ptfile` reads equal pickles into one object)."""
        key = (site, id(mine), id(theirs))
        if key not in self._compared:
            pairs: list[tuple[str, object, object]] = []
            found = structure_differences(mine, theirs, skip=skip, tensors=lambda *pair: pairs.append(pair)
                                          if not (_empty(pair[1]) and _empty(pair[2])) else None)
            self._compared[key] = (mine, theirs, found, pairs)  # (the objects kept: their ids stay theirs)
        _mine, _theirs, found, pairs = self._compared[key]
        for where, a, b in pairs:
            claim(where, a, b)
        return found

    def check(self, emit: Emit, cancelled: Callable[[], bool], workers: int) -> None:
        """Run the claims (every byte read once, compared) and settle what they found, rank by rank."""
        self.flush()
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
            if total:
                counters["sources"] = ByteCounter("sources", total, emit, cancelled)

        outcome = streamed.run(claims, workers=workers, on_bytes=on_bytes, on_sources=on_sources,
                              cancelled=cancelled)
        for counter in counters.values():
            counter.finish()
        if outcome.moved:
            raise streamed.moved_error(outcome.moved[0])
        bad: set[int] = set()
        for stretch, value in outcome.failed:
            path = claims.paths[stretch.file]
            if stretch.file in self.copied:  # (its bytes may be the base's: compared with them as they are read)
                self.report.add(None, f"{path}: torch's reader cannot read it (record {stretch.name} fails its CRC-32 "
                                      f"check: stored {stretch.crc:08x}, its bytes give {value:08x}); compose it "
                                      f"again, or where the base's {self.copied[stretch.file]} fails alike, {RECOPY}")
                continue
            if stretch.file in self.outputs:  # the output damaged since it was written: a failed verification
                self.report.add(None, streamed.damaged_output(path, stretch, value))
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
        rows = [RankRows() for _ in range(plan.world_size)]
        shown: dict[tuple[int, str], int] = {}
        told: set[tuple[str | None, str]] = set()
        for i, tag in enumerate(self.tags):
            if tag.kind in ("weight", "copied"):  # (a tensor claimed in parts, one per source file: told once)
                if i in outcome.differing and (tag.row, tag.problem) not in told:
                    told.add((tag.row, tag.problem))
                    report.add(tag.row, tag.problem)
                continue
            if tag.kind == "taken":
                if outcome.crcs.get(tag.claim, 0) != tag.expected:
                    report.add(tag.row, tag.problem)
                continue
            if tag.kind == "spread":
                self._settle_spread(tag, outcome, rows[tag.rank], bad)
                continue
            mine, row = rows[tag.rank], tag.row or ""
            if tag.kind in ("row", "row-dtype", "frozen") and tag.key:
                mine.crcs.add_crc(row, tag.key, outcome.crcs.get(tag.claim, 0),
                                  self.claims.claims[tag.claim].length)
            if tag.kind in ("row", "row-dtype", "frozen"):
                if tag.file < 0 or tag.file in bad:
                    mine.from_changed[row] = tag.source
                elif tag.kind == "row-dtype":
                    mine.differs(row, tag.problem, tag.source)
                elif i in outcome.differing:
                    for _row, problem in self._which(tag):
                        mine.differs(row, problem, tag.source)
            elif tag.kind == "padding":
                if i in outcome.differing:
                    for part_row, problem in self._which(tag):
                        report.add(part_row, problem)
            elif tag.file in bad:  # compared with a file that fails its checks now: what proves it, if anything
                if not self.archives.proven(plan.output_rank_files()[tag.rank]):
                    line = (f"rank {tag.rank}: its optimizer state but the rows' tensors, and its model_states but "
                            "what follows a row: not compared, a source changed since the composition")
                    report.unproven += [line] if line not in report.unproven else []
            elif i in outcome.differing:
                count = shown[tag.rank, tag.kind] = shown.get((tag.rank, tag.kind), 0) + 1
                if count <= MAX_SHOWN:
                    report.add(tag.row, tag.problem)
        if 0 in self.changed:  # (the ranks claimed here: another batch, or a worker's share, says it of its own)
            for rank in sorted({tag.rank for tag in self.tags if tag.rank >= 0}):
                if not self.archives.proven(plan.output_rank_files()[rank]):
                    line = ("every rank's optimizer state but the rows' tensors, and its model_states but what "
                            "follows a row: not compared, the base changed since the composition")
                    report.unproven += [line] if line not in report.unproven else []
        for rank, found in enumerate(rows):
            settle(report, rank, found, self.taken, self.names)

    def _settle_spread(self, tag: Tag, outcome: streamed.Outcome, mine: RankRows, bad: set[int]) -> None:
        """A spread's parts settled as the claims of its segments are: each row's CRC-32s, and what differs."""
        spread, segments = self.claims.spreads[tag.claim], tag.segments or []
        crcs, differing = outcome.spread_crcs[tag.claim], outcome.spread_differing.get(tag.claim, set())
        for j, segment in enumerate(segments):
            _at, n, which = spread.pattern.parts[j]
            if segment.row is None:
                if j in differing:
                    for part_row, problem in self._which_part(tag, spread, j):
                        self.report.add(part_row, problem)
                continue
            mine.crcs.add_crc(segment.row, tag.key, crcs[j], n)
            file = spread.sources[which][0] if which >= 0 else -1
            if file < 0 or file in bad:
                mine.from_changed[segment.row] = segment.source
            elif j in differing:
                for _row, problem in self._which_part(tag, spread, j):
                    mine.differs(segment.row, problem, segment.source)

    def _which_part(self, tag: Tag, spread: streamed.Spread, j: int) -> list[tuple[str | None, str]]:
        """`_which` of a spread's part j."""
        parts = tag.told(j) if tag.told is not None else []
        if len(parts) == 1:
            return [parts[0][:2]]
        which = spread.pattern.parts[j][2]
        return self._rechecked(spread.out, spread.sources[which][0] if which >= 0 else which, parts)

    def _which(self, tag: Tag) -> list[tuple[str | None, str]]:
        """(row, problem) of each part of a differing claim whose bytes differ (a claim of one part: itself)."""
        parts = tag.parts() if callable(tag.parts) else tag.parts
        if not parts or len(parts) == 1:
            return [(tag.row, tag.problem)]
        c = self.claims.claims[tag.claim]
        return self._rechecked(c.out, c.source, parts)

    def _rechecked(self, out: int, source: int, parts: list) -> list[tuple[str | None, str]]:
        """(row, problem) of each of `parts` ((row, problem, output byte, length, source byte) of output file `out`
        and `source`'s, or zeros) whose bytes differ, read again."""
        differs = streamed.recheck(self.claims, out, source, [(at, n, source_at)
                                                               for _row, _problem, at, n, source_at in parts])
        return [(row, problem) for (row, problem, *_rest), bad in zip(parts, differs) if bad]


def _empty(ref) -> bool:
    return (ref.numel() if isinstance(ref, TensorRef) else ref.numel) == 0


def at_path(states, where: str):
    """The value at a path such as ['module']['model.x'] (None if absent)."""
    value: object = states
    for key in where[1:-1].split("]["):
        value = (value or {}).get(ast.literal_eval(key)) if isinstance(value, dict) else None
    return value

