"""What makes a job's processes a team nobody else can join or steer: a secret they share, and
every value they exchange sealed with it.

On a shared login node or cluster, anyone can connect to the port of a job's store. So:
- the secret comes from `$TAILOR_TUI_TEAM_SECRET` when the launching user sets it (a batch
  script exports it before `srun`; every task inherits it, nobody else can read a process's
  environment), else process 0 makes one: 32 random bytes in a file of a folder only this user
  can enter (`meeting_folder`: 0700, created afresh, checked for owner and links before use,
  beside the output, or in the user's cache for `--stats`), where the others read it;
- under Slurm, process 0 serves the store on a port the kernel picks and writes it there too:
  there is no port an outsider can predict or another job can share;
- every value set in the store is sealed: an HMAC-SHA256 over the job, the key and the value.
  A value that fails its seal was written by someone else: every process stops with one line,
  nothing is published.
A stale secret (a crashed job's with the same Slurm ids or torchrun port) is noticed, not
trusted: process 0's sealed greeting fails to open with it, and the file is read again until
process 0's new one is there.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import shutil
import stat
import time
from pathlib import Path
from typing import Literal, overload

from tailor_tui.checkpoints.side_files import read_small
from tailor_tui.errors import ExitCode, TailorError, UsageError

SECRET_ENV = "TAILOR_TUI_TEAM_SECRET"
SECRET, PORT = "secret", "port"


class Forged(TailorError):
    """A value in the job's store was not written by one of its processes."""

    exit_code = ExitCode.USAGE


class Seal:
    """Seals and opens the values of one job (its `job` name binds them to it)."""

    def __init__(self, secret: bytes, job: str):
        self.secret, self.job = secret, job

    def seal(self, key: str, value: str) -> str:
        return self._mac(key, value) + ":" + value

    def open(self, key: str, stored: bytes | str) -> str:
        text = stored.decode(errors="replace") if isinstance(stored, bytes) else stored
        mac, sep, value = text.partition(":")
        if not sep or not hmac.compare_digest(mac, self._mac(key, value)):
            raise Forged(f"the value of '{key}' in the job's store fails its authentication: another program "
                         "connected to the job's port and wrote it; nothing was published (see docs/security.md, "
                         "shared clusters)")
        return value

    def _mac(self, key: str, value: str) -> str:
        message = json.dumps([self.job, key, value]).encode()
        return hmac.new(self.secret, message, hashlib.sha256).hexdigest()


def new_secret() -> bytes:
    return secrets.token_bytes(32)


def env_secret(env) -> bytes | None:
    """The secret the launching user set in the environment, or None; a short one is refused."""
    text = env.get(SECRET_ENV, "")
    if not text:
        return None
    if len(text) < 16:
        raise UsageError(f"{SECRET_ENV} holds {len(text)} characters: a team secret needs at least 16 "
                          "(e.g. export it from `openssl rand -hex 32`)")
    return text.encode()


def meeting_name(job: str) -> str:
    return f".tailor-team-{hashlib.sha256(job.encode()).hexdigest()[:24]}"


def meeting_folder(root: Path, job: str) -> Path:
    """Where process 0 leaves the secret and the port for job `job`: a hidden folder in `root`
    (beside the output of `--apply`, in the user's cache for `--stats`), on the file system
    every process of the job shares. Its name can be told from the job's ids, so another user who
    can write in `root` (a group-writable project folder, a sticky /tmp) may have taken it: then
    the job meets in the user's own cache instead (`teams/`, which nobody else can write), where
    every process of the job, finding the same name taken, looks too."""
    folder = root / meeting_name(job)
    try:
        theirs = os.lstat(folder).st_uid != os.geteuid()
    except FileNotFoundError:
        theirs = False
    if not theirs:
        return folder
    from tailor_tui.checkpoints.cache import cache_dir

    return cache_dir() / "teams" / meeting_name(job)


def _check_private(folder: Path) -> None:
    st = os.lstat(folder)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise UsageError(f"{folder}: not a folder (a link?) where tailor-tui's job meets; remove it and run again")
    if st.st_uid != os.geteuid() or st.st_mode & 0o077:
        raise UsageError(f"{folder}: owned by another user or open to others (mode {stat.S_IMODE(st.st_mode):o}); "
                          "a job's meeting folder must be this user's alone: remove it and run again")


def lay_out(folder: Path, secret: bytes | None, port: int | None) -> None:
    """Process 0: a fresh 0700 `folder` holding the secret (unless the environment has it) and
    the port, each written exclusively, never through a link."""
    folder.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    if os.path.lexists(folder):
        _check_private(folder)  # a crashed job's: ours to remove; anything else is refused
        shutil.rmtree(folder)
    staging = folder.with_name(f".{folder.name}.{os.getpid()}")
    os.mkdir(staging, 0o700)
    try:
        for name, text in ((SECRET, secret.hex() if secret is not None else None),
                           (PORT, str(port) if port is not None else None)):
            if text is not None:
                fd = os.open(staging / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
                with os.fdopen(fd, "w") as f:
                    f.write(text)
        os.rename(staging, folder)  # whole, or not there
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


@overload
def read_meeting(folder: Path, deadline: float, want_secret: Literal[True],
                 want_port: Literal[False]) -> tuple[bytes, None]: ...


@overload
def read_meeting(folder: Path, deadline: float, want_secret: bool,
                 want_port: Literal[True]) -> tuple[bytes | None, int]: ...


def read_meeting(folder: Path, deadline: float, want_secret: bool, want_port: bool) -> tuple[bytes | None, int | None]:
    """The others: wait (until `deadline`, time.monotonic()) for process 0's folder, check it is
    this user's alone, and read what it holds."""
    while True:
        try:
            _check_private(folder)
            secret = bytes.fromhex(_read(folder / SECRET)) if want_secret else None
            port = int(_read(folder / PORT)) if want_port else None
            return secret, port
        except (FileNotFoundError, ValueError):
            if time.monotonic() > deadline:
                raise UsageError(f"{folder}: process 0 of the job did not leave its secret and port there in "
                                  "time; check that every task was started and shares this file system "
                                  f"(or set {SECRET_ENV} and MASTER_PORT for every task)") from None
            time.sleep(0.1)


def _read(path: Path) -> str:
    return read_small(path, 200, follow=False).decode().strip()  # a hex secret or a port number
