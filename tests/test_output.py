"""The output path: nothing lost, one writer, the truth when cancelled.

--force replaces only an earlier tailor-tui output; an output that reaches a source under
another name (bind mount, symlink) is refused; two compositions to one output do not both
"succeed"; a swap interrupted by a signal or a kill leaves the old or the new output
whole and says which; --dry-run never needs --force.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import threading
import time

import pytest
from conftest import checkpoints_of, tree_digest
from faults import inject
from helpers import assert_one_line_error, finish, hidden, start_apply, tailor, wait_for_line, write_recipe

from tailor_tui import fileio
from tailor_tui.checkpoints.checkpoint import OUTPUT_FILES, PROVENANCE
from tailor_tui.compose import compose_run
from tailor_tui.errors import Cancelled, CheckpointError, OutputError
from tailor_tui.planning import output
from tailor_tui.planning.build import build_plan
from tailor_tui.planning.recipe import Recipe


@pytest.fixture
def terminal_sigint():
    """SIGINT as a terminal's Ctrl-C finds a Python process: its default handler, not blocked. A test
    run started in the background by a shell without job control (`( make test & )`) inherits SIGINT
    ignored, and tailor-tui then rightly ignores it too; these tests are about what it does with a Ctrl-C."""
    handler = signal.signal(signal.SIGINT, signal.default_int_handler)
    mask = signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, handler)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


@pytest.fixture
def hf_run(real_run):
    run, spec = real_run("hf_bf16_2")
    return run, checkpoints_of(run, spec)


def test_force_onto_a_training_run_is_refused_and_the_run_kept(hf_run, tmp_path):
    run, (c2, c4, c6) = hf_run
    mine = tmp_path / "my-run"  # a training run, not named in the recipe: one typo away
    shutil.copytree(run, mine)
    before = tree_digest(mine)
    recipe = write_recipe(tmp_path, c6, {"layers.1": c4}, output="my-run")
    result = tailor("--apply", recipe, "--force")
    assert_one_line_error(result, 6, "--force replaces only an earlier tailor-tui output",
                          "3 checkpoint(s) (checkpoint-2, checkpoint-4, checkpoint-6)")
    assert tree_digest(mine) == before


def test_force_replaces_an_earlier_output_but_not_one_training_resumed_into(real_run, tmp_path):
    run, spec = real_run("ds_bf16_3_subgroups")
    c2, _, c6 = checkpoints_of(run, spec)
    recipe = write_recipe(tmp_path, c6, {"layers.1": c2})
    assert tailor("--apply", recipe).returncode == 0
    out = tmp_path / "composed"
    written = json.loads((out / PROVENANCE).read_text())[OUTPUT_FILES]
    assert "global_step6/zero_pp_rank_2_mp_rank_00_model_states.pt" in written
    again = tailor("--apply", recipe, "--force")
    assert again.returncode == 0, again.stderr

    shutil.copytree(out / "global_step6", out / "global_step8")  # training resumed into the output
    before = tree_digest(out)
    result = tailor("--apply", recipe, "--force")
    assert_one_line_error(result, 6, "earlier tailor-tui output that now also holds global_step8/")
    assert tree_digest(out) == before
    (out / "latest").write_text("global_step8")  # a file it wrote, changed since
    shutil.rmtree(out / "global_step8")
    assert_one_line_error(tailor("--apply", recipe, "--force"), 6, "latest changed since it was written")


@pytest.mark.parametrize("name", ["hf_bf16_2", "ds_bf16_3_subgroups"])
def test_force_never_replaces_an_older_output_that_training_resumed_into(real_run, tmp_path, name):
    """An output whose record lists no files (a tailor-tui before the list was kept) cannot be told
    apart from what training saved into it since: --force is refused, naming the checkpoint, and
    the output is kept whole; with its list back (what a newer tailor-tui writes) it is still
    refused, naming what tailor-tui did not write."""
    run, spec = real_run(name)
    c2, _, c6 = checkpoints_of(run, spec)
    recipe = write_recipe(tmp_path, c6, {"layers.1": c2})
    assert tailor("--apply", recipe).returncode == 0
    out = tmp_path / "composed"
    record = json.loads((out / PROVENANCE).read_text())
    listed = record.pop(OUTPUT_FILES)
    (out / PROVENANCE).write_text(json.dumps(record))
    resumed = out / ("checkpoint-8" if spec.layout == "hf" else "global_step8")
    subprocess.run(["cp", "-a", str(c6), str(resumed)], check=True)  # training resumed into the output
    before = tree_digest(out)
    assert_one_line_error(tailor("--apply", recipe, "--force"), 6, "without the list of files tailor-tui wrote",
                          resumed.name)
    assert tree_digest(out) == before
    (out / PROVENANCE).write_text(json.dumps(record | {OUTPUT_FILES: listed}))
    assert_one_line_error(tailor("--apply", recipe, "--force"), 6, f"now also holds {resumed.name}/",
                          f"training checkpoint(s) {resumed.name}")
    assert resumed.is_dir()


@pytest.mark.parametrize("name", ["hf_bf16_2", "ds_bf16_3_subgroups"])
def test_an_output_inside_a_training_checkpoint_is_refused(real_run, tmp_path, name):
    """An output inside (or being) a checkpoint training saved is refused though that checkpoint
    is no source, and nothing is written; beside the checkpoints, in the run folder, it is fine."""
    source, spec = real_run(name)
    run = tmp_path / "run"
    shutil.copytree(source, run)
    c2, c4, c6 = checkpoints_of(run, spec)
    before = tree_digest(run)
    for inside in (c2 / "fixed", c2 / "sub" / "fixed"):
        recipe = write_recipe(tmp_path, c6, {"layers.1": c4}, output=str(inside))
        assert_one_line_error(tailor("--apply", recipe, "--force"), 6, "would nest inside training checkpoint",
                              str(c2))
    recipe = write_recipe(tmp_path, c6, {"layers.1": c4}, output=str(c2))
    assert_one_line_error(tailor("--apply", recipe, "--force"), 6, "is training checkpoint", str(c2))
    assert tree_digest(run) == before and not (c2 / "fixed").exists()
    recipe = write_recipe(tmp_path, c6, {"layers.1": c4}, output=str(run / "fixed"))
    assert tailor("--apply", recipe).returncode == 0
    assert tailor("--apply", recipe, "--force").returncode == 0  # an earlier output: not a training checkpoint


def test_an_output_reaching_a_source_through_a_bind_mount_is_refused(hf_run, tmp_path):
    run, (c2, c4, c6) = hf_run
    alias = tmp_path / "alias"
    alias.mkdir()
    mounted = subprocess.run(["mount", "--bind", str(run), str(alias)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip("bind mounts are not permitted here")
    try:
        before = tree_digest(run)
        recipe = write_recipe(tmp_path, c6, {"layers.1": c4}, output="alias")
        assert_one_line_error(tailor("--apply", recipe, "--force"), 6, "holds source checkpoint")
        recipe = write_recipe(tmp_path, c6, {"layers.1": c4}, output="alias/checkpoint-6")
        assert_one_line_error(tailor("--apply", recipe, "--force"), 6, "is source checkpoint")
        recipe = write_recipe(tmp_path, c6, {}, output="alias/checkpoint-6/out")
        assert_one_line_error(tailor("--apply", recipe), 6, "would nest inside source checkpoint")
        assert tree_digest(run) == before
    finally:
        subprocess.run(["umount", str(alias)], check=True)


def test_symlinked_outputs_are_refused_before_composing(hf_run, tmp_path):
    run, (c2, c4, c6) = hf_run
    (tmp_path / "link").symlink_to(run)
    recipe = write_recipe(tmp_path, c6, {}, output="link")
    assert_one_line_error(tailor("--apply", recipe, "--force"), 6, "is a symbolic link")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    recipe = write_recipe(tmp_path, c6, {}, output="dangling")
    assert_one_line_error(tailor("--apply", recipe), 6, "is a symbolic link", "does not exist")
    assert (tmp_path / "dangling").is_symlink() and not (tmp_path / "nowhere").exists()


def test_a_second_composition_to_the_same_output_is_refused_while_the_first_runs(hf_run, tmp_path):
    run, (c2, c4, c6) = hf_run
    recipe = write_recipe(tmp_path, c6, {"layers.1": c4})
    first = start_apply(recipe, "-j", "2", "--force", env=inject.environment(slow=0.1))  # ~7 s
    seen = wait_for_line(first, "rank ")
    second = tailor("--apply", recipe, "--force", "-j", "1")
    assert_one_line_error(second, 6, "another tailor-tui (pid", "is writing it now")
    err = finish(first, seen)
    assert first.returncode == 0, err
    assert tailor("--verify", recipe).returncode == 0
    assert hidden(tmp_path) == []  # the lock file goes with the composition


def test_dry_run_never_needs_force_and_warns_about_other_runs(real_run, tmp_path):
    run, spec = real_run("hf_bf16_2")
    c2, c4, c6 = checkpoints_of(run, spec)
    recipe = write_recipe(tmp_path, c6, {"layers.1": c4})
    (tmp_path / "composed").mkdir()
    (tmp_path / "composed" / "keep.txt").write_text("mine")
    preview = tailor("--apply", recipe, "--dry-run")
    assert preview.returncode == 0, preview.stderr
    assert "warning: the real run would refuse it" in preview.stdout and "--force" in preview.stdout
    assert (tmp_path / "composed" / "keep.txt").is_file()

    elsewhere = tmp_path / "elsewhere" / "checkpoint-4"  # the same run, copied to another folder
    shutil.copytree(c4, elsewhere)
    recipe = write_recipe(tmp_path, c6, {"layers.1": elsewhere, "layers.2": elsewhere}, output="other-out")
    preview = tailor("--apply", recipe, "--dry-run")
    assert "warning: layers.1, layers.2 come(s) from" in preview.stdout
    assert f"another run folder ({elsewhere.parent})" in preview.stdout
    applied = tailor("--apply", recipe)
    assert applied.returncode == 0
    assert [line for line in applied.stderr.splitlines() if line.startswith("warning: ")] == [
        line for line in preview.stdout.splitlines() if line.startswith("warning: ")]


def test_a_file_that_shrinks_while_copied_is_an_error_not_a_short_copy(tmp_path, monkeypatch):
    src = tmp_path / "trainer_state.json"
    src.write_bytes(b"x" * 10000)
    real = os.sendfile
    monkeypatch.setattr(os, "sendfile", lambda o, i, off, n: 0 if off >= 4096 else real(o, i, off, min(n, 4096)))
    with pytest.raises(CheckpointError, match="changed while it was copied"):
        fileio.copy_file(src, tmp_path / "copy")


def test_output_files_are_created_new_never_through_a_planted_link(tmp_path):
    """Every writer creates its files new (fileio.CREATE): a symbolic link or a file another user
    put where an output file goes is refused, and what it points at is left as it was."""
    from tailor_tui.formats.ptwrite import write_archive

    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    src = tmp_path / "src"
    src.write_bytes(b"new bytes")
    writers = {
        "write_file": lambda out: fileio.write_file(out, "x"),
        "copy_file": lambda out: fileio.copy_file(src, out),
        "write_archive": lambda out: write_archive(out, archive="a", pickle=b"\x80\x02}q\x00.", storages=[]),
    }
    for name, write in writers.items():
        link, there = tmp_path / f"{name}-link", tmp_path / f"{name}-there"
        link.symlink_to(victim)
        there.write_bytes(b"theirs")
        for out in (link, there):
            with pytest.raises((OSError, CheckpointError, OutputError)):
                write(out)
        assert victim.read_bytes() == b"precious" and there.read_bytes() == b"theirs", name
        write(tmp_path / f"{name}-new")  # a new file: written


def _plan(ckpts, tmp_path, force=False):
    c2, c4, c6 = ckpts
    return build_plan(Recipe(base=c6, output=tmp_path / "composed", layers={"layers.1": c4}), force=force)


def test_a_cancel_during_the_swap_completes_it_and_says_so(hf_run, tmp_path, monkeypatch, terminal_sigint):
    _, ckpts = hf_run
    compose_run.run_compose(_plan(ckpts, tmp_path), workers=1)
    old = (tmp_path / "composed" / PROVENANCE).read_text()
    from tailor_tui.team import transaction  # where a finished folder is put in place

    real = transaction.publish

    def interrupted(*args):  # Ctrl-C arrives while the new output is being swapped in
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)
        real(*args)

    monkeypatch.setattr(transaction, "publish", interrupted)
    with pytest.raises(Cancelled, match="is complete and holds the new composition"):
        compose_run.run_compose(_plan(ckpts, tmp_path, force=True), workers=1)
    assert (tmp_path / "composed" / PROVENANCE).read_text() != old  # the new one, whole
    assert tailor("--verify", write_recipe(tmp_path, ckpts[2], {"layers.1": ckpts[1]})).returncode == 0
    assert hidden(tmp_path) == []


@pytest.mark.parametrize("exchange", [True, False])
def test_cancelling_a_forced_composition_leaves_the_old_or_the_new_output_whole(hf_run, tmp_path, exchange):
    """Alike where the kernel swaps the old output and the new atomically and where it cannot
    (exchange False: renameat2's exchange refused, as on NFS; faults/inject.py), which replaces
    the old output by two renames."""
    _, (c2, c4, c6) = hf_run
    recipe = write_recipe(tmp_path, c6, {"layers.1": c4})
    assert tailor("--apply", recipe, "-j", "1").returncode == 0
    out = tmp_path / "composed"
    old = (out / PROVENANCE).read_text()
    log = tmp_path.parent / f"{tmp_path.name}-faults.log"  # (beside: the output's folder is to hold no stray file)
    env = inject.environment(no_exchange=not exchange, log=log)
    outcomes = []
    for delay in (0.0, 0.6, 2.0):
        proc = start_apply(recipe, "-j", "2", "--force", env=env)
        seen = wait_for_line(proc, "composing")
        time.sleep(delay)
        proc.send_signal(signal.SIGTERM)
        err = finish(proc, seen)
        assert "Traceback" not in err
        assert out.is_dir() and tailor("--verify", recipe).returncode == 0, (delay, err)
        now = (out / PROVENANCE).read_text()
        if proc.returncode == 0:
            assert now != old
        else:
            assert proc.returncode == 130, err
            said_complete = "is complete and holds the new composition" in err
            assert (now != old) == said_complete, (delay, err)
            assert said_complete or "nothing was written" in err
        old = now
        outcomes.append(proc.returncode)
        assert hidden(tmp_path) == []
        # without the exchange, a run that replaced the output did so by the two renames: the
        # exchange it tried first was refused (and none that left the old output tried one)
        replaced = proc.returncode == 0 or "is complete and holds the new composition" in err
        refused = [a for a, b in inject.refused_exchanges(log) if b == str(out)]
        log.unlink(missing_ok=True)
        assert len(refused) == (replaced and not exchange), (delay, refused, err)
    assert 130 in outcomes, outcomes  # some signals did land mid-composition


def test_an_old_output_moved_aside_by_a_killed_swap_is_put_back(hf_run, tmp_path):
    _, (c2, c4, c6) = hf_run
    recipe = write_recipe(tmp_path, c6, {"layers.1": c4})
    assert tailor("--apply", recipe).returncode == 0
    out = tmp_path / "composed"
    dead = subprocess.Popen(["true"])
    dead.wait()  # a PID that no longer runs
    aside = tmp_path / f"{fileio.aside_prefix(out)}{dead.pid}"
    os.rename(out, aside)  # killed between the two renames of a swap without renameat2
    result = tailor("--apply", recipe, "--force")
    assert result.returncode == 0, result.stderr
    assert not aside.exists() and out.is_dir() and hidden(tmp_path) == []


def test_signals_held_defers_sigint_to_the_end_of_the_block(terminal_sigint):
    got = []
    with pytest.raises(KeyboardInterrupt):
        with output.signals_held():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)
            got.append("the block ran to its end")
    assert got == ["the block ran to its end"]
    assert threading.current_thread() is threading.main_thread()


def test_a_ctrl_c_as_the_lock_is_taken_removes_the_lock_file(terminal_sigint, tmp_path, monkeypatch):
    """A Ctrl-C that arrives while the lock is being taken acts once it is taken, and the lock file
    goes with it (it once acted before the lock file was known to be this run's, and stayed)."""
    take = output._lock

    def interrupted(out, path):
        fd = take(out, path)
        os.kill(os.getpid(), signal.SIGINT)
        return fd

    monkeypatch.setattr(output, "_lock", interrupted)
    with pytest.raises(KeyboardInterrupt):
        with output.output_lock(tmp_path / "composed"):
            pass
    assert hidden(tmp_path) == []


def test_a_lock_left_to_a_killed_runs_workers_is_waited_for_a_moment(tmp_path):
    """kill -9 of a composition leaves its forked workers holding the output's lock (they share its open
    file) until they notice, within half a second, that they are orphans: a re-run waits for them. A
    lock whose holder is alive is refused at once."""
    import fcntl
    import socket

    out = tmp_path / "composed"
    dead = subprocess.Popen(["true"])
    dead.wait()
    lock = tmp_path / ".composed.tailor-lock"  # where the lock of `out` lies (docs/security.md)
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    os.write(fd, f"pid {dead.pid} on {socket.gethostname()}\n".encode())
    started = time.monotonic()
    orphan = subprocess.Popen(["flock", "-x", str(lock), "sleep", "1"])  # holds it for 1 s once it has it
    probe = os.open(lock, os.O_RDWR)
    while time.monotonic() - started < 10:  # until the orphan holds it (a loaded machine starts it late)
        try:
            fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            break
        fcntl.flock(probe, fcntl.LOCK_UN)
        time.sleep(0.01)
    os.close(probe)
    with output.output_lock(out):
        assert time.monotonic() - started >= 1.0  # taken once the orphan let go: no sooner, however loaded
    orphan.wait()
    os.close(fd)
    assert not lock.exists()  # the lock file went with the lock

    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode())
    fcntl.flock(fd, fcntl.LOCK_EX)
    started = time.monotonic()
    with pytest.raises(OutputError, match="is writing it now"):
        with output.output_lock(out):
            pass
    assert time.monotonic() - started < output.ORPHANS_LEAVE_WITHIN
    os.close(fd)
