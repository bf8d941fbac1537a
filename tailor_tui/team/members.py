"""The processes of one `--apply` job, started by torchrun or srun (`launch`), working as one.

They meet (`meet.connect`) in a torch.distributed TCPStore (torchrun's own store under torchrun;
one that process 0 serves under Slurm): no GPU, no NCCL, no cluster manager of our own. Every
value set in it is sealed with the job's secret and opened when read (`trust`): one written by
anyone else stops every process. Through it they
- agree on the plan (each posts a digest; any difference is refused);
- learn the hidden output folder process 0 made, and post what each wrote;
- notice failure: every process posts a beat once a second; one whose beat stops for
  `timeout` seconds (killed, its node lost, hung) fails the job, as does any process that posts
  an error, and losing the store (process 0 gone) fails it at once. Every process then stops
  its work and exits non-zero with one line naming the process that failed and why.

`SOLO` is the one-process team: every call is immediate. Importing this module does not
import torch; `meet.connect` does.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from tailor_tui.errors import ExitCode, TailorError
from tailor_tui.team.trust import Forged, Seal

DEFAULT_TIMEOUT = 60.0  # seconds without a beat before a process counts as gone
CONNECT_TIMEOUT = 300.0  # seconds for every process to reach the store
STORE_READ = 10.0  # seconds a read of a value the store holds may take, once every process is there
BEAT = 1.0
POLL = 0.1


class TeamError(TailorError):
    """Another process of the job failed (its exit code is the job's)."""

    def __init__(self, message: str, code: int = ExitCode.INTERNAL):
        super().__init__(message)
        self.exit_code = code


@dataclass(frozen=True)
class Failure:
    process: int  # OUTSIDER: a value in the store was not written by any process of the job
    message: str
    code: int
    gone: bool = False  # the process itself is gone (no beat): nobody waits for it


OUTSIDER = -1


class Team:
    def __init__(self, rank: int = 0, size: int = 1, store=None, timeout: float = DEFAULT_TIMEOUT,
                 seal: Seal | None = None):
        self.rank, self.size, self.store, self.timeout = rank, size, store, timeout
        self.seal = seal  # every value set in the store is sealed with it, and opened when read
        self.meeting: Path | None = None  # process 0: the job's meeting folder (`meet`), removed at the end
        self.lead = rank == 0
        self.failure: Failure | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._progressed: float | None = None  # when this process's work last moved (None: not watched)
        self._posted: list[str] = []  # the values this process shared or gathered, told in its beats
        self._told: dict[int, frozenset[str]] = {}  # what each peer's latest beat says it has posted

    # --- dividing the work --------------------------------------------------------------------

    def mine(self, sizes: list[int]) -> list[int]:
        """The indexes of the items (of these byte sizes) this process does: the largest first,
        each to the process with the fewest bytes so far (ties to the lowest rank)."""
        loads = [0] * self.size
        owner = {}
        for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
            p = min(range(self.size), key=lambda p: (loads[p], p))
            owner[i] = p
            loads[p] += sizes[i]
        return [i for i in range(len(sizes)) if owner[i] == self.rank]

    # --- talking ------------------------------------------------------------------------------

    def agree(self, what: str, digest: Callable[[], str]) -> None:
        """Every process holds the same `digest()` of `what`, or the job fails (a process alone
        does not work it out: a wide run's digest stats every rank file)."""
        if self.store is None:
            return
        mine = digest()
        theirs = self.gather(f"agree/{what}", mine)
        differ = [p for p, d in enumerate(theirs) if d != mine]
        if differ:
            raise self._fail(f"processes {self.rank} and {differ[0]} see different {what}s (different files, "
                             "recipes or tailor-tui versions on different nodes?); every process must see the same",
                             ExitCode.USAGE)

    def share(self, key: str, value: str | None = None) -> str:
        """Process 0's `value` for `key`, on every process."""
        if self.store is None or self.lead:
            assert value is not None, "process 0 gives the value (a team without a store is process 0 alone)"
            if self.store is not None:
                self._set(f"share/{key}", value)
            return value
        self._await([f"share/{key}"])
        return self._get(f"share/{key}")

    def gather(self, stage: str, value) -> list:
        """Every process's `value` (JSON) at `stage`, in process order, once all have posted."""
        if self.store is None:
            return [value]
        self._set(f"gather/{stage}/{self.rank}", json.dumps(value))
        keys = [f"gather/{stage}/{p}" for p in range(self.size)]
        self._await(keys)
        return [json.loads(self._get(k)) for k in keys]

    def post(self, key: str, value) -> None:
        """Publish `value` (JSON) under this process's `key`, replacing what was there."""
        if self.store is not None:
            self._set(f"post/{key}/{self.rank}", json.dumps(value))

    def peek(self, key: str, process: int):
        """What `process` last posted under `key`, or None (never waits)."""
        if self.store is None or not self._call(self.store.check, [f"post/{key}/{process}"]):
            return None
        return json.loads(self._get(f"post/{key}/{process}"))

    def fail(self, exc: BaseException) -> None:
        """Tell the others this process failed (the first failure posted is the job's)."""
        if self.store is None or (self.failure is not None and self.failure.process != self.rank):
            return
        code = int(getattr(exc, "exit_code", ExitCode.INTERNAL))
        record = json.dumps({"process": self.rank, "message": str(exc) or type(exc).__name__, "code": code})
        try:
            self.store.compare_set("abort", "", self._sealing().seal("abort", record))
        except Exception:  # noqa: BLE001 - the store is gone: the others notice that themselves
            pass

    # --- watching -----------------------------------------------------------------------------

    @contextlib.contextmanager
    def working(self, cancel: threading.Event):
        """The span of the job's work: this process beats (and `cancel` is set when another
        fails or is gone); a failure here is posted for the others, and one elsewhere is what
        this process raises; at the end process 0 waits for the others to read the outcome."""
        self.watch(cancel)
        succeeded = False
        try:
            yield self
            succeeded = True
        except BaseException as exc:
            self.fail(exc)
            if self.failure is not None and not isinstance(exc, TeamError):
                raise self.error() from None  # another process failed first: that is why this one stopped
            raise
        finally:
            self.close(succeeded)

    def watch(self, cancel: threading.Event) -> None:
        """Beat, and set `cancel` as soon as another process fails or is gone."""
        if self.store is None:
            return
        self._thread = threading.Thread(target=self._beat, args=(cancel,), name="team-beat", daemon=True)
        self._thread.start()

    def progressing(self, moving: bool = True) -> None:
        """This process's work moved (its tasks report progress); `moving=False`: it no longer has
        tasks to watch. While watched, `timeout` seconds without a move count as a hang (a worker
        stuck on a file system): this process then fails the job, as a silent one would."""
        if self.store is not None:  # SOLO, shared by every one-process composition, stays as it is
            self._progressed = time.monotonic() if moving else None

    def close(self, succeeded: bool) -> None:
        """Stop beating. Process 0, whose going ends the store, first waits (bounded) until the
        others have read how the job ended: its success, or the failure that stopped it."""
        if self.store is None:
            return
        try:
            if self.lead:
                deadline = time.monotonic() + (self.timeout if succeeded else min(self.timeout, 10.0))
                gone = self.failure.process if self.failure is not None and self.failure.gone else None
                keys = [f"left/{p}" for p in range(1, self.size) if p != gone]
                while not self._call(self.store.check, keys) and time.monotonic() < deadline:
                    time.sleep(POLL)
            else:
                self._set(f"left/{self.rank}", "1")
        except TeamError:
            pass
        self._stop.set()
        if self.meeting is not None:
            shutil.rmtree(self.meeting, ignore_errors=True)

    def _beat(self, cancel: threading.Event) -> None:
        started = time.monotonic()
        peers = [p for p in range(self.size) if p != self.rank]
        keys = [f"beat/{p}" for p in peers]
        seen = {p: ("", started) for p in peers}  # a process that never beats counts too
        counts = {p: 0 for p in peers}  # each one's count of beats so far: it only ever grows
        beats = 0
        while not self._stop.wait(BEAT):
            try:
                if beats and not self.store.check([f"beat/{self.rank}"]):  # its own last one, deleted
                    self._gone("beat", self.rank)
                beats += 1
                self._set(f"beat/{self.rank}", json.dumps([beats, self._posted]))
                self._check_abort()
                now = time.monotonic()
                for p, value in zip(peers, self._beats(keys)):
                    count, self._told[p] = _read_beat(value)
                    counts[p] = self._check_beat(p, value, count, counts[p])
                    if seen[p][0] != value:
                        seen[p] = (value, now)
                    elif now - seen[p][1] > self.timeout:
                        self.failure = Failure(p, f"it stopped responding for {self.timeout:.0f} s (killed, hung, "
                                                  "or its node was lost)", ExitCode.INTERNAL, gone=True)
                moved = self._progressed
                if self.failure is None and moved is not None and now - moved > self.timeout:
                    self.failure = Failure(self.rank, f"its work made no progress for {self.timeout:.0f} s (hung: a "
                                                      "stuck file system or disk?)", ExitCode.INTERNAL)
                    self.fail(TeamError(self.failure.message))
            except Forged as exc:
                self._forged(exc)
            except TeamError:
                pass
            except Exception:  # noqa: BLE001 - the store (process 0's, or torchrun's) is gone
                self.failure = Failure(0, "lost contact with it (killed, or its node was lost)", ExitCode.INTERNAL)
            if self.failure is not None:
                cancel.set()
                return

    def _beats(self, keys: list[str]) -> list[str]:
        """The peers' latest beats ("" for one that has not beaten yet, or whose beat is gone): one
        request once all have."""
        if self.store.check(keys):
            try:
                return [self._sealing().open(k, v) for k, v in zip(keys, self.store.multi_get(keys))]
            except Forged:
                raise
            except Exception:  # noqa: BLE001 - one deleted since the check (or the store gone: the next says)
                pass
        return [self._get_if_there(k) or "" for k in keys]

    def _check_beat(self, process: int, beat: str, count: int, before: int) -> int:
        """A peer's beat as read now (`count`: the count it holds), after `before` beats seen: the count
        seen so far. A beat that went back (an old one written again) or that is gone once seen was not
        the peer's doing: every process stops."""
        if before and not beat:
            self._gone("beat", process)
        if count < before:
            self._outsider(f"the beat of process {process} went back from {before} to {count} (an old one written "
                           "again by someone outside the job; its port is open to every user of the node)")
        return max(count, before)

    def lead_lost(self) -> bool:
        """Whether process 0 is gone (its store lost): then nobody else cleans up its folder."""
        return self.failure is not None and self.failure.process == 0 and self.failure.message.startswith("lost")

    def _check_abort(self) -> None:
        if self.failure is None and self.store.check(["abort"]):
            record = json.loads(self._sealing().open("abort", self.store.get("abort")))
            if record["process"] != self.rank:
                self.failure = Failure(record["process"], record["message"], record["code"])

    def _await(self, keys: list[str]) -> None:
        """Until every one of `keys` is in the store. One that its process has posted (its beat says
        so, sealed) and that is not there was deleted by someone outside the job: every process stops
        (within a beat), instead of waiting for a value that will never come again."""
        while True:
            if self.failure is not None:
                raise self.error()
            if self._call(self.store.check, keys):
                return
            for key in keys:
                owner = self.rank if key in self._posted else _poster(key)
                if (key in self._posted or key in self._told.get(owner, ())) and not self._call(self.store.check, [key]):
                    self._gone(key, owner)
            self._call(self._check_abort)
            time.sleep(POLL)

    def _gone(self, key: str, owner: int) -> None:
        """The value of `key` (or the beat), which process `owner` posted, is no longer in the store: stop
        every process."""
        what = f"the beat of process {owner}" if key == "beat" else f"the value of '{key}' that process {owner} posted"
        self._outsider(f"{what} is gone from the job's store (someone outside the job deleted it; its port is open "
                       "to every user of the node)")

    def _outsider(self, message: str) -> None:
        """Someone outside the job changed its store (`message`: how): tell the others, and stop."""
        if self.failure is None:
            self.fail(TeamError(message, ExitCode.USAGE))
            self.failure = Failure(OUTSIDER, message, ExitCode.USAGE)
        raise self.error()

    def _forged(self, exc: Forged) -> None:
        """Someone outside the job wrote into its store: tell the others, and stop."""
        if self.failure is None:
            self.fail(exc)
            self.failure = Failure(OUTSIDER, str(exc), exc.exit_code)

    def _set(self, key: str, value: str) -> None:
        self._call(self.store.set, key, self._sealing().seal(key, value))
        if key.startswith(("share/", "gather/")) and key not in self._posted:
            self._posted = [*self._posted, key]  # (a new list: the beat thread reads it)

    def _get(self, key: str) -> str:
        """The value of `key`, which the store held a moment ago (`check`)."""
        value = self._get_if_there(key)
        if value is None:
            self._gone(key, self.rank if key in self._posted else _poster(key))
        assert value is not None
        return value

    def _get_if_there(self, key: str) -> str | None:
        """The value of `key`, or None if it is not there: not yet, or deleted since a `check` saw it
        (a read of a key that is not there waits for the store's timeout, a few seconds, then fails)."""
        try:
            return self._sealing().open(key, self.store.get(key)) if self._call(self.store.check, [key]) else None
        except Forged as exc:
            self._forged(exc)
            raise self.error() from None
        except TeamError:
            raise
        except Exception:  # noqa: BLE001 - deleted since the check, or the store is gone: which, asked once more
            if self._call(self.store.check, [key]):
                self.failure = self.failure or Failure(0, "lost contact with it (killed, or its node was lost)",
                                                       ExitCode.INTERNAL)
                raise self.error() from None
            return None

    def _sealing(self) -> Seal:
        """`seal`: a team with a store has one (`meet.connect` makes both)."""
        assert self.seal is not None, "a team with a store has a seal"
        return self.seal

    def _call(self, fn, *args):
        try:
            return fn(*args)
        except Forged as exc:  # a value someone outside the job wrote: every process stops
            self._forged(exc)
            raise self.error() from None
        except Exception:  # noqa: BLE001 - the store is gone with process 0 (or torchrun's agent)
            self.failure = self.failure or Failure(0, "lost contact with it (killed, or its node was lost)",
                                                   ExitCode.INTERNAL)
            raise self.error() from None

    def _fail(self, message: str, code: int) -> TeamError:
        error = TeamError(message, code)
        self.fail(error)
        return error

    def error(self) -> TeamError:
        """The job's failure, as this process reports it."""
        f = self.failure
        assert f is not None, "asked once a failure is known"
        if f.process == OUTSIDER:
            return TeamError(f"the job was stopped: {f.message}", f.code)
        return TeamError(f"process {f.process} of {self.size} failed: {f.message}", f.code)


def _poster(key: str) -> int:
    """The process that posts `key`: process 0 a shared value, the last part of a gathered one's name."""
    last = key.rsplit("/", 1)[-1]
    return int(last) if key.startswith("gather/") and last.isdigit() else 0


def _read_beat(beat: str) -> tuple[int, frozenset[str]]:
    """(its count of beats, the keys it says it has posted) of a peer's beat (sealed: written by the
    job); (0, none) for no beat, or one of another form (a tailor-tui of another version, which the
    plan's agreement refuses anyway)."""
    try:
        count, posted = json.loads(beat)
        return (count if isinstance(count, int) else 0), frozenset(k for k in posted if isinstance(k, str))
    except (ValueError, TypeError):
        return 0, frozenset()


SOLO = Team()
