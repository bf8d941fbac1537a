"""Benchmark: resharding (`tailor-tui --apply --world-size M`) against `cp -r` of the base, in one run.

The bench checkpoint of bench_merge.py (Llama-like, 12 layers, hidden 1024, bf16, 4 ranks, about
2.4 GiB per checkpoint; made once) is resharded 4 -> 2 and 4 -> 8 ranks. In turn, several times
on the same disk: cp -r of the base tag folder (the yardstick), cp -r followed by sync (tailor-tui
fsyncs what it writes), the two reshards (fsynced, the default), and DeepSpeed's own answer to a
new world size, `ds_to_universal` on the same checkpoint (it writes the universal checkpoint that
`load_universal` reads, with its default workers). Prints medians and their ratios to cp -r, the
peak RSS of tailor-tui's workers and of each command's whole process tree, and bytes written.

    python bench/bench_reshard.py [--repeats 3] [--cache .tailor-cache/bench]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench_merge import bench_run, fresh_work, gib, size_of

ROOT = Path(__file__).resolve().parent.parent
TAILOR = str(Path(sys.executable).with_name("tailor-tui"))

# Runs a command and reports the largest peak RSS among it and every descendant it waited for.
TREE = ("import resource, subprocess, sys; done = subprocess.run(sys.argv[1:]); "
        "print(f'tree peak RSS: {resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024}', file=sys.stderr); "
        "sys.exit(done.returncode)")


def measure(cmd: list[str]) -> tuple[float, int, int]:
    """(seconds, tailor-tui's workers' peak RSS or 0, the process tree's peak RSS) of `cmd`."""
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", TREE, *cmd], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                          text=True)
    seconds = time.perf_counter() - started
    if proc.returncode != 0:
        raise SystemExit(f"bench: {' '.join(cmd[:4])} failed:\n{proc.stderr[-2000:]}")
    workers = tree = 0
    for line in proc.stderr.splitlines():
        if line.startswith("peak RSS:"):
            workers = int(line.split()[2])
        elif line.startswith("tree peak RSS:"):
            tree = int(line.split()[3])
    return seconds, workers, tree


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cache", type=Path, default=ROOT / ".tailor-cache" / "bench")
    args = ap.parse_args()
    base = bench_run(args.cache) / "global_step2"
    work = fresh_work(args.cache, "work-reshard")
    out = work / "out"
    recipe = work / "reshard.yaml"
    recipe.write_text(f"version: 1\nbase: {base}\noutput: {out}\n")
    tailor = [TAILOR, "--apply", str(recipe), "--report-peak-rss"]
    commands = {
        "cp -r": ["cp", "-r", str(base), str(out)],
        "cp -r; sync": ["sh", "-c", f'cp -r "{base}" "{out}" && sync'],
        "tailor-tui 4 -> 2": [*tailor, "--world-size", "2"],
        "tailor-tui 4 -> 8": [*tailor, "--world-size", "8"],
        # like cp: the output is left in the page cache (still atomic against a killed process)
        "4 -> 2 --no-fsync": [*tailor, "--world-size", "2", "--no-fsync"],
        "ds_to_universal": [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                            str(base), "--output_folder", str(out)],
    }
    times: dict[str, list[float]] = {k: [] for k in commands}
    workers = dict.fromkeys(commands, 0)
    trees = dict.fromkeys(commands, 0)
    written = dict.fromkeys(commands, 0)
    for i in range(args.repeats):
        for name, cmd in commands.items():
            shutil.rmtree(out, ignore_errors=True)
            subprocess.run(["sync"])
            time.sleep(1)  # let the file system finish freeing the removed output
            seconds, worker_peak, tree_peak = measure(cmd)
            times[name].append(seconds)
            workers[name] = max(workers[name], worker_peak)
            trees[name] = max(trees[name], tree_peak)
            written[name] = size_of(out)
            print(f"  run {i + 1}: {name:<18} {seconds:6.2f} s", flush=True)
    shutil.rmtree(work, ignore_errors=True)

    cp, synced = statistics.median(times["cp -r"]), statistics.median(times["cp -r; sync"])
    print(f"\nbase: {base} ({gib(size_of(base))}, 4 ranks); {args.repeats} runs each, in turn; "
          f"{os.cpu_count()} cores")
    print(f"{'':<18} {'median':>7}  {'ratio':>8}  {'ratio':>15}  {'written':>10}  {'peak RSS: workers':>17}  "
          f"{'process tree':>12}")
    for name, t in times.items():
        med = statistics.median(t)
        worker = gib(workers[name]) if workers[name] else "-"
        print(f"{name:<18} {med:6.2f} s  {med / cp:5.2f}x cp  {med / synced:5.2f}x cp; sync  "
              f"{gib(written[name]):>10}  {worker:>17}  {gib(trees[name]):>12}")
    print("targets: a reshard within 1.5x of cp -r; peak RSS per worker <= 64 MiB. tailor-tui fsyncs its output "
          "(compare with cp -r; sync) unless --no-fsync (compare with cp -r)")


if __name__ == "__main__":
    main()
