"""Benchmark: `--export X --format dcp` against `cp -r` of the checkpoint and against DeepSpeed's
zero_to_fp32 followed by torch's `torch_save_to_dcp` (which carry the weights only), in one run.

The bench checkpoint of bench_merge.py (Llama-like, 12 layers, hidden 1024, bf16, 4 ranks; made once)
exported with its parity recipe (odd layers from the other checkpoint) as a PyTorch Distributed
Checkpoint: fp32 weights, both Adam moments and the step, per parameter. In turn, several times, after
sync: time, peak RSS of the whole process tree, bytes written; medians and ratios. Goals (issue 61):
time at most 1.5x `cp -r` of the source, peak memory at most 2x the largest row's fp32 weights and moments
+ 200 MiB.

    python bench/bench_dcp.py [--repeats 3] [--cache .tailor-cache/bench]
"""

from __future__ import annotations

import argparse
import math
import shutil
import statistics
import sys
from pathlib import Path

from bench_export import in_turn
from bench_merge import bench_run, fresh_work, gib, parity_recipe, size_of

ROOT = Path(__file__).resolve().parent.parent
TAILOR = str(Path(sys.executable).with_name("tailor-tui"))
# DeepSpeed's converter to one torch file, then torch's own converter of a torch file to DCP: weights only
TO_DCP = ("import sys; from pathlib import Path; "
          "from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict as c; "
          "from torch.distributed.checkpoint.format_utils import torch_save_to_dcp as d; "
          "out = Path(sys.argv[2]); c(sys.argv[1], str(out / 'bin'), tag=sys.argv[3], max_shard_size='1000GB', "
          "safe_serialization=False); d(str(out / 'bin' / 'pytorch_model.bin'), str(out / 'dcp'))")


def largest_row(base: Path) -> int:
    """Bytes of the largest row's fp32 weights and two moments."""
    from tailor_tui.checkpoints.checkpoint import open_checkpoint

    ckpt = open_checkpoint(base)
    sizes = {n: s for g in ckpt.layout.groups for n, s in g}
    numel = max(sum(math.prod(sizes[p]) for p in row.params if p in sizes) for row in ckpt.rows)
    return numel * 12


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cache", type=Path, default=ROOT / ".tailor-cache" / "bench")
    args = ap.parse_args()
    run = bench_run(args.cache)
    base, source = run / "global_step2", run / "global_step1"
    work = fresh_work(args.cache, "work-dcp")
    out = work / "out"
    recipe = work / "parity.yaml"
    parity_recipe(recipe, base, source, work / "unused")
    export = [TAILOR, "--export", str(recipe), "--to", str(out), "--format", "dcp", "--progress", "lines"]
    commands = {
        "cp -r; sync": ["sh", "-c", f"cp -r '{base}' '{out}' && sync"],
        "--format dcp": export,
        "--format dcp --no-fsync": [*export, "--no-fsync"],
        "zero_to_fp32 + torch_save_to_dcp; sync": ["sh", "-c", f"'{sys.executable}' -c \"{TO_DCP}\" '{run}' '{out}' "
                                                               f"'{base.name}' && sync"],
    }
    times, peaks, written = in_turn(commands, args.repeats, out,
                                    lambda out: size_of(out / "dcp") if (out / "dcp").is_dir() else size_of(out))
    shutil.rmtree(work, ignore_errors=True)
    ref = statistics.median(times["cp -r; sync"])
    row = largest_row(base)
    print(f"\nbase: {base} ({gib(size_of(base))}, 4 ranks); largest row's fp32 weights and moments {gib(row)}; "
          f"{args.repeats} runs each, in turn, after sync")
    print(f"{'':<40} {'median':>7}  {'vs cp -r':>8}  {'peak RSS':>9}  written")
    for name, t in times.items():
        med = statistics.median(t)
        print(f"{name:<40} {med:6.2f} s  {med / ref:7.2f}x  {gib(peaks[name]):>9}  {gib(written[name])}")
    print(f"goal: --format dcp at most 1.5x cp -r; peak RSS at most 2 x {gib(row)} + 200 MiB "
          f"= {gib(2 * row + (200 << 20))}")


if __name__ == "__main__":
    main()
