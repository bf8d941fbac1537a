"""The tests' fault injection (faults/inject.py) does what the tests of cancel, kill and NFS rely on,
from outside the package: a slowed task sleeps every step and sees a cancel at the next one; the
processes the tests start, and the workers those fork or spawn, are slowed, while a process that asks
for no fault imports nothing; and an exchange refused makes tailor-tui replace an output by two
renames, its own way on file systems without renameat2's exchange."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from conftest import checkpoints_of
from faults import inject
from helpers import hidden, tailor, write_recipe

from tailor_tui import fileio
from tailor_tui.checkpoints.checkpoint import PROVENANCE
from tailor_tui.errors import Cancelled
from tailor_tui.events import ByteCounter


def test_a_slowed_step_sleeps_then_sees_a_cancel_at_once(slow_tasks):
    cancelled = []
    plain = ByteCounter("rank 0", 1 << 30, lambda event: None, lambda: bool(cancelled))
    plain.add(1)  # its first step looks; the next look is 32 small steps on
    cancelled.append(True)
    plain.add(1)  # so unslowed this step does not see the cancel: the fault must make every step look
    cancelled.clear()

    slow_tasks(0.05)
    counter = ByteCounter("rank 0", 1 << 30, lambda event: None, lambda: bool(cancelled))
    began = time.monotonic()
    for _ in range(3):
        counter.add(1)
    assert time.monotonic() - began >= 3 * 0.05
    cancelled.append(True)
    with pytest.raises(Cancelled):
        counter.add(1)


# What a process sees: whether it had imported tailor_tui when it started, what its ByteCounter.add is
# slowed by, and what that of a worker it spawns is (a fresh interpreter, started from the environment)
_SEEN = """
import multiprocessing, sys
imported = "tailor_tui" in sys.modules
from tailor_tui.events import ByteCounter
with multiprocessing.get_context("spawn").Pool(1) as pool:
    spawned = pool.apply(eval, ("getattr(__import__('tailor_tui.events').events.ByteCounter.add, 'slowed_by', None)",))
print(imported, getattr(ByteCounter.add, "slowed_by", None), spawned)
"""


@pytest.mark.parametrize("slow", [None, 0.25])
def test_processes_started_with_the_faults_and_the_workers_they_spawn_are_slowed(slow):
    """The sitecustomize patches tailor_tui as it is imported, not before: a process asking for no
    fault imports nothing of it, and its PYTHONPATH's other entries keep their place after it."""
    before = os.environ.get("PYTHONPATH")
    env = {**os.environ, **inject.environment(slow=slow)}
    assert env["PYTHONPATH"] == os.pathsep.join([inject.FOLDER, *([before] if before else [])])
    done = subprocess.run([sys.executable, "-c", _SEEN], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", str(slow), str(slow)], done.stdout + done.stderr


def test_a_refused_exchange_replaces_the_folder_by_two_renames(tmp_path, monkeypatch):
    log = tmp_path / "faults.log"
    folders = tmp_path / "folders"
    dest, new = folders / "out", folders / "new"
    for folder, text in ((dest, "old"), (new, "new")):
        folder.mkdir(parents=True)
        (folder / "f").write_text(text)
    renames = []
    rename = os.rename
    monkeypatch.setattr(os, "rename", lambda a, b: (renames.append((a, b)), rename(a, b))[1])
    inject.refuse_exchange(log, monkeypatch.setattr)
    fileio.replace_dir(new, dest)
    assert (dest / "f").read_text() == "new" and [p.name for p in folders.iterdir()] == ["out"]
    aside = folders / f"{fileio.aside_prefix(dest)}{os.getpid()}"
    assert renames == [(dest, aside), (new, dest)]  # the old folder moved aside, then the new one in
    assert inject.refused_exchanges(log) == [(str(new), str(dest))]


def test_without_the_fault_the_kernel_swaps(tmp_path, monkeypatch):
    """The control: where the file system can swap, replace_dir renames nothing itself."""
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    if not fileio.exchange(a, b):
        pytest.skip(f"{tmp_path}'s file system cannot swap two names (renameat2's exchange)")
    (a / "f").write_text("new")
    renames = []
    rename = os.rename
    monkeypatch.setattr(os, "rename", lambda x, y: (renames.append((x, y)), rename(x, y))[1])
    fileio.replace_dir(a, b)
    assert (b / "f").read_text() == "new" and not a.exists() and renames == []


@pytest.mark.parametrize("exchange", [True, False])
def test_a_forced_apply_without_the_exchange_replaces_its_output_by_two_renames(real_run, tmp_path, exchange):
    run, spec = real_run("hf_bf16_2")
    c2, c4, c6 = checkpoints_of(run, spec)
    work = tmp_path / "work"
    work.mkdir()
    recipe = write_recipe(work, c6, {"layers.1": c4})
    assert tailor("--apply", recipe).returncode == 0
    out = work / "composed"
    old = (out / PROVENANCE).read_text()
    log = tmp_path / "faults.log"
    replaced = tailor("--apply", recipe, "--force", "-j", "2", env=inject.environment(no_exchange=not exchange, log=log))
    assert replaced.returncode == 0, replaced.stderr
    assert (out / PROVENANCE).read_text() != old and tailor("--verify", recipe).returncode == 0
    assert hidden(work) == []
    refused = inject.refused_exchanges(log)
    if exchange:
        assert refused == []
    else:  # the probe of the output's folder before composing, then publishing's exchange over the output
        assert [b for _a, b in refused][-1] == str(out) and len(refused) == 2, refused
