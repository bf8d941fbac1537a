"""Which launcher started this process, and where its processes meet: torchrun or Slurm's srun.

`--apply` runs as one job over many processes when a launcher started it: torchrun sets
`RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`; srun sets `SLURM_PROCID`, `SLURM_NTASKS`,
`SLURM_JOB_ID` and the step's node list. With neither (or `--distributed off`) it is one process.

Under Slurm the processes meet at `MASTER_ADDR` when set, else at the first host of
`SLURM_STEP_NODELIST` (a Slurm hostlist such as `node[01-04,07]`, expanded here; `scontrol` is
not needed), on `MASTER_PORT` when set, else on a port the kernel picks for process 0 (`meet`):
no port an outsider can predict, none two jobs can share.

Torch-free: deciding how to run costs nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

from tailor_tui.errors import UsageError


@dataclass(frozen=True)
class Launch:
    """This process's place in a job of `size` processes meeting at `host`:`port`."""

    rank: int
    size: int
    host: str
    port: int | None  # None: process 0 picks one (Slurm without MASTER_PORT)
    via: str  # "torchrun" or "slurm"
    job: str = ""  # Slurm's job id, or "" under torchrun
    use_env: bool = False  # torchrun: meet through its own store (env://), not a new one


def detect(env, mode: str = "auto") -> Launch | None:
    """The launch this environment describes, or None for one process (`mode` "off", or no
    launcher). A launcher's variables that contradict each other are a UsageError."""
    if mode == "off":
        return None
    if "RANK" in env and "WORLD_SIZE" in env:
        rank, size = _number(env, "RANK"), _number(env, "WORLD_SIZE")
        if "MASTER_ADDR" not in env or "MASTER_PORT" not in env:
            raise UsageError("RANK and WORLD_SIZE are set but MASTER_ADDR or MASTER_PORT is not; start "
                             "tailor-tui with torchrun, or pass --distributed off for one process")
        launch = Launch(rank, size, env["MASTER_ADDR"], _number(env, "MASTER_PORT"), "torchrun", use_env=True)
    elif "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        rank, size = _number(env, "SLURM_PROCID"), _number(env, "SLURM_NTASKS")
        job = env.get("SLURM_JOB_ID", "")
        nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
        if env.get("MASTER_ADDR"):
            host = env["MASTER_ADDR"]
        elif nodes:
            host = expand_hostlist(nodes)[0]
        else:
            raise UsageError("under Slurm but neither MASTER_ADDR nor SLURM_STEP_NODELIST is set: "
                             "cannot tell where the processes meet; set MASTER_ADDR")
        port = _number(env, "MASTER_PORT") if env.get("MASTER_PORT") else None
        launch = Launch(rank, size, host, port, "slurm", job)
    else:
        return None
    if not 0 <= launch.rank < launch.size:
        raise UsageError(f"{launch.via} says this is process {launch.rank} of {launch.size}; "
                         "that cannot be: check the launcher's environment")
    if launch.port is not None and not 0 < launch.port < 65536:
        raise UsageError(f"port {launch.port} is not a TCP port; set MASTER_PORT")
    return launch if launch.size > 1 else None


def _number(env, name: str) -> int:
    try:
        return int(env[name])
    except ValueError:
        raise UsageError(f"{name}={env[name]!r} is not a whole number; check the launcher's environment") from None




def expand_hostlist(text: str) -> list[str]:
    """Slurm's hostlist syntax: `node[01-04,07],gpu5,rack[1-2]-n[1-2]` -> every host name, in order
    (zero padding kept). A UsageError for a list that is not one."""
    hosts: list[str] = []
    for item in _split_top(text.strip()):
        hosts.extend(_expand_one(item, text))
    if not hosts:
        raise UsageError(f"hostlist {text!r} names no host")
    return hosts


def _split_top(text: str) -> list[str]:
    """Split at the commas outside brackets."""
    items, depth, start = [], 0, 0
    for i, c in enumerate(text):
        if c == "[":
            depth += 1
        elif c == "]":
            depth -= 1
        elif c == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
        if depth not in (0, 1):
            raise UsageError(f"hostlist {text!r} has unbalanced brackets")
    if depth:
        raise UsageError(f"hostlist {text!r} has unbalanced brackets")
    items.append(text[start:])
    return [item for item in items if item]


def _expand_one(item: str, whole: str) -> list[str]:
    at = item.find("[")
    if at < 0:
        return [item]
    end = item.index("]", at)
    head, ranges, rest = item[:at], item[at + 1:end], item[end + 1:]
    tails = _expand_one(rest, whole) if rest else [""]
    out: list[str] = []
    for part in ranges.split(","):
        low, _, high = part.partition("-")
        if not (low.isascii() and low.isdigit()) or (high and not (high.isascii() and high.isdigit())):
            raise UsageError(f"hostlist {whole!r}: [{ranges}] is not a list of numbers and ranges")
        width = len(low)
        for n in range(int(low), int(high or low) + 1):
            out.extend(f"{head}{n:0{width}d}{tail}" for tail in tails)
    return out
