"""`--apply` as one job over several processes, launched by torchrun or by srun.

The real entry point runs under `torchrun --nproc-per-node 2` and as two Slurm tasks (the
environment srun sets, on this one machine): the output is byte-identical, provenance aside,
to a one-process `--apply`. A task killed with SIGKILL mid-composition fails the other within the
peer timeout, leaves nothing at the output, and a re-run succeeds.
"""

from __future__ import annotations

import filecmp
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import checkpoints_of
from faults import inject
from helpers import TAILOR, free_port, hidden, slurm_tasks, tailor, write_recipe

from tailor_tui.checkpoints import file_facts
from tailor_tui.checkpoints.checkpoint import PROVENANCE
from tailor_tui.errors import UsageError
from tailor_tui.team.launch import Launch, detect, expand_hostlist
from tailor_tui.team.members import Team

TORCHRUN = str(Path(sys.executable).with_name("torchrun"))


def test_slurm_hostlists_expand():
    assert expand_hostlist("node[01-04,07]") == ["node01", "node02", "node03", "node04", "node07"]
    assert expand_hostlist("gpu5,a[8-10],b") == ["gpu5", "a8", "a9", "a10", "b"]
    assert expand_hostlist("rack[1-2]-n[1-2]") == ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]
    assert expand_hostlist("x[009-011]") == ["x009", "x010", "x011"]
    assert expand_hostlist("login1") == ["login1"]
    for bad in ("node[1-", "node[a-b]", "", "n]1["):
        with pytest.raises(UsageError):
            expand_hostlist(bad)


def test_the_launcher_is_told_by_its_environment():
    assert detect({}) is None
    torchrun = {"RANK": "1", "WORLD_SIZE": "4", "MASTER_ADDR": "n1", "MASTER_PORT": "29400", "LOCAL_RANK": "1"}
    assert detect(torchrun) == Launch(1, 4, "n1", 29400, "torchrun", use_env=True)
    assert detect(torchrun, "off") is None
    slurm = {"SLURM_PROCID": "3", "SLURM_NTASKS": "8", "SLURM_JOB_ID": "12345", "SLURM_STEP_ID": "0",
             "SLURM_STEP_NODELIST": "node[07-08]"}
    found = detect(slurm)
    assert (found.rank, found.size, found.host, found.via) == (3, 8, "node07", "slurm")
    assert found.port is None  # no formula an outsider could predict: process 0 picks one (team.meet)
    assert detect({**slurm, "MASTER_ADDR": "head", "MASTER_PORT": "4000"}).port == 4000
    assert detect({**slurm, "SLURM_NTASKS": "1", "SLURM_PROCID": "0"}) is None  # one task: one process
    for bad in ({**slurm, "SLURM_PROCID": "8"}, {**slurm, "SLURM_NTASKS": "x"}, {"RANK": "0", "WORLD_SIZE": "2"}):
        with pytest.raises(UsageError):
            detect(bad)


def test_work_is_divided_by_bytes():
    sizes = [10, 10, 10, 10, 40, 1]
    shares = [Team(p, 2).mine(sizes) for p in range(2)]
    assert sorted(shares[0] + shares[1]) == list(range(6))
    assert [sum(sizes[i] for i in share) for share in shares] == [41, 40]


def _assert_same_output(mine: Path, theirs: Path) -> None:
    files = sorted(p.relative_to(mine) for p in mine.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(theirs) for p in theirs.rglob("*") if p.is_file())
    assert files, "nothing composed"
    for rel in files:
        if rel.name != PROVENANCE:
            assert filecmp.cmp(mine / rel, theirs / rel, shallow=False), rel


def test_torchrun_two_processes_compose_what_one_does(real_run, tmp_path):
    run, spec = real_run("hf_bf16_2")
    c2, c4, c6 = checkpoints_of(run, spec)
    recipe = write_recipe(tmp_path, c6, {"layers.1": c4, "embed_tokens": c2})
    assert tailor("--apply", recipe, "-o", tmp_path / "solo").returncode == 0
    done = subprocess.run([TORCHRUN, "--nproc-per-node", "2", "--master-port", str(free_port()), "--no-python",
                           TAILOR, "--apply", str(recipe)], capture_output=True, text=True, timeout=300,
                          stdin=subprocess.DEVNULL, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert done.returncode == 0, done.stderr
    assert "2 processes (torchrun)" in done.stderr and "[process 1] rank 1: done" in done.stderr
    assert "\nrank 1: done" in done.stderr  # process 0's log follows process 1's rank too
    assert done.stdout.count("done: ") == 1  # process 0 alone reports the job
    _assert_same_output(tmp_path / "composed", tmp_path / "solo")


def test_two_slurm_tasks_reshard_what_one_process_does(real_run, tmp_path):
    run, spec = real_run("ds_bf16_3_subgroups")
    c2, _c4, c6 = checkpoints_of(run, spec)
    recipe = write_recipe(tmp_path, c6, {"layers.2": c2})
    assert tailor("--apply", recipe, "-o", tmp_path / "solo", "--world-size", "2").returncode == 0
    tasks = slurm_tasks(["--apply", recipe, "--world-size", "2"])
    outs = [t.communicate(timeout=300) for t in tasks]
    assert [t.returncode for t in tasks] == [0, 0], outs
    assert "done: " in outs[0][0] and not outs[1][0]
    _assert_same_output(tmp_path / "composed", tmp_path / "solo")


def test_a_task_killed_mid_composition_fails_the_job_and_leaves_nothing(real_run, tmp_path):
    run, spec = real_run("ds_bf16_3_subgroups")
    c2, _c4, c6 = checkpoints_of(run, spec)
    recipe = write_recipe(tmp_path, c6, {"layers.2": c2})
    tasks = slurm_tasks(["--apply", recipe, "--peer-timeout", "4"], env=inject.environment(slow=0.2))
    while "[process 1] rank" not in (line := tasks[1].stderr.readline()):
        assert line, "process 1 ended before it composed"
    tasks[1].send_signal(signal.SIGKILL)
    killed = time.monotonic()
    _out, err = tasks[0].communicate(timeout=60)
    assert time.monotonic() - killed < 4 + 6  # the peer timeout, one beat, and the workers' cancel
    assert tasks[0].returncode != 0
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert errors == ["error: process 1 of 2 failed: it stopped responding for 4 s (killed, hung, or its node "
                      "was lost)"], err
    assert not (tmp_path / "composed").exists() and not hidden(tmp_path)
    again = slurm_tasks(["--apply", recipe], job="778")
    assert [t.wait(timeout=300) for t in again] == [0, 0]
    assert (tmp_path / "composed" / PROVENANCE).is_file()


def test_processes_that_see_different_plans_refuse(real_run, tmp_path):
    run, spec = real_run("hf_bf16_2")
    c2, c4, c6 = checkpoints_of(run, spec)
    one = write_recipe(tmp_path, c6, {"layers.1": c4})
    other = tmp_path / "other.yaml"
    other.write_text(one.read_text().replace(os.path.relpath(c4, tmp_path), os.path.relpath(c2, tmp_path)))
    port = str(free_port())
    tasks = [subprocess.Popen([TAILOR, "--apply", str(r)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "SLURM_PROCID": str(p), "SLURM_NTASKS": "2", "SLURM_JOB_ID": "9",
                                   "SLURM_STEP_NODELIST": "localhost", "MASTER_PORT": port})
             for p, r in enumerate((one, other))]
    outs = [t.communicate(timeout=120) for t in tasks]
    assert [t.returncode for t in tasks] == [2, 2], outs
    assert all("see different plans" in err for _out, err in outs)
    assert not (tmp_path / "composed").exists()


def test_two_slurm_tasks_compute_the_statistics_one_process_does(real_run, tmp_path):
    """`--stats` as a job: each task reads its share of the rank files (each with its own empty
    cache here, as on nodes without a shared home: the team's secret then comes from the
    environment, as a batch script exports it), process 0 adds them up and prints them."""
    run, _spec = real_run("ds_frozen_blown_up")
    solo = subprocess.run([TAILOR, "--stats", str(run), "--json"], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "TAILOR_TUI_CACHE": str(tmp_path / "solo-cache")})
    assert solo.returncode == 0, solo.stderr
    port = str(free_port())
    tasks = [subprocess.Popen([TAILOR, "--stats", str(run), "--json"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL,
                              env={**os.environ, "SLURM_PROCID": str(p), "SLURM_NTASKS": "2", "SLURM_JOB_ID": "5",
                                   "SLURM_STEP_NODELIST": "localhost", "MASTER_PORT": port,
                                   "TAILOR_TUI_TEAM_SECRET": "a secret only this user's tasks hold",
                                   "TAILOR_TUI_CACHE": str(tmp_path / f"cache-{p}")})
             for p in range(2)]
    outs = [t.communicate(timeout=300) for t in tasks]
    assert [t.returncode for t in tasks] == [0, 0], outs
    assert outs[0][0] == solo.stdout and not outs[1][0]
    assert list((tmp_path / "cache-1").rglob("*.json")), "process 1 read no rank"
    # the facts of every rank file (block CRC-32s, rows found finite), those process 1 read too, cached by
    # process 0 as one process does
    optim = sorted(run.rglob("*optim_states.pt"))
    alone = file_facts.cached(tmp_path / "solo-cache", paths=optim)
    assert alone.keys() == set(optim) and file_facts.cached(tmp_path / "cache-0", paths=optim) == alone


def test_a_task_whose_work_hangs_fails_the_job(real_run, tmp_path):
    """A task alive (its heartbeat goes on) but whose worker makes no progress, as on a stuck file
    system, fails the job after the peer timeout: every process exits non-zero naming it."""
    run, spec = real_run("ds_bf16_3_subgroups")
    c2, _c4, c6 = checkpoints_of(run, spec)
    recipe = write_recipe(tmp_path, c6, {"layers.2": c2})
    # the statistics --apply reads first (the session's cache, cold where no test before made them): made here,
    # unslowed, so that what the slowed task hangs in is the composition, as the job sees it
    assert tailor("--stats", run).returncode == 0
    port = str(free_port())
    tasks = [subprocess.Popen([TAILOR, "--apply", str(recipe), "--peer-timeout", "3"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL,
                              env={**os.environ, "PYTHONWARNINGS": "ignore", "SLURM_PROCID": str(p),
                                   "SLURM_NTASKS": "2", "SLURM_JOB_ID": "11", "SLURM_STEP_NODELIST": "localhost",
                                   "MASTER_PORT": port, **inject.environment(slow=8 if p == 1 else 0.1)})
             for p in range(2)]
    # the proof is what each says, not how soon (no bound on a loaded machine's time): only the peer timeout's
    # watch of progress fails a job with that line, where the stalled worker alone would have finished it
    lead = tasks[0].communicate(timeout=300)
    other = tasks[1].communicate(timeout=300)
    assert [t.returncode for t in tasks] == [1, 1]
    expected = "error: process 1 of 2 failed: its work made no progress for 3 s (hung: a stuck file system or disk?)"
    for _out, err in (lead, other):
        assert [line for line in err.splitlines() if line.startswith("error: ")] == [expected], err
    assert not (tmp_path / "composed").exists() and not hidden(tmp_path)


def test_process_0_stuck_while_publishing_fails_the_job_within_the_peer_timeout():
    """The others wait for process 0 as it prepares and publishes; a file system that stops answering
    there (its publishing sleeps here, as a stuck one would hold it) fails the job after the peer
    timeout, as a stuck worker does, where every other process used to wait without end. Two processes'
    teams over a real TCPStore, each in a thread of this one."""
    import datetime
    import threading

    import torch.distributed as dist

    from tailor_tui.team.members import Team, TeamError
    from tailor_tui.team.transaction import Declaration, TeamWork, run_as_team
    from tailor_tui.team.trust import Seal

    class Stuck(TeamWork):
        def begin(self):
            return Declaration()

        def tasks(self, shared, emit):
            return []

        def publish(self):
            time.sleep(8)

    server = dist.TCPStore("127.0.0.1", 0, 2, True, wait_for_workers=False, timeout=datetime.timedelta(seconds=30))
    client = dist.TCPStore("127.0.0.1", server.port, 2, False, timeout=datetime.timedelta(seconds=30))
    seal = Seal(b"s" * 32, "stuck")
    teams = [Team(rank, 2, dist.PrefixStore("stuck", store), 1.5, seal) for rank, store in enumerate((server, client))]
    ended: dict = {}

    def other() -> None:
        started = time.monotonic()
        try:
            run_as_team(Stuck(), team=teams[1])
            ended["outcome"] = "published"
        except TeamError as exc:
            ended["outcome"] = str(exc)
        ended["after"] = time.monotonic() - started

    thread = threading.Thread(target=other)
    thread.start()
    with pytest.raises(TeamError):
        run_as_team(Stuck(), team=teams[0])
    thread.join(30)
    assert ended["outcome"] == ("process 0 of 2 failed: its work made no progress for 2 s (hung: a stuck file "
                                "system or disk?)"), ended
    assert ended["after"] < 8, ended  # before process 0's publishing would have ended


def test_slurm_tasks_without_a_port_meet_on_one_process_0_picked(real_run, tmp_path):
    """No MASTER_PORT: process 0 serves the store on a port the kernel picks and leaves it, with
    the job's secret, in a meeting folder only this user can enter; it is gone when the job ends."""
    run, spec = real_run("hf_bf16_2")
    c2, c4, c6 = checkpoints_of(run, spec)
    recipe = write_recipe(tmp_path, c6, {"layers.1": c4, "embed_tokens": c2})
    assert tailor("--apply", recipe, "-o", tmp_path / "solo").returncode == 0
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "MASTER_ADDR")}
    tasks = [subprocess.Popen([TAILOR, "--apply", str(recipe)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, stdin=subprocess.DEVNULL,
                              env={**env, "PYTHONWARNINGS": "ignore", "SLURM_PROCID": str(p), "SLURM_NTASKS": "2",
                                   "SLURM_JOB_ID": "31337", "SLURM_STEP_ID": "0", "SLURM_STEP_NODELIST": "localhost"})
             for p in range(2)]
    outs = [t.communicate(timeout=300) for t in tasks]
    assert [t.returncode for t in tasks] == [0, 0], outs
    _assert_same_output(tmp_path / "composed", tmp_path / "solo")
    assert not hidden(tmp_path), hidden(tmp_path)  # the meeting folder went with the job


def test_a_stranger_who_writes_into_the_jobs_store_stops_it_and_steers_nothing(real_run, tmp_path):
    """An attacker on the node connects to the job's port (a TCPStore client without the
    secret) and keeps writing: a progress record for process 1, and the shared folder pointing at
    a folder of theirs. Every process stops with one line; nothing is published or written there."""
    import torch.distributed as dist

    run, spec = real_run("ds_bf16_3_subgroups")
    c2, _c4, c6 = checkpoints_of(run, spec)
    recipe = write_recipe(tmp_path, c6, {"layers.2": c2})
    trap = tmp_path / "attackers"
    trap.mkdir()
    port = free_port()
    tasks = slurm_tasks(["--apply", recipe], env={**inject.environment(slow=0.2), "MASTER_PORT": str(port)},
                         job="4242")
    while "[process 1] rank" not in (line := tasks[1].stderr.readline()):
        assert line, "process 1 ended before it composed"
    stranger = dist.TCPStore("localhost", port, 2, False, timeout=__import__("datetime").timedelta(seconds=10))
    prefix = "tailor-tui/slurm/4242/0/0/localhost/"  # the job, as the ids squeue shows name it
    deadline = time.monotonic() + 60
    while any(t.poll() is None for t in tasks) and time.monotonic() < deadline:
        try:
            stranger.set(prefix + "post/progress/1", json.dumps({"rank 0": [1, 1, True]}))
            stranger.set(prefix + "share/prepared", str(trap))
        except Exception:  # noqa: BLE001 - the store went with process 0
            break
        time.sleep(0.05)
    outs = [(t.stdout.read(), t.stderr.read()) for t in tasks]
    assert [t.wait(timeout=60) for t in tasks] != [0, 0]
    assert tasks[0].returncode != 0, outs
    errors = [line for line in outs[0][1].splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "fails its authentication" in errors[0], outs[0][1]
    assert "Traceback" not in outs[0][1] + outs[1][1]
    assert not (tmp_path / "composed").exists() and not list(trap.iterdir())
    assert not hidden(tmp_path), hidden(tmp_path)


def _attacked(real_run, tmp_path, job: str, peer_timeout: str, slow: float, attack, said: str) -> None:
    """A real 2-task Slurm job (hf_bf16_2, MASTER_PORT given) that a stranger on the node attacks through
    its port while it runs: `attack(store, prefix)` again and again (a TCPStore client without the secret;
    prefix: the job's keys' as the ids squeue shows name them). Every process stops within seconds, each
    with one line saying `said`; nothing is published."""
    import datetime

    import torch.distributed as dist

    run, spec = real_run("hf_bf16_2")
    c2, _c4, c6 = checkpoints_of(run, spec)
    recipe = write_recipe(tmp_path, c6, {"layers.1": c2})
    port = free_port()
    began = time.monotonic()
    tasks = slurm_tasks(["--apply", recipe, "--peer-timeout", peer_timeout], job=job,
                         env={"MASTER_PORT": str(port), **inject.environment(slow=slow)})
    stranger = None
    while any(t.poll() is None for t in tasks) and time.monotonic() < began + 60:
        try:
            stranger = stranger or dist.TCPStore("localhost", port, 2, False, timeout=datetime.timedelta(seconds=5))
            attack(stranger, f"tailor-tui/slurm/{job}/0/0/localhost/")
        except Exception:  # noqa: BLE001 - not served yet, or gone with process 0
            stranger = None
        time.sleep(0.02)
    try:
        outs = [t.communicate(timeout=60) for t in tasks]
    finally:
        for t in tasks:  # (a job that hangs, as it did, is not left behind)
            t.kill()
    assert time.monotonic() - began < 45, outs  # not the peer timeout's many multiples, nor forever
    assert all(t.returncode != 0 for t in tasks), outs
    for _out, err in outs:
        errors = [line for line in err.splitlines() if line.startswith("error: ")]
        assert len(errors) == 1 and said in errors[0], err
        assert "Traceback" not in err
    assert not (tmp_path / "composed").exists() and not hidden(tmp_path), hidden(tmp_path)


def test_a_stranger_who_deletes_the_jobs_values_stops_it_within_seconds(real_run, tmp_path):
    """An attacker on the node connects to the job's port and deletes the values the processes wait
    for (the folder process 0 shared, each one's "done"), as soon as they are written. Each process
    knows, from the others' sealed beats, what they have posted: a value posted and gone stops every
    process within seconds with one line, where they used to wait forever; nothing is published."""
    def delete(store, prefix: str) -> None:
        for key in ("share/prepared", "gather/done/0", "gather/done/1"):
            store.delete_key(prefix + key)

    _attacked(real_run, tmp_path, "4343", "10", 0.05, delete, "is gone from the job's store")


@pytest.mark.parametrize("how", ["replayed", "deleted"])
def test_a_stranger_who_replays_or_deletes_a_beat_stops_the_job(real_run, tmp_path, how):
    """A process's beat (sealed) could be written again, old, by anyone who reads it from the job's port,
    to keep a process that died looking alive; or deleted. A beat only ever counts up and, once seen, stays:
    either change stops every process within seconds with one line (not after the peer timeout, 30 s)."""
    old: dict = {}

    def replay(store, prefix: str) -> None:
        beat = prefix + "beat/1"
        if how == "deleted":
            store.delete_key(beat)
        elif not old and store.check([beat]):
            old.update(value=store.get(beat), at=time.monotonic())
        elif old and time.monotonic() > old["at"] + 2.5:  # process 1 has beaten since
            store.set(beat, old["value"])

    said = "went back from" if how == "replayed" else "the beat of process 1 is gone"
    # (slowed so that the job is still composing well after the replay's 2.5 s, on a loaded machine too)
    _attacked(real_run, tmp_path, "4444", "30", 0.5, replay, said)


def test_a_squatted_master_port_is_one_line_on_every_process_within_seconds(real_run, tmp_path):
    """Another program (another user's) listens on the job's MASTER_PORT and never answers: process
    0 cannot serve there, process 1 would wait on it (torch's client, 300 s, a page of C++ frames per
    retry). Each says so in one line within seconds; no stack frames; nothing written."""

    run, spec = real_run("hf_bf16_2")
    _c2, _c4, c6 = checkpoints_of(run, spec)
    recipe = write_recipe(tmp_path, c6, {})
    squatter = socket.socket()
    squatter.bind(("127.0.0.1", 0))
    squatter.listen(16)  # accepts connections in the kernel's backlog, answers nothing
    began = time.monotonic()
    tasks = slurm_tasks(["--apply", recipe], job="4444", env={"MASTER_PORT": str(squatter.getsockname()[1])})
    try:
        outs = [t.communicate(timeout=120) for t in tasks]
    finally:
        for t in tasks:
            t.kill()
        squatter.close()
    assert time.monotonic() - began < 60, outs
    assert all(t.returncode == 2 for t in tasks), outs
    for (_out, err), needle in zip(outs, ("could not meet the others", "is not this job's store")):
        errors = [line for line in err.splitlines() if line.startswith("error: ")]
        assert len(errors) == 1 and needle in errors[0], err
        assert "frame #" not in err and "Traceback" not in err, err
    assert not (tmp_path / "composed").exists()
