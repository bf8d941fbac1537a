"""How the processes of one job meet: a store only they can write to, on a port nobody predicts.

- torchrun: its own store (`env://`, the port the user gave torchrun).
- Slurm with `MASTER_PORT`: a store process 0 serves on that port.
- Slurm without it: process 0 serves the store on a port the kernel picks and leaves the port
  in the job's meeting folder (`trust.meeting_folder`, this user's alone) for the others.
  (Nodes that share no such folder: set MASTER_PORT and TAILOR_TUI_TEAM_SECRET for every task.)
Either way the values are sealed with the job's secret (`trust`): from `$TAILOR_TUI_TEAM_SECRET`,
else made by process 0 and left in the meeting folder. Process 0 then greets the others with a
sealed value; a process that cannot open it holds a stale secret (read again) or is talking to
someone else's store (refused when the time is up). Process 0 removes the folder when the job ends.
"""

from __future__ import annotations

import datetime
import os
import time
from pathlib import Path

from tailor_tui.errors import ExitCode
from tailor_tui.team.members import CONNECT_TIMEOUT, DEFAULT_TIMEOUT, POLL, STORE_READ, Team, TeamError
from tailor_tui.team.trust import Forged, Seal, env_secret, lay_out, meeting_folder, new_secret, read_meeting

GREETING = "greeting"
TRY_PORT = 10.0  # seconds to reach a port read from the meeting folder before reading it again


def job_name(launch, env) -> str:
    """What names this job among every job on the cluster (its values are bound to it)."""
    if launch.via == "slurm":
        return "/".join(["slurm", launch.job or "?", env.get("SLURM_STEP_ID", "0"),
                         env.get("SLURM_RESTART_COUNT", "0"), launch.host])
    return "/".join(["torchrun", env.get("TORCHELASTIC_RUN_ID", "none"), env.get("TORCHELASTIC_RESTART_COUNT", "0"),
                     f"{launch.host}:{launch.port}"])


def connect(launch, timeout: float = DEFAULT_TIMEOUT, *, meeting: Path, env=None) -> Team:
    """Meet the job's other processes (`launch.Launch`) through a meeting folder in `meeting`, a
    folder every process sees (the output's parent; the user's cache for statistics); a
    TeamError if they do not all arrive, or if what they meet through is not theirs alone."""
    import torch.distributed as dist

    env = os.environ if env is None else env
    job = job_name(launch, env)
    folder = meeting_folder(meeting, job)
    deadline = time.monotonic() + CONNECT_TIMEOUT
    given = env_secret(env)
    lead = launch.rank == 0
    try:
        if launch.port is None:  # Slurm without MASTER_PORT: process 0 picks the port
            if lead:
                store = dist.TCPStore(launch.host, 0, launch.size, True, wait_for_workers=False,
                                      timeout=datetime.timedelta(seconds=CONNECT_TIMEOUT))
                secret = given or new_secret()
                lay_out(folder, None if given else secret, store.port)
            else:
                store, secret = _join(launch, folder, deadline, given)
        elif not lead and not launch.use_env:  # Slurm with MASTER_PORT: process 0's store there, or not
            store = _client(launch, deadline)
            secret = given or read_meeting(folder, deadline, want_secret=True, want_port=False)[0]
        else:
            url = "env://" if launch.use_env else f"tcp://{launch.host}:{launch.port}"
            store, _rank, _size = next(dist.rendezvous(url, launch.rank, launch.size,
                                                       timeout=datetime.timedelta(seconds=CONNECT_TIMEOUT)))
            if lead:
                secret = given or new_secret()
                if given is None:
                    lay_out(folder, secret, None)
            else:
                secret = given or read_meeting(folder, deadline, want_secret=True, want_port=False)[0]
    except (RuntimeError, ValueError, OSError) as exc:
        first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
        where = f"{launch.host}:{launch.port}" if launch.port is not None else f"{launch.host} (port in {folder})"
        raise TeamError(f"process {launch.rank} of {launch.size} could not meet the others at {where} ({first}); "
                        "check that every process was started and that the port is free", ExitCode.USAGE) from None
    team = Team(launch.rank, launch.size, dist.PrefixStore(f"tailor-tui/{job}", store), timeout, Seal(secret, job))
    # process 0 greets as soon as every process has reached its store: a store reached that gives no
    # greeting within the peer timeout is not the job's (someone else's on that port)
    _greet(team, folder if given is None else None, min(deadline, time.monotonic() + timeout), given is not None)
    # from now on, a read waits seconds, not minutes: the job only reads what the store holds (a value
    # someone deleted between the check and the read is then said to be gone, not waited for)
    store.set_timeout(datetime.timedelta(seconds=STORE_READ))
    if lead and (given is None or launch.port is None):
        team.meeting = folder  # removed when the job ends
    return team


def _join(launch, folder, deadline: float, given: bytes | None):
    """Another process, Slurm without MASTER_PORT: the store at the port process 0 left."""
    import torch.distributed as dist

    while True:
        secret, port = read_meeting(folder, deadline, want_secret=given is None, want_port=True)
        try:
            store = dist.TCPStore(launch.host, port, launch.size, False,
                                  timeout=datetime.timedelta(seconds=TRY_PORT))
            return store, given or secret
        except (RuntimeError, ValueError, OSError):
            if time.monotonic() > deadline:
                raise
            time.sleep(POLL)  # a crashed job's port, left in a stale folder: read it again


def _client(launch, deadline: float):
    """Another process, Slurm with MASTER_PORT: a client of the store process 0 serves there. Nobody
    listening yet (process 0 still starting) is tried again until `deadline`; something else
    answering there — a program that is not a store, or one that never answers (torch's client
    would wait on it without end) — is refused at once: another program or user holds the port."""
    import threading

    import torch.distributed as dist

    where = f"{launch.host}:{launch.port}"
    while True:
        outcome: dict = {}

        def attempt(outcome: dict = outcome) -> None:
            try:
                outcome["store"] = dist.TCPStore(launch.host, launch.port, launch.size, False,
                                                 timeout=datetime.timedelta(seconds=TRY_PORT))
            except Exception as exc:  # noqa: BLE001 - told apart below
                outcome["error"] = exc

        trying = threading.Thread(target=attempt, name="team-connect", daemon=True)  # (left behind if stuck)
        trying.start()
        trying.join(TRY_PORT + 5)
        if "store" in outcome:
            store = outcome["store"]
            store.set_timeout(datetime.timedelta(seconds=CONNECT_TIMEOUT))  # (TRY_PORT was to reach it)
            return store
        error = outcome.get("error")
        nobody = error is not None and "timed out" in str(error) and "trying to connect" in str(error)
        if not nobody:
            why = "it never answered as a store does" if error is None else str(error).strip().splitlines()[0][:120]
            raise TeamError(f"process {launch.rank} of {launch.size}: what listens at {where} is not this job's "
                            f"store ({why}): another program, or another user, holds the port; start the job "
                            "again with a free MASTER_PORT (or none: process 0 then picks one)", ExitCode.USAGE)
        if time.monotonic() > deadline:
            raise TeamError(f"process {launch.rank} of {launch.size} could not meet the others at {where}: nothing "
                            "listens there; check that every process was started", ExitCode.USAGE)
        time.sleep(POLL)


def _greet(team: Team, folder, deadline: float, given: bool = False) -> None:
    """Process 0 greets the others with a sealed value; each opens it with its secret. A secret
    read from a stale folder is read again; one that still fails when the time is up, or at once
    where the secret was `given` (nothing to read again), means the store is someone else's (or the
    tasks were given different secrets)."""
    store, key, seal = team.store, f"share/{GREETING}", team.seal
    assert seal is not None, "connect made the team with its seal"
    if team.lead:
        store.set(key, seal.seal(key, "hello"))
        return
    while True:
        if store.check([key]):
            try:
                seal.open(key, store.get(key))
                return
            except Forged:
                if given or time.monotonic() > deadline:
                    raise TeamError(f"process {team.rank} of {team.size}: the job's store holds a greeting not "
                                    "sealed with this job's secret (another program's store on that port, or "
                                    "tasks given different TAILOR_TUI_TEAM_SECRET values)", ExitCode.USAGE) from None
                if folder is not None:
                    seal.secret = read_meeting(folder, deadline, want_secret=True, want_port=False)[0]
        elif time.monotonic() > deadline:
            raise TeamError(f"process {team.rank} of {team.size}: process 0 never greeted the others in the job's "
                            "store; check that every task was started", ExitCode.USAGE)
        time.sleep(POLL)
