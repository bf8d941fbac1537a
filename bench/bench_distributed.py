"""Benchmark: one `--apply` job over 1, 2 and 4 processes, against `cp -r` of the base, in one run.

The bench checkpoint of bench_merge.py (Llama-like, 12 layers, hidden 1024, bf16, 4 ranks, about
2.3 GiB per checkpoint; made once) is composed with its parity recipe (odd layers from the other
checkpoint) as one process, and as a job of 2 and of 4 processes started the way srun starts them
(the environment srun sets, every process on this machine: one worker each). In turn, several
times: cp -r then sync (the yardstick: tailor-tui fsyncs), then each. Prints medians, their ratios,
and each process's throughput, from which docs/performance.md estimates a 1 TB, 512-rank composition.

    python bench/bench_distributed.py [--repeats 3] [--cache .tailor-cache/bench]
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench_merge import bench_run, fresh_work, gib, parity_recipe, size_of

ROOT = Path(__file__).resolve().parent.parent
TAILOR = str(Path(sys.executable).with_name("tailor-tui"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def job(recipe: Path, processes: int) -> float:
    """Seconds for a job of `processes` Slurm-style tasks (one process: no launcher at all)."""
    port = str(free_port())
    started = time.perf_counter()
    if processes == 1:
        tasks = [subprocess.Popen([TAILOR, "--apply", str(recipe)], stdout=subprocess.DEVNULL,
                                  stderr=subprocess.PIPE, text=True)]
    else:
        tasks = [subprocess.Popen([TAILOR, "--apply", str(recipe), "--workers", "1"], stdout=subprocess.DEVNULL,
                                  stderr=subprocess.PIPE, text=True,
                                  env={**os.environ, "SLURM_PROCID": str(p), "SLURM_NTASKS": str(processes),
                                       "SLURM_JOB_ID": "1", "SLURM_STEP_NODELIST": "localhost",
                                       "MASTER_PORT": port})
                 for p in range(processes)]
    errors = [t.communicate()[1] for t in tasks]
    seconds = time.perf_counter() - started
    if any(t.returncode for t in tasks):
        raise SystemExit(f"bench: a job of {processes} failed:\n" + "\n".join(e[-1500:] for e in errors))
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cache", type=Path, default=ROOT / ".tailor-cache" / "bench")
    args = ap.parse_args()
    run = bench_run(args.cache)
    base, source = run / "global_step2", run / "global_step1"
    work = fresh_work(args.cache, "work-distributed")
    out = work / "out"
    recipe = work / "parity.yaml"
    parity_recipe(recipe, base, source, out)
    names = ["cp -r; sync", "1 process", "2 processes", "4 processes"]
    times: dict[str, list[float]] = {n: [] for n in names}
    for i in range(args.repeats):
        for name in names:
            shutil.rmtree(out, ignore_errors=True)
            subprocess.run(["sync"])
            time.sleep(1)
            if name == "cp -r; sync":
                started = time.perf_counter()
                subprocess.run(["sh", "-c", f'cp -r "{base}" "{out}" && sync'], check=True)
                seconds = time.perf_counter() - started
            else:
                seconds = job(recipe, int(name.split()[0]))
            times[name].append(seconds)
            print(f"  run {i + 1}: {name:<12} {seconds:6.2f} s", flush=True)
    written = size_of(out)
    shutil.rmtree(work, ignore_errors=True)
    yard, one = statistics.median(times["cp -r; sync"]), statistics.median(times["1 process"])
    print(f"\nbase: {base} ({gib(size_of(base))}, 4 ranks); parity recipe; {args.repeats} runs each, in turn; "
          f"{os.cpu_count()} cores, every process on this machine")
    print(f"{'':<14} {'median':>7}  {'vs cp -r; sync':>14}  {'vs 1 process':>12}  {'per process':>12}")
    for name, t in times.items():
        med = statistics.median(t)
        n = int(name.split()[0]) if name[0].isdigit() else 1
        print(f"{name:<14} {med:6.2f} s  {med / yard:13.2f}x  {med / one:11.2f}x  "
              f"{gib(written / med / n) + '/s':>12}")
    print("one machine's processes share its cores and disk: more processes cannot go faster here; "
          "across nodes each brings its own (docs/cluster.md)")


if __name__ == "__main__":
    main()
