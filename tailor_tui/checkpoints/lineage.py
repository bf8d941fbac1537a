"""Which training run a checkpoint belongs to, and what its training log says.

Checkpoints of one run hold one model (the same parameters, names and shapes, whatever the world
size) and, where the HF Trainer saved them, one past: a checkpoint's log history up to its step
is where every later checkpoint's of the same run starts (a restored copy or a resumed run keeps
it). Two trainings side by side in one folder differ in one or the other; a scan that finds
several runs is refused (`check_one_run`), so the grid, the statistics' Δ and healing never
cross runs. DeepSpeed's own layout holds no history: there two save_dirs that both saved one step are
two runs (a sweep's lr-high/ and lr-low/; a run resumed into a new save_dir saves later steps there),
and for recipes the run folder tells them apart, as a warning (`other_run`).

A checkpoint's trainer_state.json is read once for all of them (`logged_at`: the history, the loss
at its step, what was ignored), item by item: three logs of 64 MiB (650,000 entries each) are
compared in seconds, `--stats` peaking at about 180 MiB: each entry is kept as its step and a
digest of its text (16 bytes), and compared again by value only where two texts differ.
"""

from __future__ import annotations

import contextlib
import marshal
import os
import threading
from array import array
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import zip_longest
from pathlib import Path
from typing import Any

from tailor_tui.checked.files import FileIdentity
from tailor_tui.checkpoints.checkpoint import Checkpoint, distinct_names
from tailor_tui.checkpoints.side_files import MAX_RECORD, RESTART, SKIPPED, Known, Unread, WideIntegers, json_items
from tailor_tui.errors import UsageError
from tailor_tui.kinds.folders import TRAINER_STATE

WHOLE = (1 << 63) - 1  # a log read whole: every entry's step but those no checkpoint reaches (nor an array's 'q' holds)
KEPT_ENTRIES = 8_000_000  # log entries the histories kept between their readers hold at most (16 bytes each)


@dataclass(frozen=True)
class History:
    """A checkpoint's log history up to its step: each entry's step, and a digest of its JSON text
    (Python's hash, keyed per process, where every comparison is made). Entries whose texts are
    equal are equal; texts that differ are compared again as values (`_values_differ`)."""

    steps: array
    digests: array

    def __len__(self) -> int:
        return len(self.steps)


@dataclass(frozen=True)
class LoggedAt:
    """What a checkpoint's trainer_state.json says up to its step: its history (None: no log to
    read), the last loss logged and the grad norm beside it, and what was ignored (`note`: the
    file could not be read, or integers past 64 bits were taken for absent)."""

    history: History | None = None
    loss: float | None = None
    grad_norm: float | None = None
    note: str | None = None


@dataclass(frozen=True)
class _Text:
    """A log read whole, for the next reading to skip where its log begins alike (`Known`): its
    entries' text (length, hash), the integers past 64 bits they held (how many; the first,
    described), and what they said."""

    length: int
    digest: int
    wide: int
    first: str | None
    logged: LoggedAt


def logged_number(value: object) -> float | None:
    """A number of the log as a float; None for anything else (text, a bool, an `Unread`)."""
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def log_entries(folder: Path, wide: WideIntegers | None = None, *, texts: bool = False,
                known: Known | None = None) -> Iterator[Any]:
    """The entries of the HF Trainer's log history the checkpoint `folder` saved, one at a time
    (`side_files.json_items` of its trainer_state.json, with RESTART, SKIPPED and its ValueError)."""
    return json_items(folder / TRAINER_STATE, "log_history", MAX_RECORD, wide, texts=texts, known=known)


def _read(folder: Path, upto: int, before: _Text | None = None) -> tuple[LoggedAt, _Text | None]:
    """What the log of `folder` says up to step `upto`, and, where it was read whole, its text for
    the next reading. `before`: the log read last, whose entries this one's may begin with."""
    path = folder / TRAINER_STATE
    wide = WideIntegers()
    known = (Known(before.length, before.digest) if before else Known()) if upto == WHOLE else None  # for the next
    steps, digests = array("q"), array("q")
    last, said, first, inherited, met = None, LoggedAt(), None, 0, 0  # the last entry logging a loss; the first Unread
    try:
        for item in log_entries(folder, wide, texts=True, known=known):  # 650,000 in a 64 MiB log: each step counts
            if item is SKIPPED:  # the entries `before` read
                assert before is not None and before.logged.history is not None, "known from a log read whole"
                steps, digests = array("q", before.logged.history.steps), array("q", before.logged.history.digests)
                said, first, inherited = before.logged, before.first, before.wide
                continue
            if item is RESTART:  # the log history given twice: the last counts
                steps, digests, last, said, first, inherited = array("q"), array("q"), None, LoggedAt(), None, 0
                continue
            entry, text = item
            if type(entry) is not dict:
                continue
            at = entry.get("step")
            if wide.count != met and first is None:  # this entry held one (or the file did before its log)
                met = wide.count
                first = next((f"{key!r} of {'the log entry at step ' + str(at) if type(at) is int else 'a log entry'},"
                              f" {len(value.digits.lstrip('-')):,} digits"
                              for key, value in entry.items() if isinstance(value, Unread)), None)
            if not isinstance(at, int) or at > upto:
                continue
            steps.append(at)
            digests.append(hash(text))
            if type(loss := entry.get("loss")) is float or logged_number(loss) is not None:
                last = entry
    except FileNotFoundError:
        return LoggedAt(), None
    except (OSError, ValueError) as exc:
        return LoggedAt(note=f"{path}: cannot be read ({exc}); its training log is ignored"), None
    note, count = None, wide.count + inherited
    if count:
        example = first or (f"{len(wide.first.digits.lstrip('-')):,} digits" if wide.first else None)
        note = (f"{path}: {count:,} integer{'s' if count > 1 else ''} past 64 bits ignored, read as absent"
                + (f" (the first: {example})" if example else ""))
    if last is not None:
        said = LoggedAt(None, logged_number(last["loss"]), logged_number(last.get("grad_norm")))
    logged = LoggedAt(History(steps, digests), said.loss, said.grad_norm, note)
    if known is None or not known.length:  # read up to a step, or its log history given twice or empty
        return logged, None
    return logged, _Text(known.length, known.digest, known.wide + inherited, first, logged)


class _Kept:
    """What each trainer_state.json said (`LoggedAt`), by its path and identity and the step it
    was read up to; the oldest let go past KEPT_ENTRIES entries of their histories; and the text of
    the one read whole last (`_Text`). The composer's scan and statistics read logs in threads."""

    def __init__(self) -> None:
        self.logs: dict[tuple, LoggedAt] = {}
        self.entries = 0
        self.last: _Text | None = None
        self.lock = threading.Lock()

    def get(self, key: tuple) -> LoggedAt | None:
        with self.lock:
            return self.logs.get(key)

    def put(self, key: tuple, logged: LoggedAt, text: _Text | None = None) -> None:
        with self.lock:
            while self.logs and self.entries + len(logged.history or ()) > KEPT_ENTRIES:
                self.entries -= len(self.logs.pop(next(iter(self.logs))).history or ())
            if key not in self.logs:
                self.entries += len(logged.history or ())
                self.logs[key] = logged
            self.last = text or self.last


_KEPT = _Kept()


def logged_at(ckpt: Checkpoint) -> LoggedAt:
    """What `ckpt`'s trainer_state.json says up to its step (nothing for DeepSpeed's layout, a
    partial save without one), read once while the file stays the same (its device, inode, size,
    mtime and ctime) for every reader: the run's lineage, the statistics' and the composer's loss.
    A log is read whole, the entries it begins with skipped where the log read last holds them (a
    run's checkpoints, read in order), and again up to the checkpoint's step only where it logs
    entries past it."""
    folder = Path(ckpt.path)
    try:
        st = os.stat(folder / TRAINER_STATE)
    except OSError:
        return _read(folder, ckpt.step)[0]
    key = (str(folder), *FileIdentity.of(st))
    whole = _KEPT.get((*key, WHOLE))
    if whole is None:
        whole, text = _read(folder, WHOLE, _KEPT.last)
        _KEPT.put((*key, WHOLE), whole, text)
    if whole.history is None or not whole.history.steps or max(whole.history.steps) <= ckpt.step:
        return whole
    found = _KEPT.get((*key, ckpt.step))
    if found is None:
        found = _read(folder, ckpt.step)[0]
        _KEPT.put((*key, ckpt.step), found)
    return found


def model_of(ckpt: Checkpoint) -> frozenset:
    """The parameters a checkpoint holds: (name, shape) of each, trainable or frozen."""
    return frozenset((*(p for group in ckpt.layout.groups for p in group), *ckpt.layout.frozen))


def history(ckpt: Checkpoint) -> History | None:
    """The HF Trainer's log history up to the checkpoint's step (`History`); None where there is
    none to read (DeepSpeed's layout, a partial save without one, an unreadable file)."""
    return logged_at(ckpt).history


def _difference(older: History, newer: History, shared: int) -> tuple[bool, int | None]:
    """Whether `older`'s entries differ from `newer`'s up to step `shared`, in order, by their
    texts, and the step of the first that does (None where one history only ends sooner)."""
    if not newer.steps or max(newer.steps) <= shared:  # all of `newer` counts: compared at once
        if older.steps == newer.steps and older.digests == newer.digests:
            return False, None
        theirs: Iterator[tuple[int, int]] = zip(newer.steps, newer.digests)
        count = len(newer)
    else:
        theirs = ((s, d) for s, d in zip(newer.steps, newer.digests) if s <= shared)
        count = sum(1 for s in newer.steps if s <= shared)
    for mine, other in zip(zip(older.steps, older.digests), theirs):
        if mine != other:
            return True, mine[0]
    return len(older) != count, None


def _values(entry: dict) -> bytes:
    """An entry as its values are compared: marshalled (version 2: no references), keys sorted;
    equal exactly where (key, repr(value)) of every key is, every value being JSON's (an
    `Unread`, which marshal refuses, by its repr)."""
    keys = list(entry)
    if keys != sorted(keys):  # the Trainer sorts them
        entry = {key: entry[key] for key in sorted(keys)}
    try:
        return marshal.dumps(entry, 2)
    except ValueError:  # marshalled, a dict starts with `{`
        return b"\0" + repr(entry).encode(errors="surrogatepass")


class _Restarted(Exception):
    """A log history given twice (the last counts): read whole, not side by side."""


def _up_to(folder: Path, shared: int) -> Iterator[tuple[int, bytes]]:
    """The log entries of `folder` up to step `shared`: (step, `_values`) of each."""
    for entry in log_entries(folder):
        if entry is RESTART:
            raise _Restarted
        if isinstance(entry, dict) and isinstance(at := entry.get("step"), int) and at <= shared:
            yield at, _values(entry)


def _hashed(folder: Path, shared: int) -> History:
    """The log history of `folder` up to step `shared`, each entry's digest its `_values`' hash."""
    steps, digests = array("q"), array("q")
    for entry in log_entries(folder):
        if entry is RESTART:
            steps, digests = array("q"), array("q")
        elif isinstance(entry, dict) and isinstance(at := entry.get("step"), int) and at <= shared:
            steps.append(at)
            digests.append(hash(_values(entry)))
    return History(steps, digests)


def _values_differ(older: Path, newer: Path, shared: int) -> tuple[bool, int | None]:
    """`_difference` by the entries' values: both logs read again side by side, up to the first
    entries that differ (two runs differ at once; one run's logs whose texts differ — written
    otherwise, keys in another order — are read whole)."""
    try:
        for mine, other in zip_longest(_up_to(older, shared), _up_to(newer, shared)):
            if mine != other:
                return True, None if mine is None or other is None else mine[0]
        return False, None
    except _Restarted:
        return _difference(_hashed(older, shared), _hashed(newer, shared), shared)


class Lineage:
    """What tells the runs of a set of checkpoints apart, each read once."""

    def __init__(self) -> None:
        self._models: dict[Path, frozenset] = {}
        self._histories: dict[Path, History | None] = {}
        self._logs_apart: dict[tuple[Path, Path], tuple[bool, int | None]] = {}  # (older, newer): `_difference`

    def model(self, ckpt: Checkpoint) -> frozenset:
        if ckpt.path not in self._models:
            self._models[ckpt.path] = model_of(ckpt)
        return self._models[ckpt.path]

    def history(self, ckpt: Checkpoint) -> History | None:
        if ckpt.path not in self._histories:
            self._histories[ckpt.path] = history(ckpt)
        return self._histories[ckpt.path]

    def apart(self, a: Checkpoint, b: Checkpoint) -> str | None:
        """Why `a` and `b` are of different runs (a phrase), or None when nothing says so."""
        if self.model(a) != self.model(b):
            return "they hold different models (parameter names or shapes)"
        if a.step == b.step and not (a.in_folder or b.in_folder) and not _same_folder(a.path.parent, b.path.parent):
            # DeepSpeed's own layout keeps no history; a run saves a step once, into its save_dir (one resumed
            # into a new save_dir saves later steps there)
            return (f"both saved step {a.step}, to different DeepSpeed save_dirs ({a.path.parent.name}/ and "
                    f"{b.path.parent.name}/)")
        ha, hb = self.history(a), self.history(b)
        if ha is None or hb is None:
            return None
        (older, first), (newer, then) = sorted([(ha, a), (hb, b)], key=lambda pair: pair[1].step)
        pair = (first.path, then.path)
        if pair not in self._logs_apart:
            differ, step = _difference(older, newer, first.step)
            if differ:
                with contextlib.suppress(OSError, ValueError):  # else their texts' verdict
                    differ, step = _values_differ(Path(first.path), Path(then.path), first.step)
            self._logs_apart[pair] = differ, step
        differ, step = self._logs_apart[pair]
        if differ:
            where = f" at step {step}" if step is not None else ""
            return f"their training logs (trainer_state.json) differ{where}"
        return None


def _same_folder(a: Path, b: Path) -> bool:
    try:
        return a == b or os.path.samefile(a, b)
    except OSError:
        return False


def split_runs(checkpoints: tuple[Checkpoint, ...] | list[Checkpoint],
               lineage: Lineage | None = None) -> list[list[Checkpoint]]:
    """The checkpoints (ordered by step) grouped by run, each group in the given order: a
    checkpoint joins the first run it is not told apart from. Holding the same model and
    starting a history are both transitive, so it is compared with the run's newest checkpoint
    and the newest that has a history, not with every one (a run of 100 checkpoints)."""
    lineage = lineage or Lineage()
    runs: list[list[Checkpoint]] = []
    logged: list[Checkpoint | None] = []  # per run: its newest checkpoint with a history
    for ckpt in checkpoints:
        for i, run in enumerate(runs):
            if all(other is None or lineage.apart(ckpt, other) is None for other in (run[-1], logged[i])):
                run.append(ckpt)
                if lineage.history(ckpt) is not None:
                    logged[i] = ckpt
                break
        else:
            runs.append([ckpt])
            logged.append(ckpt if lineage.history(ckpt) is not None else None)
    return runs


def check_one_run(root: Path, checkpoints: tuple[Checkpoint, ...]) -> None:
    """UsageError (one line) when the checkpoints found under `root` are of several training runs:
    a grid, its Δ and healing compare checkpoints of one run only."""
    lineage = Lineage()
    runs = split_runs(checkpoints, lineage)
    if len(runs) < 2:
        return
    labels = dict(zip((c.path for c in checkpoints), distinct_names([c.path for c in checkpoints])))
    named = "; ".join(", ".join(labels[c.path] for c in run) if len(run) <= 3
                      else f"{labels[run[0].path]} … {labels[run[-1].path]} ({len(run)} checkpoints)" for run in runs)
    why = lineage.apart(runs[0][0], runs[1][0]) or "nothing ties them together"
    folders = [os.path.commonpath([str(c.path.parent) for c in run]) for run in runs]
    hint = (f"; open one run's folder, e.g. tailor-tui {folders[0]}" if len(set(folders)) == len(folders)
            else "; move each run's checkpoints into a folder of its own and open one")
    raise UsageError(f"{root}: holds checkpoints of {len(runs)} training runs ({named}): {why}. "
                     f"They are never compared or combined{hint}")


def other_run(base: Checkpoint, other: Checkpoint) -> str | None:
    """Why `other` may come from another training run than `base` (one phrase), or None: its
    lineage says so, or it lies in another run folder (compared by identity) with nothing to
    say it is the same run."""
    if (why := Lineage().apart(base, other)) is not None:
        return f"it is of another training run than the base: {why}"
    return other_folder(base, other)


def other_folder(base, other) -> str | None:
    """Why `other` may come from another training run than `base` by where it lies (a phrase), or None: it lies in
    another run folder (compared by identity). A checkpoint with no lineage to read (a PyTorch Distributed
    Checkpoint) is told by this alone."""
    mine, theirs = base.path.parent, other.path.parent
    if _same_folder(mine, theirs):
        return None
    return f"it lies in another run folder ({theirs}) than the base ({mine})"
