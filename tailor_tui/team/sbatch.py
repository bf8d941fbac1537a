"""A batch job instead of a composition on a login node: when and what to write.

A composition of hundreds of GiB does not belong on a login node (its etiquette forbids it,
and one node composes at one node's bandwidth). When the composer runs where `sbatch` is at
hand and no Slurm job is (a login node), and the plan writes at least `LARGE` bytes, it offers
to write an sbatch script that runs the saved recipe as one job over several nodes (`srun
tailor-tui --apply`, docs/cluster.md) beside the recipe, instead of composing there.
"""

from __future__ import annotations

import contextlib
import math
import os
import shlex
import shutil
import stat
import sys
from pathlib import Path

from tailor_tui.checkpoints.side_files import read_small
from tailor_tui.errors import OutputError

LARGE = 64 << 30  # bytes to write from which the composer offers a batch job
PER_NODE = 256 << 30  # bytes to write given to each node, at most 8 nodes
MAX_NODES = 8
TASKS_PER_NODE, WORKERS = 4, 4
MARK = "# written by tailor-tui"  # a script carrying it may be replaced; any other file is left alone


def on_login_node(env=os.environ) -> bool:
    """sbatch is on PATH and this is not inside a Slurm job."""
    return shutil.which("sbatch", path=env.get("PATH")) is not None and not env.get("SLURM_JOB_ID")


def offer_batch(bytes_to_write: int, threshold: int = LARGE, env=os.environ) -> bool:
    return bytes_to_write >= threshold and on_login_node(env)


def script_path(recipe: Path) -> Path:
    return recipe.with_suffix(".sbatch")


def sbatch_script(recipe: Path, bytes_to_write: int, *, name: str = "tailor") -> str:
    """The script: nodes by bytes to write, 4 tasks a node, 4 workers each, the recipe by its
    absolute path, tailor-tui as this one is installed."""
    nodes = max(1, min(MAX_NODES, math.ceil(bytes_to_write / PER_NODE)))
    tailor = shutil.which("tailor-tui") or str(Path(sys.executable).with_name("tailor-tui"))
    return (
        "#!/bin/bash\n"
        f"{MARK} for {recipe.name}: submit with `sbatch {script_path(recipe).name}`\n"
        f"#SBATCH --job-name={name}\n"
        f"#SBATCH --nodes={nodes}\n"
        f"#SBATCH --ntasks-per-node={TASKS_PER_NODE}\n"
        f"#SBATCH --cpus-per-task={WORKERS + 1}\n"
        "#SBATCH --time=01:00:00\n"
        "set -euo pipefail\n"
        "# the job's tasks seal what they tell each other with a secret only they hold (docs/security.md)\n"
        "export TAILOR_TUI_TEAM_SECRET=\"$(od -An -tx1 -N32 /dev/urandom | tr -d ' \\n')\"\n"
        f"srun {shlex.quote(tailor)} --apply {shlex.quote(str(recipe.resolve()))} --workers {WORKERS} "
        "--progress lines\n"
    )


def write_sbatch(recipe: Path, bytes_to_write: int) -> Path:
    """Write the script beside `recipe` (replacing only one tailor-tui wrote); its path."""
    path = script_path(recipe)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    created = False
    try:
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            st = None
        if st is not None and (not stat.S_ISREG(st.st_mode)
                               or MARK.encode() not in read_small(path, 1 << 20, follow=False)[:512]):
            raise OutputError(f"{path}: exists and was not written by tailor-tui (or is a link, a FIFO or a "
                              "device); move it away to write the batch script there")
        # created afresh, never through a link planted at the temporary name
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o755)
        created = True
        with os.fdopen(fd, "w") as f:
            f.write(sbatch_script(recipe, bytes_to_write))
        os.replace(tmp, path)
    except (OSError, ValueError) as exc:
        if created:
            with contextlib.suppress(OSError):
                tmp.unlink()
        raise OutputError(f"{path}: cannot be written ({getattr(exc, 'strerror', None) or exc}); check the "
                          "folder's permissions and free space") from None
    return path
