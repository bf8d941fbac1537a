"""Nothing lost, nothing executed: hostile files, kills, and full disks."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import checkpoints_of, tree_digest
from faults import inject
from helpers import TAILOR, assert_one_line_error, finish, hidden, start_apply, tailor, wait_for_line, write_recipe


@pytest.fixture
def real_run(real_run):
    """conftest's real_run, and every scenario here checks that each run it was handed hashes the same
    after it as before it was handed out: no file of a source changed."""
    handed: dict = {}

    def get(name: str, **kwargs):
        run, spec = real_run(name, **kwargs)
        handed.setdefault(run, tree_digest(run))
        return run, spec

    yield get
    for run, before in handed.items():
        assert tree_digest(run) == before, f"a source checkpoint file of {run.name} changed"


class RunsACommand:
    """What an attacker pickles: unpickling it runs a shell command."""

    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


@pytest.mark.parametrize("which", ["model_states", "optim_states"])
def test_a_pickle_that_runs_a_command_is_refused(real_run, tmp_path, which):
    run, spec = real_run("hf_bf16_2")
    c2, _, c6 = checkpoints_of(run, spec)
    evil = tmp_path / "checkpoint-2"
    shutil.copytree(c2, evil)
    marker = tmp_path / "pwned"
    target = next((evil / "global_step2").glob(f"*rank_0_*{which}.pt"))
    real = torch.load(target, weights_only=False)
    if which == "model_states":
        real["lr_scheduler"] = RunsACommand(f"touch {marker}")
    else:
        real["optimizer_state_dict"]["loss_scaler"] = RunsACommand(f"touch {marker}")
    torch.save(real, target)

    recipe = write_recipe(tmp_path, c6, {"layers.1": evil})
    before = tree_digest(run, evil)
    result = tailor("--apply", recipe, "-j", "1")
    assert_one_line_error(result, 4, target.name, "refused to load", "unsafe")
    assert not marker.exists(), "the planted command ran"
    assert not (tmp_path / "composed").exists()
    assert tree_digest(run, evil) == before










def children_of(pid: int) -> list[int]:
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            kids.append(int(stat.parent.name))
    return kids


def assert_complete(out: Path, base: Path) -> None:
    from zero_reader import read_full_state

    assert (out / "tailor_provenance.json").is_file()
    assert read_full_state(out)["fp32"].keys() == read_full_state(base)["fp32"].keys()


@pytest.mark.parametrize("delay", [0.5, 2.0, 3.5, 5.0])
def test_kill_9_at_any_moment_leaves_nothing_and_a_rerun_succeeds(real_run, tmp_path, delay):
    run, spec = real_run("hf_bf16_2")
    c2, c4, c6 = checkpoints_of(run, spec)
    recipe = write_recipe(tmp_path, c6, {"layers.1": c4, "embed_tokens": c2})
    out = tmp_path / "composed"
    proc = start_apply(recipe, "-j", "2")
    time.sleep(delay)
    workers = children_of(proc.pid)
    proc.kill()  # SIGKILL the tailor-tui process itself, as the OOM killer would
    proc.wait()
    for _ in range(50):  # orphaned workers leave by themselves within a second or so
        if not [p for p in workers if Path(f"/proc/{p}").exists()]:
            break
        time.sleep(0.1)
    assert not [p for p in workers if Path(f"/proc/{p}").exists()], "worker processes outlived a killed composition"
    if out.exists():
        # Killed after the atomic rename (or it had finished): then the output must be whole.
        verified = tailor("--verify", recipe)
        assert verified.returncode == 0, verified.stdout + verified.stderr
    result = tailor("--apply", recipe, "-j", "2", "--force")
    assert result.returncode == 0, result.stderr
    assert_complete(out, c6)
    assert hidden(tmp_path) == []  # the killed run's temp folder was cleaned up too


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGHUP])
def test_a_worker_that_dies_is_one_line_and_leaves_nothing(real_run, tmp_path, sig):
    """A worker killed mid-composition (the OOM killer's SIGKILL; a hangup) is said in one line,
    by its signal; nothing is left behind."""
    run, spec = real_run("hf_bf16_2")
    c2, c4, c6 = checkpoints_of(run, spec)
    recipe = write_recipe(tmp_path, c6, {"layers.1": c4})
    proc = start_apply(recipe, "-j", "2")
    seen = wait_for_line(proc, "rank ")
    for pid in children_of(proc.pid):  # the workers (forked: no other child)
        with contextlib.suppress(ProcessLookupError):  # the pool may have stopped it, the first one dead
            os.kill(pid, sig)
    err = finish(proc, seen)
    assert_one_line_error(subprocess.CompletedProcess([], proc.returncode, "", err), 6,
                          f"a worker process died before its task was done (killed by {sig.name}")
    assert not (tmp_path / "composed").exists() and hidden(tmp_path) == []


@pytest.mark.parametrize("when", ["composing", "rank "])  # while workers start; mid-composition
def test_ctrl_c_stops_workers_and_cleans_up(real_run, tmp_path, when):
    run, spec = real_run("hf_bf16_2")
    c2, c4, c6 = checkpoints_of(run, spec)
    recipe = write_recipe(tmp_path, c6, {"layers.1": c4})
    proc = start_apply(recipe, "-j", "2")
    seen = wait_for_line(proc, when)
    os.killpg(proc.pid, signal.SIGINT)  # a terminal's Ctrl-C reaches the whole process group
    err = finish(proc, seen)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "error: " in err and "nothing was written" in err
    assert not (tmp_path / "composed").exists() and hidden(tmp_path) == []


def test_ctrl_c_while_the_workers_are_stuck_ends_the_command(real_run, tmp_path):
    """Ctrl-C while every worker is stuck (each step of theirs sleeps an hour, as on a file system that
    stopped answering): they are killed once they have not stopped within `workers.STOP_GRACE`, and the
    command ends, cancelled, nothing published, where it used to wait for them without end."""
    run, spec = real_run("hf_bf16_2")
    c2, c4, c6 = checkpoints_of(run, spec)
    recipe = write_recipe(tmp_path, c6, {"layers.1": c4})
    steps = tmp_path / "steps"
    proc = start_apply(recipe, "-j", "2", env=inject.environment(slow=3600, slow_log=steps))
    seen = wait_for_line(proc, "composing")
    while not (steps.is_file() and steps.read_text()):  # a worker is in its hour-long step
        assert proc.poll() is None, seen + proc.stderr.read()
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGINT)
    try:
        err = seen + proc.communicate(timeout=240)[1]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # (the workers too, should the command have waited for them)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "nothing was written" in err
    assert not (tmp_path / "composed").exists() and hidden(tmp_path) == []


def test_sigterm_from_slurm_cleans_up(real_run, tmp_path):
    run, spec = real_run("hf_bf16_2")
    c2, c4, c6 = checkpoints_of(run, spec)
    recipe = write_recipe(tmp_path, c6, {"layers.1": c4, "embed_tokens": c2})
    proc = start_apply(recipe, "-j", "2")
    seen = wait_for_line(proc, "rank ")
    proc.terminate()
    err = finish(proc, seen)
    assert proc.returncode == 130 and "Traceback" not in err
    assert not (tmp_path / "composed").exists() and hidden(tmp_path) == []


def test_a_signal_while_workers_run_cancels_them_and_is_raised_once_they_are_gone():
    """A SIGTERM (or Ctrl-C) while the pool runs must not be raised inside concurrent.futures: raised in
    `wait` while that held a future's lock, it once left the pool's shutdown waiting forever (a hang in CI).
    It cancels the workers through the flag and is raised by the block that held it, the pool shut down."""
    import multiprocessing
    import threading
    import traceback

    from helpers import task_until_cancelled

    from tailor_tui.events import TaskOptions
    from tailor_tui.team.workers import run_calls

    def as_interrupt(signum, frame):
        raise KeyboardInterrupt

    before = signal.signal(signal.SIGTERM, as_interrupt)  # what the CLI installs
    seen, cancel, running, over = [], threading.Event(), threading.Event(), threading.Event()

    def emit(event) -> None:
        seen.append(event)
        running.set()

    def signal_once_they_run() -> None:  # (spawned, they start in seconds on a loaded machine: not a fixed delay)
        running.wait(120)
        time.sleep(0.5)  # (the pool waiting on them)
        if not over.is_set():  # (never once the test is over: the handler is pytest's again)
            os.kill(os.getpid(), signal.SIGTERM)

    try:
        threading.Thread(target=signal_once_they_run, daemon=True).start()
        with pytest.raises(KeyboardInterrupt) as raised:
            run_calls([(task_until_cancelled, (SimpleNamespace(task=f"rank {i}", total_bytes=1),)) for i in range(2)],
                      2, emit, cancel, TaskOptions())
    finally:
        over.set()
        signal.signal(signal.SIGTERM, before)
    assert cancel.is_set() and seen, "the workers ran, and were cancelled through the flag"
    where = traceback.extract_tb(raised.tb)
    assert "concurrent" not in "".join(f.filename for f in where), where.format()
    assert where[-2].filename.endswith("interrupts.py"), where.format()
    assert multiprocessing.active_children() == []


_KILLED_WHILE_ASKING = """
import os, random, signal, sys, tempfile, threading, time
from types import SimpleNamespace
sys.path.insert(0, {tests!r})
import multiprocessing
from helpers import task_asking_to_stop
from tailor_tui.errors import OutputError
from tailor_tui.events import TaskOptions
from tailor_tui.team.workers import run_calls

def kill_one(folder):  # once both workers ask (a worker killed as it starts is another story)
    while len(os.listdir(folder)) < 2:
        time.sleep(0.05)
    time.sleep(random.uniform(0.2, 0.6))
    os.kill(random.choice(multiprocessing.active_children()).pid, signal.SIGKILL)

if __name__ == "__main__":  # (workers are spawned: torch is loaded)
  for _round in range(3):  # the worker killed holds what it asks with some odds: three rounds
    folder = tempfile.mkdtemp()
    threading.Thread(target=kill_one, args=(folder,), daemon=True).start()
    try:
      run_calls([(task_asking_to_stop, (SimpleNamespace(task=f"rank {{i}}", total_bytes=1,
                                                        asking=os.path.join(folder, str(i))),))
                 for i in range(2)], 2, lambda event: None, threading.Event(), TaskOptions())
    except OutputError as exc:
      print(exc)
"""


def test_a_worker_killed_while_it_asks_whether_to_stop_leaves_the_parent_free():
    """The out-of-memory killer takes a worker while it is asking the parent's stop flag: the parent still
    stops the other and says so in one line, within seconds, every time (a multiprocessing Event's lock, held
    by a dead worker, once left the parent's `set` waiting forever: its workers ask from four threads at
    once, so that whatever asking takes is nearly always held)."""
    done = subprocess.run([sys.executable, "-c", _KILLED_WHILE_ASKING.format(tests=str(Path(__file__).parent))],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    said = done.stdout.splitlines()
    assert len(said) == 3 and all("a worker process died before its task was done (killed by SIGKILL" in line
                                  for line in said), done.stdout


def test_a_worker_never_waits_on_events_nobody_reads_to_exit():
    """One task fails: the parent stops reading events and shuts the pool down, while another worker
    sends more than the pipe holds. That worker must still exit (not wait for its queue to be read)."""
    import multiprocessing
    import threading

    from helpers import task_failing_soon, task_flooding_events

    from tailor_tui.events import TaskOptions
    from tailor_tui.team.workers import run_calls

    calls = [(task_failing_soon, (SimpleNamespace(task="rank 0", total_bytes=1),)),
             (task_flooding_events, (SimpleNamespace(task="rank 1", total_bytes=1),))]
    with pytest.raises(OSError, match="rank 0 failed"):
        run_calls(calls, 2, lambda event: None, threading.Event(), TaskOptions())
    assert multiprocessing.active_children() == []


def test_file_size_limit_is_one_clear_error(real_run, tmp_path):
    run, spec = real_run("hf_bf16_2")
    c2, _, c6 = checkpoints_of(run, spec)
    recipe = write_recipe(tmp_path, c6, {"layers.1": c2})
    before = tree_digest(run)
    for workers in ("1", "2"):
        result = subprocess.run(["bash", "-c", f'ulimit -f 100; exec "{TAILOR}" --apply "{recipe}" -j {workers}'],
                                capture_output=True, text=True, timeout=300)
        assert_one_line_error(result, 6, "file size limit", "nothing was left at the output path")
        assert not (tmp_path / "composed").exists() and hidden(tmp_path) == []
    assert tree_digest(run) == before


@pytest.fixture
def small_mount(tmp_path):
    """A real 300 KiB file system (tmpfs), to fill up; skipped where mounting is not allowed."""
    point = tmp_path / "small"
    point.mkdir()

    def mount(*options: str) -> Path:
        opts = ",".join(("size=300k", *options))
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(point)], capture_output=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
        return point

    yield mount
    subprocess.run(["umount", str(point)], capture_output=True)


def test_full_disk_is_one_clear_error(real_run, tmp_path, small_mount):
    run, spec = real_run("hf_bf16_2")
    c2, _, c6 = checkpoints_of(run, spec)
    disk = small_mount()
    recipe = write_recipe(tmp_path, c6, {"layers.1": c2}, output=str(disk / "composed"))
    assert_one_line_error(tailor("--apply", recipe, "-j", "1"), 6, "the disk is full")
    assert list(disk.iterdir()) == []


def test_read_only_destination_is_one_clear_error(real_run, tmp_path, small_mount):
    run, spec = real_run("hf_bf16_2")
    disk = small_mount("ro")
    recipe = write_recipe(tmp_path, checkpoints_of(run, spec)[-1], {}, output=str(disk / "composed"))
    assert_one_line_error(tailor("--apply", recipe), 6, "read-only")
    assert list(disk.iterdir()) == []


def test_verify_reports_per_row_and_catches_differences(real_run, tmp_path):
    run, spec = real_run("hf_bf16_2")
    c2, c4, c6 = checkpoints_of(run, spec)
    recipe = write_recipe(tmp_path, c6, {"layers.1": c4, "embed_tokens": c2})
    assert tailor("--apply", recipe, "-j", "1").returncode == 0

    result = tailor("--verify", recipe)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "ok    layers.1      checkpoint-4" in result.stdout
    assert "ok    embed_tokens  checkpoint-2" in result.stdout
    assert "verified: every row" in result.stdout

    # A recipe that says layers.1 came from checkpoint-2: that row, and only it, fails.
    other = tmp_path / "other"
    other.mkdir()
    wrong = write_recipe(other, c6, {"layers.1": c2, "embed_tokens": c2}, output=str(tmp_path / "composed"))
    result = tailor("--verify", wrong)
    assert result.returncode == 7
    failed = [line.split()[1] for line in result.stdout.splitlines() if line.startswith("FAIL")]
    assert failed == ["layers.1"]
    assert "error: verification failed" in result.stderr and "Traceback" not in result.stderr

    # Damage the output after the fact: moments zeroed, a trainer file edited.
    out = tmp_path / "composed"
    optim = out / "global_step6" / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    state = torch.load(optim, weights_only=False)
    state["optimizer_state_dict"]["optimizer_state_dict"]["state"][0]["exp_avg_sq"].zero_()
    torch.save(state, optim)
    (out / "trainer_state.json").write_text("{}")
    result = tailor("--verify", recipe)
    assert result.returncode == 7
    assert "rank 1: exp_avg_sq of model." in result.stdout
    assert "trainer_state.json: differs from the base" in result.stdout


def test_verify_without_an_output(real_run, tmp_path):
    run, spec = real_run("hf_bf16_2")
    recipe = write_recipe(tmp_path, checkpoints_of(run, spec)[-1], {})
    assert_one_line_error(tailor("--verify", recipe), 6, "does not exist; nothing to verify")


def test_sources_on_a_read_only_file_system_compose_fine(real_run, tmp_path, small_mount):
    """Proof that sources are opened for reading only: they sit on a read-only mount."""
    run, spec = real_run("hf_bf16_2")
    disk = small_mount()
    subprocess.run(["umount", str(disk)], check=True)
    big = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(disk)], capture_output=True)
    assert big.returncode == 0, big.stderr
    for c in checkpoints_of(run, spec):
        shutil.copytree(c, disk / c.name)
    subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
    c2, c4, c6 = (disk / c.name for c in checkpoints_of(run, spec))
    recipe = write_recipe(tmp_path, c6, {"layers.1": c4, "embed_tokens": c2})
    result = tailor("--apply", recipe, "-j", "2")
    assert result.returncode == 0, result.stderr
    assert tailor("--verify", recipe).returncode == 0
