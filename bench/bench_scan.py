"""Benchmark: time from start to the grid on a run of 100 checkpoints x 8 ranks.

Makes (once, cached) a real DeepSpeed ZeRO-3 run on CPU with 8 ranks that saves at every
one of 100 steps, then, in a fresh process each time (imports included), measures
`tailor_tui.checkpoints.scan.scan` alone, first with an empty cache (every model_states file read,
the scan cache written) and again from the scan cache, and the composer from start until its
grid is filled (headless Textual app, empty cache). Prints medians of several runs.

    python bench/bench_scan.py [--repeats 5] [--cache .tailor-cache/bench] [--cold]

--cold (root only) drops the page cache before every run: the rank files' metadata and
Python's own imports then come from disk, as on a login node that has never seen the run.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # the tests' real runs (tests/runs.py)

from runs import RunSpec, make_run  # noqa: E402

SPEC = RunSpec(world_size=8, layout="deepspeed", layers=4, hidden=32, steps=100, save_every=1)

SCAN = """
import sys, time
t = time.perf_counter()
from tailor_tui.checkpoints.scan import scan
r = scan(sys.argv[1])
assert len(r.checkpoints) == 100 and not r.problems, (len(r.checkpoints), r.problems[:1])
print(time.perf_counter() - t)
"""

GRID = """
import asyncio, sys, time
t = time.perf_counter()
from tailor_tui.ui.app import make_app

async def main():
    app = make_app(sys.argv[1])
    async with app.run_test(size=(160, 50)) as pilot:
        while app.composition is None or not app.home.query_one("#grid").row_count:
            await pilot.pause(0.01)
        print(time.perf_counter() - t)

asyncio.run(main())
"""


def measure(code: str, run: Path, cold: bool, cache: str | None = None) -> float:
    """Seconds `code` reports; `cache`: tailor-tui's cache folder (default: a new, empty one)."""
    if cold:
        subprocess.run(["sync"], check=True)
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    with tempfile.TemporaryDirectory() as empty:
        env = dict(os.environ, TAILOR_TUI_CACHE=cache or empty)
        out = subprocess.run([sys.executable, "-c", code, str(run)], capture_output=True, text=True, check=True,
                             env=env)
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--cache", type=Path, default=ROOT / ".tailor-cache" / "bench")
    ap.add_argument("--cold", action="store_true", help="drop the page cache before each run (root)")
    args = ap.parse_args()
    if args.cold and os.geteuid() != 0:
        raise SystemExit("bench: --cold needs root (it writes /proc/sys/vm/drop_caches)")
    run = args.cache / "tiny-w8-100-checkpoints"
    if not (run / "tailor_demo_spec.json").is_file():
        print(f"making the real ZeRO-3 run in {run} (once; minutes)…", flush=True)
        shutil.rmtree(run, ignore_errors=True)
        make_run(run, SPEC)
    files = sum(1 for _ in run.rglob("*.pt"))
    scan_times = [measure(SCAN, run, args.cold) for _ in range(args.repeats)]
    with tempfile.TemporaryDirectory() as cache:
        measure(SCAN, run, False, cache)
        cached_times = [measure(SCAN, run, args.cold, cache) for _ in range(args.repeats)]
    grid_times = [measure(GRID, run, args.cold) for _ in range(args.repeats)]
    print(f"100 checkpoints x 8 ranks ({files} rank files); fresh process each time, imports included; "
          f"medians of {args.repeats}; {'cold' if args.cold else 'warm'} page cache")
    print(f"scan(), empty cache           {statistics.median(scan_times):.2f} s")
    print(f"scan() again, from the cache  {statistics.median(cached_times):.2f} s")
    print(f"composer start to full grid   {statistics.median(grid_times):.2f} s   (target: under 2 s)")


if __name__ == "__main__":
    main()
