"""Comparing an output's bytes with its sources', streamed: every file read once, in bounded memory.

The verifier says what each output byte must be (`Comparison`): the bytes of a source file at some offset
(`claim`), zero bytes (`zeros`), or nothing but what its record's CRC-32 proves (`NOTHING`); or, for a stretch
laid out alike in the output and several sources (a ZeRO rank's flat tensor, each row from its checkpoint),
each part of it one of those (`spread`: one `Spread` of hundreds of parts, their layout a `Pattern` shared by
every rank alike, not a claim each); and which stretches of each file carry evidence that must hold
(`evidence`: an archive record's stored CRC-32, a partial save's slice CRC-32, or none). `run` then reads:

- every output file's evidence stretches whole, in segments of at most SEGMENT bytes, each a task of
  its own (workers in parallel, across files and within a large one), through one READ_CHUNK-sized buffer
  per worker; for each claim met on the way, the source's bytes it names are read into a source buffer
  and compared (memcmp), and the CRC-32 of both sides' bytes taken. Small claims (a wide run's: thousands
  of a few KiB a rank, their sources alternating) read a window of each source at a time, up to WINDOW
  bytes through the claims on it that follow (`_reaches`, `buffers.SourceWindows`), not a read each, each
  window of a source's record from where the one before it ended (they tile it); a window's CRC-32s are
  taken once, of each of its stretches' parts, the bytes between its claims included. For a spread, each
  chunk of the output it holds is met by the same bytes of each source with parts there, read once into the
  source buffer, every part compared with them (memcmp) and its output CRC-32 taken, in one loop over the
  parts: no claim, task search or window per part (a wide run's ranks hold a hundred thousand of them); the
  bytes of a source between its parts are evidence too, read with them (a claim's window never takes a
  spread's source bytes: each byte is read once);
- then the stretches of the sources' evidence nothing read yet (a source record's rows another source
  gave, beyond a window's reach), once, so that every stretch relied on is read whole exactly once;
  small neighbours together.

Each stretch's CRC-32 is put together from the CRC-32s of its parts, wherever and in whichever order
they were read (`checked.crc.combine`), and compared with its evidence. So each byte of each file is
read once as evidence (the few left between two windows are read with their neighbours: those bytes twice,
from the page cache, not the disk), memory holds three chunks per worker whatever the files' sizes (the output's,
a large part's, four windows), and nothing is mapped. The files are looked at once when named, and each thread
that reads one opens it itself and reads it only where it is still that file (`buffers.Descriptors`: its identity,
`checked.files.FileIdentity`, compared when opened and when done): a file that changed meanwhile is
`Outcome.moved`, and nothing read of it is a verdict.

What the bytes mean (which claim is which row's, what a failure says) is the caller's: claims carry a
tag it gives, outcomes name the tags whose bytes differ.
"""

from __future__ import annotations

import bisect
import itertools
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, NamedTuple

from tailor_tui.checked import crc
from tailor_tui.checked.files import FileIdentity
from tailor_tui.checked.ranges import READ_CHUNK, pread_into
from tailor_tui.errors import CheckpointError
from tailor_tui.formats.dtypes import cast_difference
from tailor_tui.verifying.buffers import (
    WINDOW,
    Buffer,
    Descriptors,
    Moved,
    SourceWindows,
    first_difference,
    opened,
    same,
)

SEGMENT = 64 << 20  # bytes of an output stretch one task reads: a large file is read by several workers
ZERO = -1  # a claim's source: zero bytes (padding)
NOTHING = -2  # a claim's source: none, its bytes only CRC-checked and their CRC-32 taken (`Outcome.crcs`)
MAX_WORKERS = 8
NEAR = 64 << 10  # bytes between two parts one read takes together (a source's claims, an output's records)


class Claim(NamedTuple):
    """Bytes [at, at+length) of output file `out` must be source file `source`'s from `source_at` (ZERO: zero
    bytes; NOTHING: anything their stretch's evidence proves); `cast` (BF16, F16): the source's float32 elements
    from there, cast so (`formats.dtypes.cast_difference`: twice as many source bytes). `tag`: the caller's."""

    out: int
    at: int
    length: int
    source: int
    source_at: int
    tag: int
    cast: str = ""

    @property
    def source_length(self) -> int:
        return self.length * 2 if self.cast else self.length


class Pattern:
    """How a `Spread`'s bytes are laid out, shared by every Spread alike (a class of a wide run's ranks): `parts`, in
    order, each (its first byte from the Spread's, its length, which of its sources gives it: an index into
    `Spread.sources`, ZERO, or NOTHING); `of_source[k]`: the indices of source k's parts (ZERO's: `zeros`), and their
    first bytes, by offset."""

    def __init__(self, parts: tuple[tuple[int, int, int], ...], sources: int) -> None:
        self.parts = parts
        self.starts = [at for at, _n, _which in parts]
        self.of_source: list[tuple[list[int], list[int]]] = [([], []) for _ in range(sources)]
        self.zeros: tuple[list[int], list[int]] = ([], [])
        end = 0
        for j, (at, n, which) in enumerate(parts):
            if at < end or n <= 0 or which >= sources or which < NOTHING:
                raise ValueError(f"pattern part {j} {parts[j]}: parts in order, apart, of bytes, of a source")
            end = at + n
            mine = self.zeros if which == ZERO else self.of_source[which] if which >= 0 else None
            if mine is not None:
                mine[0].append(j)
                mine[1].append(at)
        self.length = end


class Spread(NamedTuple):
    """Output bytes [at, at+length) of file `out` laid out by `pattern` (`length`: the pattern's): each part the bytes
    of one of `sources` ((file, the first byte its bytes are counted from)) at the same offset from that source's first
    byte, or zero bytes, or only CRC-checked (NOTHING). A ZeRO rank's flat tensor, its rows from checkpoints alike in
    layout: hundreds of parts, compared as the output is read, each source's bytes beside the output's read once
    (`tag`: the caller's). Each part's outcome: whether its bytes differ (`Outcome.spread_differing`), their CRC-32
    (`spread_crcs`)."""

    out: int
    at: int
    sources: tuple[tuple[int, int], ...]
    pattern: Pattern
    tag: int

    @property
    def length(self) -> int:
        return self.pattern.length


class Stretch(NamedTuple):
    """Bytes [at, at+length) of file `file` whose CRC-32 must be `crc` (None: no evidence, only read where
    claimed); `name` says which (a record's, a slice's) in a failure."""

    file: int
    at: int
    length: int
    crc: int | None
    name: str

    @property
    def data_offset(self) -> int:  # (a `checked.evidence.Checkable`: its failure told as a record's)
        return self.at

    @property
    def size(self) -> int:
        return self.length


@dataclass
class Outcome:
    """What `run` found."""

    differing: set[int] = field(default_factory=set)  # tags of claims whose bytes differ
    first: dict[int, int] = field(default_factory=dict)  # tag -> the first output byte found differing
    failed: list[tuple[Stretch, int]] = field(default_factory=list)  # stretches failing their CRC-32, and theirs
    moved: list[Path] = field(default_factory=list)  # files that changed while they were read
    crcs: dict[int, int] = field(default_factory=dict)  # claim index -> CRC-32 of its output bytes
    spread_crcs: dict[int, list[int]] = field(default_factory=dict)  # spread -> each part's output bytes' CRC-32
    spread_differing: dict[int, set[int]] = field(default_factory=dict)  # spread -> its parts whose bytes differ
    read: int = 0  # bytes read


class Comparison:
    """What an output must hold, file by file (see the module's docstring). Each file is looked at as it is named
    (`file`): a regular file, readable, its identity kept; every task that reads it opens it again and reads it
    only where it is still that file, at the start of the task and at its end."""

    def __init__(self) -> None:
        self.paths: list[Path] = []
        self.identities: list[FileIdentity] = []  # identity of each file as first opened
        self._index: dict[Path, int] = {}
        self.claims: list[Claim] = []
        self.spreads: list[Spread] = []
        self.stretches: list[Stretch] = []
        self._evidenced: set[tuple[int, int, int]] = set()
        self.labels: dict[int, str] = {}  # output file -> progress label (a rank)

    def file(self, path: Path, *, label: str | None = None, seen: os.stat_result | None = None) -> int:
        """The index of the file at `path` (CheckpointError: missing, not a regular file, unreadable). `label`:
        an output file's progress label. `seen`: fstat's of the file where the caller read what it claims of it
        (its structure): the identity its bytes are held to, not looked up again."""
        path = Path(path)
        if path not in self._index:
            if seen is not None:
                st = seen
            else:
                fd = opened(path)
                try:
                    st = os.fstat(fd)
                finally:
                    os.close(fd)
            self._index[path] = len(self.paths)
            self.paths.append(path)
            self.identities.append(FileIdentity.of(st))
        f = self._index[path]
        if label is not None:
            self.labels[f] = label
        return f

    def size(self, f: int) -> int:
        return self.identities[f].size

    def evidence(self, f: int, at: int, length: int, crc_: int | None, name: str) -> None:
        """Bytes [at, at+length) of file `f` carry the CRC-32 `crc_` (None: none); said again, nothing more."""
        if (f, at, length) not in self._evidenced:
            self._evidenced.add((f, at, length))
            self.stretches.append(Stretch(f, at, length, crc_, name))

    def claim(self, out: int, at: int, length: int, source: int, source_at: int, tag: int, *, cast: str = "") -> int:
        """Output bytes [at, at+length) must be `source`'s from `source_at` (`cast`: its float32 elements cast to
        that 16-bit dtype, the claim on whole elements of a stretch that starts on one); returns the claim's
        index."""
        if cast and (length % 2 or source < 0):
            raise ValueError(f"a cast claim of {length} bytes from {source}: whole elements of a source, only")
        self.claims.append(Claim(out, at, length, source, source_at, tag, cast))
        return len(self.claims) - 1

    def zeros(self, out: int, at: int, length: int, tag: int) -> int:
        return self.claim(out, at, length, ZERO, 0, tag)

    def spread(self, out: int, at: int, sources: tuple[tuple[int, int], ...], pattern: Pattern, tag: int) -> int:
        """Output bytes [at, at+pattern.length) laid out by `pattern` from `sources` (`Spread`); its index."""
        if len(sources) != len(pattern.of_source):
            raise ValueError(f"a spread of {len(sources)} sources on a pattern of {len(pattern.of_source)}")
        self.spreads.append(Spread(out, at, sources, pattern, tag))
        return len(self.spreads) - 1



class _Reading(NamedTuple):
    file: int
    parts: tuple[tuple[int, int], ...]  # (offset, length) read, in order: a large stretch's share, or small ones
    claims: tuple[int, ...]  # indices of the claims overlapping them, by offset
    spreads: tuple[int, ...] = ()  # indices of the spreads overlapping them, by offset

    @property
    def length(self) -> int:
        return sum(n for _a, n in self.parts)


class _Found:
    """One task's findings (merged into the Outcome by the caller, under its lock); `evidence`: each file's
    stretches, by offset, and their first bytes (what a source's window is cut at: `window`)."""

    def __init__(self, evidence: dict[int, tuple[list[Stretch], list[int]]],
                 spread: dict[int, tuple[list[int], list[int]]] | None = None) -> None:
        self.evidence = evidence
        self.spread = spread or {}  # each source's bytes spreads read: [first bytes], [furthest end so far]
        self.pieces: list[tuple[int, int, int, int]] = []  # (file, at, length, CRC-32) read
        self.out_crcs: dict[int, list[int]] = {}  # claim -> [first output byte read, length, CRC-32]
        self.src_crcs: dict[int, list[int]] = {}  # claim -> [first source byte read, length, CRC-32]
        self.differing: set[int] = set()
        self.first: dict[int, int] = {}
        self.spread_parts: list[tuple[int, int, int, int, int]] = []  # (spread, part, first byte read, length, CRC-32)
        self.spread_differing: list[tuple[int, int]] = []  # (spread, part) whose bytes differ

    def differs(self, tag: int, at: int) -> None:
        self.differing.add(tag)
        self.first[tag] = min(at, self.first.get(tag, at))

    def window(self, f: int, at: int, view: memoryview) -> None:
        """`view` holds bytes of file `f` from `at`, read once: the CRC-32 of each part of them inside one of its
        stretches, a piece of its own (the bytes between a source's claims too, read with them: not read again)."""
        stretches, starts = self.evidence.get(f, ([], []))
        end = at + len(view)
        for k in range(max(0, bisect.bisect_right(starts, at) - 1), len(stretches)):
            s = stretches[k]
            if s.at >= end:
                break
            lo, hi = max(at, s.at), min(end, s.at + s.length)
            if hi > lo:
                self.pieces.append((f, lo, hi - lo, crc.crc32(view[lo - at: hi - at])))


def run(claims: Comparison, *, workers: int = 2, on_bytes: Callable[[str, int], None] = lambda label, n: None,
        on_sources: Callable[[int], None] = lambda total: None, cancelled: Callable[[], bool] = lambda: False
        ) -> Outcome:
    """Read and compare (the module's docstring). `on_bytes(label, n)`: `n` more bytes of an output file labelled
    `label` read ("sources": of the sources' stretches no claim read, `on_sources(total)` told first how many). A
    claim must lie inside one of its output file's stretches, its source bytes inside one of the source's
    (ValueError: the caller's bug)."""
    outcome = Outcome()
    asked, stop = cancelled, threading.Event()
    cancelled = lambda: stop.is_set() or asked()  # noqa: E731 (a failed thread, a Ctrl-C, or the caller's flag)
    evidence: dict[int, list[Stretch]] = {}
    for s in claims.stretches:
        evidence.setdefault(s.file, []).append(s)
    for found in evidence.values():
        found.sort(key=lambda s: s.at)
    placed = {f: (found, [s.at for s in found]) for f, found in evidence.items()}
    spread: dict[int, list[tuple[int, int]]] = {}  # each source's (first byte, end) that spreads read
    for sp in claims.spreads:
        for f, first in sp.sources:
            spread.setdefault(f, []).append((first, first + sp.length))
    read_by_spreads = {}
    for f, ranges in spread.items():
        ranges.sort()
        read_by_spreads[f] = ([a for a, _b in ranges], list(itertools.accumulate((b for _a, b in ranges), max)))
    lock = threading.Lock()
    local = threading.local()
    pieces: list[tuple[int, int, int, int]] = []  # (file, at, length, CRC-32) of every part read
    by_claim_src: dict[int, list[tuple[int, int, int]]] = {}
    by_claim_out: dict[int, list[tuple[int, int, int]]] = {}
    spread_parts: list[tuple[int, int, int, int, int]] = []
    moved: set[int] = set()

    def reading(task: _Reading, read: Callable[[Descriptors], Callable[[], None]]) -> None:
        """`read(files)` on this thread's buffers and the task's own descriptors; what it returns, done under the
        lock where no file it read changed meanwhile."""
        if not hasattr(local, "out"):
            local.out, local.src = Buffer(), SourceWindows()
        files = Descriptors(claims.paths, claims.identities)
        try:
            keep = read(files)
        except Moved as exc:
            with lock:
                moved.add(exc.f)
            return
        finally:
            changed = files.close()
        with lock:
            moved.update(changed)
            keep()

    def do(task: _Reading) -> None:
        def read(files: Descriptors) -> Callable[[], None]:
            found = _Found(placed, read_by_spreads)
            _read_task(claims, task, files, local.out, local.src, found, cancelled,
                       lambda n: on_bytes(claims.labels.get(task.file, "output"), n))

            def keep() -> None:
                pieces.extend(found.pieces)
                outcome.differing |= found.differing
                for tag, at in found.first.items():
                    outcome.first[tag] = min(at, outcome.first.get(tag, at))
                for c, (a, n, value) in found.src_crcs.items():
                    by_claim_src.setdefault(c, []).append((a, n, value))
                for c, (a, n, value) in found.out_crcs.items():
                    by_claim_out.setdefault(c, []).append((a, n, value))
                spread_parts.extend(found.spread_parts)
                for i, j in found.spread_differing:
                    outcome.spread_differing.setdefault(i, set()).add(j)
            return keep
        reading(task, read)

    _pool(do, _tasks(claims, placed), workers, stop)
    for c, parts in by_claim_src.items():
        source = claims.claims[c].source
        pieces.extend((source, a, n, value) for a, n, value in parts)
    for c, parts in by_claim_out.items():
        parts.sort()
        value = 0
        for _a, n, part in parts:
            value = crc.combine(value, part, n)
        outcome.crcs[c] = value
    _spread_crcs(claims, spread_parts, outcome)
    # every stretch whole: the parts no claim read, read now, then each stretch's CRC-32 put together
    gaps, held = _gaps(evidence, pieces)
    on_sources(sum(t.length for t in gaps))

    def fill(task: _Reading) -> None:
        def read(files: Descriptors) -> Callable[[], None]:
            found = _Found(placed)
            _read_task(claims, task, files, local.out, local.src, found, cancelled, lambda n: on_bytes("sources", n))
            return lambda: held.extend(found.pieces)
        reading(task, read)

    _pool(fill, gaps, workers, stop)
    outcome.moved = [claims.paths[f] for f in sorted(moved)]
    outcome.read = sum(p[2] for p in pieces) + sum(t.length for t in gaps)
    if not moved:
        _settle(evidence, held, outcome)
    return outcome


def _pool(do: Callable[[_Reading], None], tasks: list[_Reading], workers: int, stop: threading.Event) -> None:
    """Run `do` on every task, on `workers` threads. The first failure (Cancelled, a Ctrl-C in the main thread) is
    raised once every thread stopped: the tasks not started are dropped, the running ones stop at their next chunk
    (`stop`, which `run`'s cancel test looks at)."""
    if not tasks:
        return
    workers = max(1, min(workers, MAX_WORKERS, len(tasks)))
    if workers == 1:
        for task in tasks:
            do(task)
        return
    pool = ThreadPoolExecutor(workers, thread_name_prefix="verify")
    try:
        for future in [pool.submit(do, task) for task in sorted(tasks, key=lambda t: -t.length)]:
            future.result()
    except BaseException:
        stop.set()
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    pool.shutdown(wait=True)


def _spread_crcs(claims: Comparison, found: list[tuple[int, int, int, int, int]], outcome: Outcome) -> None:
    """Each spread's parts' CRC-32s (`Outcome.spread_crcs`), put together from what each task read of them."""
    for i, sp in enumerate(claims.spreads):
        outcome.spread_crcs[i] = [0] * len(sp.pattern.parts)
    pieces = []  # parts read by several tasks or chunks, a piece by each: joined in order
    for piece in found:
        i, j, _a, n, value = piece
        if n == claims.spreads[i].pattern.parts[j][1]:  # the whole part, as most are: its CRC-32 as it is
            outcome.spread_crcs[i][j] = value
        else:
            pieces.append(piece)
    pieces.sort()
    for i, j, _a, n, value in pieces:
        crcs = outcome.spread_crcs[i]
        crcs[j] = crc.combine(crcs[j], value, n)


def _packed(f: int, spans: list[tuple[int, int]]) -> list[tuple[int, tuple[tuple[int, int], ...]]]:
    """`spans` of file `f`, in order, as tasks' parts: a large one cut in SEGMENTs, small ones together up to one."""
    tasks: list[tuple[int, tuple[tuple[int, int], ...]]] = []
    parts: list[tuple[int, int]] = []
    held = 0
    for at, length in spans:
        for a in range(at, at + length, SEGMENT) if length else ():
            n = min(SEGMENT, at + length - a)
            if parts and held + n > SEGMENT:
                tasks.append((f, tuple(parts)))
                parts, held = [], 0
            parts.append((a, n))
            held += n
    if parts:
        tasks.append((f, tuple(parts)))
    return tasks


def _tasks(claims: Comparison, placed: dict[int, tuple[list[Stretch], list[int]]]) -> list[_Reading]:
    """The output files' stretches in tasks, each with the claims that overlap its parts (`placed`: each file's
    stretches by offset, and their first bytes)."""
    for c in claims.claims:
        if c.source >= 0 and _holding(*placed.get(c.source, ([], [])), c.source_at, c.source_length) is None:
            raise ValueError(f"claim {c}: its source bytes lie outside the stretches of {claims.paths[c.source]}")
    for sp in claims.spreads:
        for f, first in sp.sources:
            if _holding(*placed.get(f, ([], [])), first, sp.length) is None:
                raise ValueError(f"spread {sp[:2]} of {sp.length} bytes: its source bytes lie outside the stretches of "
                                 f"{claims.paths[f]}")
    by_file: dict[int, list[int]] = {}
    for i, c in enumerate(claims.claims):
        by_file.setdefault(c.out, []).append(i)
    spread_by_file: dict[int, list[int]] = {}
    for i, sp in enumerate(claims.spreads):
        spread_by_file.setdefault(sp.out, []).append(i)
    tasks = []
    for f in sorted(set(by_file) | set(spread_by_file) | set(claims.labels)):
        stretches, starts = placed.get(f, ([], []))
        packed = _packed(f, [(s.at, s.length) for s in stretches])
        firsts = [parts[0][0] for _f, parts in packed]
        mine: list[list[int]] = [[] for _ in packed]
        for i in by_file.get(f, ()):
            c = claims.claims[i]
            inside = _holding(stretches, starts, c.at, c.length)
            if inside is None:
                raise ValueError(f"claim {c} lies outside the stretches of {claims.paths[f]}")
            if c.cast and (c.at - inside.at) % 2:
                raise ValueError(f"cast claim {c}: not on an element of its stretch (read 2 bytes at a time)")
            for j in _overlapping(packed, firsts, c.at, c.length):
                mine[j].append(i)
        spreads: list[list[int]] = [[] for _ in packed]
        for i in spread_by_file.get(f, ()):
            sp = claims.spreads[i]
            if _holding(stretches, starts, sp.at, sp.length) is None:
                raise ValueError(f"spread {sp[:2]} of {sp.length} bytes lies outside the stretches of "
                                 f"{claims.paths[f]}")
            for j in _overlapping(packed, firsts, sp.at, sp.length):
                spreads[j].append(i)
        for (_f, parts), members, laid in zip(packed, mine, spreads):
            members.sort(key=lambda i: claims.claims[i].at)
            laid.sort(key=lambda i: claims.spreads[i].at)
            tasks.append(_Reading(f, parts, tuple(members), tuple(laid)))
    return tasks


def _overlapping(packed: list[tuple[int, tuple[tuple[int, int], ...]]], firsts: list[int], at: int, length: int):
    """The tasks of `packed` (in order; `firsts`: the first byte each reads) whose parts reach bytes [at, at+length)
    (a claim of no bytes: the task holding its offset)."""
    j = max(0, bisect.bisect_right(firsts, at) - 1)
    while j < len(packed) and firsts[j] < at + max(length, 1):
        last_at, last_n = packed[j][1][-1]
        if last_at + last_n > at:
            yield j
        j += 1


def _holding(stretches: list[Stretch], starts: list[int], at: int, length: int) -> Stretch | None:
    """The stretch (of a file's, by offset; `starts`: their first bytes) that bytes [at, at+length) lie inside, if
    one does."""
    k = bisect.bisect_right(starts, at) - 1
    return stretches[k] if k >= 0 and at + length <= stretches[k].at + stretches[k].length else None


def _read_task(claims: Comparison, task: _Reading, files: Descriptors, out: Buffer, src: SourceWindows, found: _Found,
               cancelled: Callable[[], bool], counted: Callable[[int], None]) -> None:
    """Read the parts of `task` (`_reads`: neighbours together, a large one a chunk at a time): each part's
    CRC-32, and each claim's and spread's bytes in it compared."""
    from tailor_tui.events import Cancelled

    fd = files[task.file]
    members = [claims.claims[i] for i in task.claims]
    spreads = claims.spreads
    reach = _reaches(members, task.parts[0][0], task.parts[-1][0] + task.parts[-1][1], found.evidence, found.spread)
    src.forget()  # (a source's bytes are read by this task's descriptors only)
    first = 0  # the first claim not wholly read yet
    for group in _reads(task.parts):
        start, end = group[0][0], group[-1][0] + group[-1][1]
        held = end - start <= READ_CHUNK  # every part of the group in the buffer at once, from `start`
        if held:
            if cancelled():
                raise Cancelled()
            pread_into(fd, out.view[: end - start], start)
        for at, length in group:
            position, stop_at, value = at, at + length, 0
            while first < len(members) and members[first].at + members[first].length <= position \
                    and members[first].length:
                first += 1
            while position < stop_at:
                n = min(READ_CHUNK, stop_at - position) if not held else stop_at - position
                base = start if held else position  # the file offset of the buffer's first byte
                if not held:
                    if cancelled():
                        raise Cancelled()
                    files.ahead(task.file, position, stop_at)
                    pread_into(fd, out.view[:n], position)
                value = crc.crc32(out.view[position - base: position - base + n], value)
                stop = position + n
                k = first
                while k < len(members) and members[k].at < stop:
                    c = members[k]
                    a, b = max(c.at, position), min(c.at + c.length, stop)
                    if b > a:
                        _compare(files, task.claims[k], c, a, b - a, out, a - base, src, found, reach[k])
                    k += 1
                for i in task.spreads:  # (a few: a rank file's flat tensors)
                    sp = spreads[i]
                    a, b = max(sp.at, position), min(sp.at + sp.length, stop)
                    if b > a:
                        _compare_spread(files, i, sp, a - sp.at, b - sp.at, out, a - base, src.large(), found)
                counted(n)
                position = stop
            found.pieces.append((task.file, at, length, value))


def _reads(parts: tuple[tuple[int, int], ...]):
    """`parts` (in order) as the reads that take them: neighbours at most NEAR bytes apart together, up to a
    chunk's span (a small file's records, the few bytes of sources' stretches left between windows: one read, not
    one each); a part larger than a chunk alone (read a chunk at a time)."""
    k = 0
    while k < len(parts):
        start, end, j = parts[k][0], parts[k][0] + parts[k][1], k + 1
        while j < len(parts) and 0 <= parts[j][0] - end <= NEAR and parts[j][0] + parts[j][1] - start <= READ_CHUNK:
            end, j = parts[j][0] + parts[j][1], j + 1
        yield parts[k:j]
        k = j


def _reaches(members: list[Claim], start: int, end: int, evidence: dict[int, tuple[list[Stretch], list[int]]],
             spread: dict[int, tuple[list[int], list[int]]]) -> list[tuple[int, int] | None]:
    """For each claim of a task (in the output's order; its parts from output byte `start` to `end`), the source
    bytes one read of its source's may take (None: no window): from its own first byte, up to the end of the claims
    on the same source after it (others may come between) that go on there in order, each starting at most NEAR
    bytes after the one before ends or further inside one of the source's stretches with evidence (`evidence`: each
    file's, by offset), within a window's size; never past what the task reads of a claim (another task's share of
    it is its own). The first claim of such a run starts its read where the run before it on that source ended, where
    the bytes between are evidence too: the windows tile the source's record, whose every byte is read anyway (its
    CRC-32), and the window's CRC-32s of the bytes between spare reading them afterwards.
    None for a claim of which the task reads more than a window (read part by part as it is, never through a window:
    a window's bytes and another read's of the same claim would both be pieces of its source's stretch).
    A wide run's ranks are thousands of claims of a few KiB, each its own read otherwise (their system calls took
    more time than their bytes)."""
    reach: list[tuple[int, int] | None] = [None] * len(members)
    chains: dict[int, tuple[int, int, list[tuple[int, int]]]] = {}  # source -> (window's first byte, end, claims)
    for k, c in enumerate(members):
        if c.source < 0 or c.cast:
            continue
        first = c.source_at + max(0, start - c.at)
        last = c.source_at + min(c.length, end - c.at)
        if last - first > WINDOW:  # (read as it is, part by part: None)
            continue
        chain = chains.get(c.source)
        if chain is not None and first >= chain[1] and last - chain[0] <= WINDOW and (
                first - chain[1] <= NEAR or _in_evidence(evidence, c.source, chain[1], first)) and not _spread_between(
                spread, c.source, chain[1], first):
            chains[c.source] = (chain[0], last, chain[2])
            chain[2].append((k, first))
            continue
        begin = first
        if chain is not None:
            _close(chain, reach)
            if first >= chain[1] and last - chain[1] <= WINDOW and _in_evidence(evidence, c.source, chain[1], first) \
                    and not _spread_between(spread, c.source, chain[1], first):
                begin = chain[1]  # (the windows tile the source)
        chains[c.source] = (begin, last, [(k, first)])
    for chain in chains.values():
        _close(chain, reach)
    return reach


def _spread_between(spread: dict[int, tuple[list[int], list[int]]], f: int, at: int, end: int) -> bool:
    """Whether a spread reads any of bytes [at, end) of file `f` (its source: a window never takes them too)."""
    starts, reached = spread.get(f, ([], []))  # (`reached`: the furthest any of the first k reach)
    k = bisect.bisect_left(starts, end)  # (the spreads starting before `end`)
    return k > 0 and reached[k - 1] > at


def _in_evidence(evidence: dict[int, tuple[list[Stretch], list[int]]], f: int, at: int, end: int) -> bool:
    """Whether bytes [at, end) of file `f` lie inside one of its stretches with evidence (a CRC-32)."""
    inside = _holding(*evidence.get(f, ([], [])), at, end - at)
    return inside is not None and inside.crc is not None


def _close(chain: tuple[int, int, list[tuple[int, int]]], reach: list[tuple[int, int] | None]) -> None:
    """Each claim of a run: its window from the run's first byte (the first claim) or its own (the others: read
    again from there only where the window was let go meanwhile), to the run's end."""
    begin, end, members = chain
    for j, (k, first) in enumerate(members):
        reach[k] = (begin if j == 0 else first, end)


def _compare(files: Descriptors, index: int, c: Claim, a: int, n: int, out: Buffer, at: int, windows: SourceWindows,
             found: _Found, reach: tuple[int, int] | None) -> None:
    """Output bytes [a, a+n) of claim `c`, at `at` in the output buffer: compared, their CRC-32s taken (`reach`: the
    source bytes a window read for them takes, through the claims that follow; None: no window, `_reaches`)."""
    mine = crc.crc32(out.view[at: at + n])
    _extend(found.out_crcs, index, a, n, mine)
    if c.source == NOTHING:
        return
    if c.source == ZERO:
        if not same(out, at, None, 0, n):
            found.differs(c.tag, a + first_difference(out, at, None, 0, n))
        return
    if c.cast:
        _compare_cast(files, index, c, a, n, out, at, windows.large(), found)
        return
    source_at = c.source_at + (a - c.at)
    if reach is None:  # a claim larger than a window: each part read as it is, its CRC-32 the claim's
        src, held = windows.large(), 0
        files.ahead(c.source, source_at, c.source_at + c.length)
        pread_into(files[c.source], src.view[:n], source_at)
        _extend(found.src_crcs, index, source_at, n, crc.crc32(src.view[:n]))
    else:
        held_by = windows.holding(c.source, source_at, n)
        if held_by is not None:
            src = held_by
        else:  # a window: read once for the claims on it that follow, its CRC-32s those of its stretches
            begin = reach[0] if reach[0] <= source_at and source_at + n - reach[0] <= windows.size else source_at
            src, end = windows.free(c.source), max(source_at + n, min(reach[1], begin + windows.size))
            files.ahead(c.source, begin, max(end, c.source_at + c.length))
            pread_into(files[c.source], src.view[: end - begin], begin)
            src.file, src.start, src.length = c.source, begin, end - begin
            found.window(c.source, begin, src.view[: end - begin])
        held = source_at - src.start
    if not same(out, at, src, held, n):
        found.differs(c.tag, a + first_difference(out, at, src, held, n))


def _compare_spread(files: Descriptors, index: int, sp: Spread, r0: int, r1: int, out: Buffer, at: int, src: Buffer,
                    found: _Found) -> None:
    """Bytes [r0, r1) of spread `sp` (from its first byte), at `at` in the output buffer: each part's CRC-32 taken
    there, each source's bytes [r0, r1) from its first byte read once (the pieces of its stretches: every byte
    between its parts is evidence too) and its parts compared with them, the zero parts with zeros."""
    pattern, view = sp.pattern, out.view
    parts, starts = pattern.parts, pattern.starts
    spread_parts, differing, crc32 = found.spread_parts, found.spread_differing, crc.crc32
    for j in range(max(0, bisect.bisect_right(starts, r0) - 1), len(parts)):  # (~70 parts a rank's tensor: its
        part_at, n, _which = parts[j]  # rows' switches of source, a hundred thousand in a wide run: a lean loop)
        if part_at >= r1:
            break
        lo, hi = part_at if part_at > r0 else r0, min(part_at + n, r1)
        if hi > lo:
            spread_parts.append((index, j, lo, hi - lo, crc32(view[at + lo - r0: at + hi - r0])))
    for k, (f, first) in enumerate(sp.sources):
        mine, offsets = pattern.of_source[k]
        t = _first_part(mine, offsets, parts, r0)
        if t >= len(mine) or offsets[t] >= r1:
            continue  # (none of its parts here: its bytes read with the stretches no claim read)
        files.ahead(f, first + r0, first + sp.length)
        pread_into(files[f], src.view[: r1 - r0], first + r0)
        found.window(f, first + r0, src.view[: r1 - r0])
        _same_parts(out, at, r0, r1, src, mine, t, parts, index, differing)
    mine, offsets = pattern.zeros
    if mine:
        _same_parts(out, at, r0, r1, None, mine, _first_part(mine, offsets, parts, r0), parts, index, differing)


def _first_part(mine: list[int], offsets: list[int], parts: tuple[tuple[int, int, int], ...], r0: int) -> int:
    """The first of the parts `mine` (their first bytes `offsets`) that ends after `r0` (len(mine): none)."""
    t = bisect.bisect_right(offsets, r0) - 1
    return t + 1 if t < 0 or offsets[t] + parts[mine[t]][1] <= r0 else t


def _same_parts(out: Buffer, at: int, r0: int, r1: int, src: Buffer | None, mine: list[int], t: int,
                parts: tuple[tuple[int, int, int], ...], index: int, differing: list[tuple[int, int]]) -> None:
    """Each of the parts `mine` (from the `t`-th) that lie in [r0, r1) compared, the output's bytes at `at` (r0's)
    with `src`'s from its start (r0's; None: zero bytes)."""
    for u in range(t, len(mine)):
        j = mine[u]
        part_at, n, _which = parts[j]
        if part_at >= r1:
            break
        lo, hi = part_at if part_at > r0 else r0, min(part_at + n, r1)
        if hi > lo and not same(out, at + lo - r0, src, lo - r0, hi - lo):
            differing.append((index, j))


def _compare_cast(files: Descriptors, index: int, c: Claim, a: int, n: int, out: Buffer, at: int, src: Buffer,
                  found: _Found) -> None:
    """`_compare` of a cast claim: its source's float32 elements read a buffer at a time (every read of the output
    starts on an element of a claim's: `_tasks`), cast and compared with the output's."""
    done = 0
    while done < n:
        k = min(n - done, src.view.nbytes // 2)  # output bytes: twice as many source bytes in the buffer
        source_at = c.source_at + (a + done - c.at) * 2
        files.ahead(c.source, source_at, c.source_at + c.source_length)
        pread_into(files[c.source], src.view[: 2 * k], source_at)
        _extend(found.src_crcs, index, source_at, 2 * k, crc.crc32(src.view[: 2 * k]))
        wrong = cast_difference(out.view[at + done: at + done + k], src.view[: 2 * k], c.cast)
        if wrong is not None:
            found.differs(c.tag, a + done + 2 * wrong)
        done += k


def _extend(crcs: dict[int, list[int]], index: int, a: int, n: int, value: int) -> None:
    """Claim `index`'s bytes [a, a+n) read, CRC-32 `value`: joined to those read before it where they end at `a`."""
    held = crcs.get(index)
    if held is None:
        crcs[index] = [a, n, value]
    elif held[0] + held[1] == a:
        held[1] += n
        held[2] = crc.combine(held[2], value, n)
    else:  # (a claim read by two tasks: each task's part apart, joined by the caller)
        raise ValueError(f"claim {index} read out of order in one task")


def moved_error(path: Path) -> CheckpointError:
    """The one line for a file that changed while it was read (`Outcome.moved`): no verdict drawn from it."""
    return CheckpointError(f"{path}: changed while it was verified (written to, or replaced); what was read of it "
                           "proves nothing: run --verify again once nothing writes to it")


def damaged_output(path: Path, stretch: Stretch, value: int) -> str:
    """The FAIL line of an output record whose bytes do not give the CRC-32 it stores."""
    return (f"{path}: record {stretch.name} fails its CRC-32 check (stored {stretch.crc:08x}, its bytes give "
            f"{value:08x}): the output is damaged; compose it again")


def recheck(claims: Comparison, out: int, source: int, parts: list[tuple[int, int, int]]) -> list[bool]:
    """For each (output byte, length, source byte) of `parts` of a claim found differing, whether its bytes differ
    (read again, a chunk at a time: only where a claim that joins many failed, to say which of them did)."""
    files, a, b = Descriptors(claims.paths, claims.identities), Buffer(), Buffer()
    found = []
    try:
        for at, n, source_at in parts:
            differs, done = False, 0
            while done < n and not differs:
                k = min(READ_CHUNK, n - done)
                pread_into(files[out], a.view[:k], at + done)
                if source >= 0:
                    pread_into(files[source], b.view[:k], source_at + done)
                differs = not same(a, 0, b if source >= 0 else None, 0, k)
                done += k
            found.append(differs)
    except Moved as exc:
        raise moved_error(claims.paths[exc.f]) from None
    finally:
        files.close()
    return found


def _gaps(evidence: dict[int, list[Stretch]], pieces) -> tuple[list[_Reading], list]:
    """(tasks reading the parts of stretches with evidence that no piece read; the pieces that go into the
    stretches' CRC-32s). Where pieces overlap (claims sharing source bytes; a window reaching over bytes another
    task's claims read, a resharded output's), the first in order is kept, a piece that starts inside it left out,
    and what lies between the kept ones read as a gap: no stretch is read whole again for it."""
    by_file: dict[int, list[tuple[int, int, int, int]]] = {}
    for p in pieces:
        by_file.setdefault(p[0], []).append(p)
    tasks: list[_Reading] = []
    held = []
    for f, stretches in evidence.items():
        mine = sorted(by_file.get(f, ()), key=lambda p: (p[1], -p[2]))
        starts = [p[1] for p in mine]
        spans: list[tuple[int, int]] = []
        for s in stretches:
            if s.crc is None:
                continue
            position, end = s.at, s.at + s.length
            for p in mine[bisect.bisect_left(starts, s.at): bisect.bisect_left(starts, end)]:
                if p[1] < position or p[1] + p[2] > end:
                    continue  # (inside one kept, or astride the stretch's end)
                if position < p[1]:
                    spans.append((position, p[1] - position))
                held.append(p)
                position = p[1] + p[2]
            if position < end:
                spans.append((position, end - position))
        tasks += [_Reading(f, parts, ()) for f, parts in _packed(f, spans)]
    return tasks, held


def _settle(evidence: dict[int, list[Stretch]], held, outcome: Outcome) -> None:
    """Each stretch's CRC-32 from the parts read of it, compared with its evidence."""
    by_file: dict[int, list[tuple[int, int, int, int]]] = {}
    for p in held:
        by_file.setdefault(p[0], []).append(p)
    for f, stretches in evidence.items():
        parts = sorted(by_file.get(f, ()), key=lambda p: p[1])
        starts = [p[1] for p in parts]
        for s in stretches:
            if s.crc is None:
                continue
            i = bisect.bisect_left(starts, s.at)
            value, position = 0, s.at
            while position < s.at + s.length:
                if i >= len(parts) or parts[i][1] != position or position + parts[i][2] > s.at + s.length:
                    raise ValueError(f"stretch {s} not read whole (a part at {position} missing or astride it)")
                value = crc.combine(value, parts[i][3], parts[i][2])
                position += parts[i][2]
                i += 1
            if value != s.crc:
                outcome.failed.append((s, value))
