"""Benchmark: `--export` against DeepSpeed's `convert_zero_checkpoint_to_fp32_state_dict`, in one run.

The bench checkpoint of bench_merge.py (Llama-like, 12 layers, hidden 1024, bf16, 4 ranks; made
once) exported as a plain model in fp32 (as zero_to_fp32 writes it) with its parity recipe
(odd layers from the other checkpoint), against DeepSpeed's own converter of the base writing
safetensors. In turn, several times, after sync: time, peak RSS of the whole process tree, bytes
written. Prints medians and ratios. Goal (issue): at most 1/10 of its peak memory, at least 2x faster.

    python bench/bench_export.py [--repeats 3] [--cache .tailor-cache/bench]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench_merge import bench_run, fresh_work, gib, parity_recipe, size_of
from bench_reshard import TREE

ROOT = Path(__file__).resolve().parent.parent
TAILOR = str(Path(sys.executable).with_name("tailor-tui"))
CONVERT = ("import sys; from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict as c; "
           "c(sys.argv[1], sys.argv[2], tag=sys.argv[3], safe_serialization=True)")


def measure(cmd: list[str]) -> tuple[float, int]:
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", TREE, *cmd], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                          text=True)
    seconds = time.perf_counter() - started
    if proc.returncode != 0:
        raise SystemExit(f"bench: {' '.join(cmd[:4])} failed:\n{proc.stderr[-2000:]}")
    tree = next(int(line.split()[3]) for line in proc.stderr.splitlines() if line.startswith("tree peak RSS:"))
    return seconds, tree


def in_turn(commands: dict[str, list[str]], repeats: int, out: Path, written=None):
    """Each command in turn, `repeats` times, each after `out` is removed and `sync`: ({name: [seconds]},
    {name: peak RSS of its process tree}, {name: what `written(out)` said after it, where given})."""
    times: dict[str, list[float]] = {k: [] for k in commands}
    peaks = dict.fromkeys(commands, 0)
    sizes = dict.fromkeys(commands, 0)
    for i in range(repeats):
        for name, cmd in commands.items():
            shutil.rmtree(out, ignore_errors=True)
            out.parent.mkdir(parents=True, exist_ok=True)
            subprocess.run(["sync"])
            time.sleep(1)
            seconds, peak = measure(cmd)
            times[name].append(seconds)
            peaks[name] = max(peaks[name], peak)
            sizes[name] = written(out) if written else 0
            print(f"  run {i + 1}: {name:<40} {seconds:6.2f} s", flush=True)
    return times, peaks, sizes


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cache", type=Path, default=ROOT / ".tailor-cache" / "bench")
    args = ap.parse_args()
    run = bench_run(args.cache)
    base, source = run / "global_step2", run / "global_step1"
    work = fresh_work(args.cache, "work-export")
    out = work / "out"
    recipe = work / "parity.yaml"
    parity_recipe(recipe, base, source, work / "unused")
    convert = [sys.executable, "-c", CONVERT, str(run), str(out), base.name]
    export = [TAILOR, "--export", str(recipe), "--to", str(out), "--dtype", "fp32"]
    commands = {  # zero_to_fp32 does not fsync what it writes; tailor-tui does unless --no-fsync
        "zero_to_fp32": convert,
        "zero_to_fp32; sync": ["sh", "-c", " ".join(f"'{c}'" for c in convert) + " && sync"],
        "--export": export,
        "--export --no-fsync": [*export, "--no-fsync"],
    }
    times, peaks, written = in_turn(commands, args.repeats, out, size_of)
    shutil.rmtree(work, ignore_errors=True)
    ref_t, ref_m = statistics.median(times["zero_to_fp32"]), peaks["zero_to_fp32"]
    synced = statistics.median(times["zero_to_fp32; sync"])
    print(f"\nbase: {base} ({gib(size_of(base))}, 4 ranks); {args.repeats} runs each, in turn, after sync")
    print(f"{'':<20} {'median':>7}  {'vs zero_to_fp32':>15}  {'vs ...; sync':>12}  {'peak RSS':>9}  "
          f"{'vs zero_to_fp32':>15}  written")
    for name, t in times.items():
        med = statistics.median(t)
        print(f"{name:<20} {med:6.2f} s  {med / ref_t:14.2f}x  {med / synced:11.2f}x  {gib(peaks[name]):>9}  "
              f"{peaks[name] / ref_m:14.3f}x  {gib(written[name])}")
    print("goal: --export at most 1/10 of zero_to_fp32's peak memory and at least 2x faster (fsynced: compare "
          "with zero_to_fp32; sync, --no-fsync with zero_to_fp32)")


if __name__ == "__main__":
    main()
