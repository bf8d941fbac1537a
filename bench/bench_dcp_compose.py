"""Benchmark: `--apply` of a recipe of PyTorch Distributed Checkpoints (heal a run per row) against `cp -r` of the
base, and `--verify` of it against `cat` of what it reads, in one run.

The bench checkpoint of bench_merge.py (Llama-like, 12 layers, hidden 1024, 4 ranks; made once) and its
other save exported once each as DCP checkpoints (`--export --format dcp`: fp32 weights and both Adam
moments, 2.3 GiB each), then composed with the parity recipe (odd layers from the other save). In turn,
several times, after sync: time and peak RSS; medians and ratios.

    python bench/bench_dcp_compose.py [--repeats 3] [--cache .tailor-cache/bench]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

from bench_export import in_turn, measure
from bench_merge import bench_run, fresh_work, gib, parity_recipe, size_of

ROOT = Path(__file__).resolve().parent.parent
TAILOR = str(Path(sys.executable).with_name("tailor-tui"))


def as_dcp(cache: Path, ckpt: Path) -> Path:
    """`ckpt` exported once as a DCP checkpoint under `cache`."""
    out = cache / "dcp" / ckpt.name
    if not (out / ".metadata").is_file():
        shutil.rmtree(out, ignore_errors=True)
        out.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run([TAILOR, "--export", str(ckpt), "--to", str(out), "--format", "dcp", "--no-fsync",
                        "--progress", "lines"], check=True, stderr=subprocess.DEVNULL)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cache", type=Path, default=ROOT / ".tailor-cache" / "bench")
    args = ap.parse_args()
    run = bench_run(args.cache)
    base, source = as_dcp(args.cache, run / "global_step2"), as_dcp(args.cache, run / "global_step1")
    work = fresh_work(args.cache, "work-dcp-compose")
    out = work / "out"
    recipe = work / "parity.yaml"
    parity_recipe(recipe, base, source, out)
    apply = [TAILOR, "--apply", str(recipe), "--progress", "lines"]
    commands = {
        "cp -r; sync": ["sh", "-c", f"cp -r '{base}' '{out}' && sync"],
        "--apply": apply,
        "--apply --no-fsync": [*apply, "--no-fsync"],
    }
    times, peaks, _ = in_turn(commands, args.repeats, out)
    files = [str(p) for folder in (out, base, source) for p in folder.glob("*.distcp")]
    reads = {"cat of output, base, source": ["sh", "-c", "cat " + " ".join(f"'{f}'" for f in files) + " > /dev/null"],
             "--verify": [TAILOR, "--verify", str(recipe)]}
    for name, cmd in reads.items():  # the output --apply left, page cache warm
        times[name], peaks[name] = [], 0
        for i in range(args.repeats):
            seconds, peak = measure(cmd)
            times[name].append(seconds)
            peaks[name] = max(peaks[name], peak)
            print(f"  run {i + 1}: {name:<40} {seconds:6.2f} s", flush=True)
    shutil.rmtree(work, ignore_errors=True)
    ref, cat = statistics.median(times["cp -r; sync"]), statistics.median(times["cat of output, base, source"])
    print(f"\nbase: {base} ({gib(size_of(base))}, a DCP export of 4 ranks); parity recipe; {args.repeats} runs each")
    print(f"{'':<28} {'median':>7}  {'vs cp -r':>8}  {'vs cat':>7}  {'peak RSS':>9}")
    for name, t in times.items():
        med = statistics.median(t)
        print(f"{name:<28} {med:6.2f} s  {med / ref:7.2f}x  {med / cat:6.2f}x  {gib(peaks[name]):>9}")


if __name__ == "__main__":
    main()
