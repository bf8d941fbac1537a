"""Benchmark: `tailor-tui --apply` against `cp -r` of the base's tag folder, in one run.

Makes (once, cached) a real DeepSpeed ZeRO-3 run on CPU — Llama-like, 12 layers, hidden
1024, MLP 2816, vocab 32000, bf16, 4 ranks, checkpoints at steps 1 and 2 (about 2.4 GiB
each) — then times, several times in turn on the same disk: cp -r of the base tag folder,
cp -r followed by sync (tailor-tui fsyncs what it writes), tailor-tui --apply with a parity
recipe (odd layers from step 1), the same with --no-fsync (like cp, no fsync), and the naive merge
(whole-file torch.load/torch.save). Prints medians, ratios to cp, throughput and peak RSS.

    python bench/bench_merge.py [--repeats 3] [--cache .tailor-cache/bench]
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

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # the tests' real runs (tests/runs.py)

from runs import RunSpec, make_run  # noqa: E402

SPEC = RunSpec(world_size=4, dtype="bf16", layout="deepspeed", layers=12, hidden=1024,
               intermediate=2816, vocab=32000, steps=2, save_every=1)


def timed(cmd: list[str]) -> tuple[float, int]:
    """(seconds, peak RSS in bytes of the command and its children)."""
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    _, err = proc.communicate()
    seconds = time.perf_counter() - started
    if proc.returncode != 0:
        raise SystemExit(f"bench: {' '.join(cmd[:3])} failed:\n{err[-2000:]}")
    peak = 0
    for line in err.splitlines():  # tailor-tui reports its workers' peak RSS
        if line.startswith("peak RSS:"):
            peak = int(line.split()[2])
    return seconds, peak


# the bench checkpoint, made by this bench and used by the others
BENCH_RUN = "llama12-h1024-w4-bf16"


def bench_run(cache: Path) -> Path:
    """The bench checkpoint's run folder under `cache`; the other benches need it made."""
    run = cache / BENCH_RUN
    if not (run / "tailor_demo_spec.json").is_file():
        raise SystemExit(f"bench: {run} is missing; run bench/bench_merge.py once to make it")
    return run


def fresh_work(cache: Path, name: str) -> Path:
    """An empty work folder `name` under `cache`."""
    work = cache / name
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    return work


def parity_recipe(path: Path, base: Path, source: Path, output: Path) -> list[str]:
    """Write the benches' recipe to `path`: every odd layer from `source`, the rest from `base`;
    returns those layers."""
    odd = [f"layers.{i}" for i in range(1, SPEC.layers, 2)]
    path.write_text(f"version: 1\nbase: {base}\noutput: {output}\nlayers:\n"
                    + "".join(f"  {r}: {source}\n" for r in odd))
    return odd


def as_installed(root: Path = ROOT) -> None:
    """Compile the bytecode of tailor-tui (the checkout at `root`), as `pip install` does: run from a
    checkout where PYTHONDONTWRITEBYTECODE is set (this VM sets it), every command would compile each
    module it imports again (~0.1 s of its start), which an installed copy never does."""
    import compileall

    compileall.compile_dir(root / "tailor_tui", quiet=1)


def size_of(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cache", type=Path, default=ROOT / ".tailor-cache" / "bench")
    ap.add_argument("--workers", default=None, help="tailor-tui --workers (default: its own choice)")
    args = ap.parse_args()

    as_installed()
    run = args.cache / BENCH_RUN
    if not (run / "tailor_demo_spec.json").is_file():
        print(f"making the real ZeRO-3 run in {run} (once; minutes)…", flush=True)
        shutil.rmtree(run, ignore_errors=True)
        make_run(run, SPEC)
    base, source = run / "global_step2", run / "global_step1"
    work = fresh_work(args.cache, "work")
    recipe = work / "parity.yaml"
    odd = parity_recipe(recipe, base, source, work / "out")
    tailor = [str(Path(sys.executable).with_name("tailor-tui")), "--apply", str(recipe), "--report-peak-rss"]
    if args.workers:
        tailor += ["--workers", args.workers]
    commands = {
        "cp -r": ["cp", "-r", str(base), str(work / "out")],
        # tailor-tui fsyncs its output before renaming it into place; cp does not
        "cp -r; sync": ["sh", "-c", f'cp -r "{base}" "{work / "out"}" && sync'],
        "tailor-tui --apply": tailor,
        # like cp: the output is left in the page cache (still atomic against a killed process)
        "--apply --no-fsync": [*tailor, "--no-fsync"],
        "naive merge": [sys.executable, str(ROOT / "bench" / "naive_merge.py"), str(base), str(source),
                        str(work / "out"), *odd],
    }
    times: dict[str, list[float]] = {k: [] for k in commands}
    peaks: dict[str, int] = {k: 0 for k in commands}
    total = size_of(base)
    for i in range(args.repeats):
        for name, cmd in commands.items():
            shutil.rmtree(work / "out", ignore_errors=True)
            subprocess.run(["sync"])
            time.sleep(1)  # let the file system finish freeing (discard) the removed output
            seconds, peak = timed(cmd)
            times[name].append(seconds)
            peaks[name] = max(peaks[name], peak)
            print(f"  run {i + 1}: {name:<20} {seconds:6.2f} s", flush=True)
    shutil.rmtree(work / "out", ignore_errors=True)

    cp, cp_best = statistics.median(times["cp -r"]), min(times["cp -r"])
    largest_rank_file = max(f.stat().st_size for f in base.glob("*optim_states.pt"))
    print(f"\nbase tag folder: {gib(total)}, {SPEC.world_size} ranks, largest rank file {gib(largest_rank_file)}; "
          f"parity recipe ({len(odd)} of {SPEC.layers} layers from another checkpoint); "
          f"{args.repeats} runs each; {os.cpu_count()} cores")
    # A shared VM disk is noisy (cp -r alone varies 2x between runs): medians and best runs both
    # The disk's pace drifts during a run: each round's time over that round's cp -r is shown too
    print(f"{'':<20} {'median':>7}  {'ratio':>8}  {'best':>6}  {'ratio':>8}  {'per round':>9}  throughput (median)")
    for name, t in times.items():
        med, best = statistics.median(t), min(t)
        rounds = statistics.median(a / c for a, c in zip(t, times["cp -r"]))
        synced = statistics.median(a / c for a, c in zip(t, times["cp -r; sync"]))
        rss = f", peak worker RSS {gib(peaks[name])}" if peaks[name] else ""
        print(f"{name:<20} {med:6.2f} s  {med / cp:5.2f}x cp  {best:5.2f} s  {best / cp_best:5.2f}x cp  "
              f"{rounds:5.2f}x cp  {gib(total / med)}/s{rss}"
              + (f"; {synced:.2f}x cp;sync per round" if name == "tailor-tui --apply" else ""))

if __name__ == "__main__":
    main()
