"""Benchmark: cost per byte, not per rank file. One real run at 2 ranks and the same run at W ranks.

A real DeepSpeed ZeRO-3 run (80 layers, hidden 8, bf16, 2 ranks, checkpoints at steps 2, 4, 6, 8;
made once) is resharded by tailor-tui into W ranks (256, 512), checkpoint by checkpoint, and the
tag folders are put side by side in a save_dir: the same model and checkpoints, saved by W ranks.
Then, in turn, several times, on the 2-rank run and on each W-rank run (everything in page cache):

- `--apply --no-fsync` of a recipe taking rows from three checkpoints (the newest as base; the
  checkpoints scanned once before, as the TUI or an earlier command would have);
- `--stats` with an empty statistics cache (cold: every rank file read);
- `--apply --world-size W` of one checkpoint (the reshard that made the wide run);
- `cp -r` of one checkpoint (the yardstick: the bytes alone).

Prints medians, each W-rank time over the 2-rank one (the issue's targets: --apply and cold
--stats at most 4x at 256 ranks), over cp -r of the same checkpoint, the command's CPU time (its
workers' included: on a shared machine, steadier than its wall time) and its peak RSS.

`--against DIR`: another checkout of tailor-tui (the code before a change, say) is measured in the
same rounds, each command run by one then the other in turn, its rows marked "(against)": the
comparison a busy machine allows. `--only apply stats` leaves the other commands out.

    python bench/bench_wide.py [--ranks 256 512] [--repeats 3] [--cache .tailor-cache/bench]
                               [--against DIR] [--only apply stats reshard]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # the tests' real runs (tests/runs.py)

from bench_merge import as_installed  # noqa: E402
from runs import RunSpec, make_run  # noqa: E402

TAILOR = str(Path(sys.executable).with_name("tailor-tui"))
SPEC = RunSpec(world_size=2, layout="deepspeed", layers=80, hidden=8, steps=8, save_every=2)
TAGS = ("global_step2", "global_step4", "global_step6", "global_step8")

# Runs a command and prints its own peak RSS (wait4's), so a fork of this process is not counted.
MEASURE = ("import os, subprocess, sys\n"
           "p = subprocess.Popen(sys.argv[1:], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)\n"
           "err = p.stderr.read()\n"
           "_pid, status, usage = os.wait4(p.pid, 0)\n"
           "code = os.waitstatus_to_exitcode(status)\n"
           "sys.stderr.write(err.decode(errors='replace')[-3000:] if code else '')\n"
           "print(usage.ru_utime + usage.ru_stime, usage.ru_maxrss * 1024)\n"
           "sys.exit(code)\n")


def measure(cmd: list[str], env: dict | None = None) -> tuple[float, float, int]:
    """(seconds, CPU seconds of it and its workers, peak RSS in bytes) of `cmd`."""
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", MEASURE, *cmd], capture_output=True, text=True,
                          env={**os.environ, **(env or {})})
    seconds = time.perf_counter() - started
    if proc.returncode != 0:
        raise SystemExit(f"bench: {' '.join(map(str, cmd[:4]))} failed:\n{proc.stderr}")
    cpu, peak = proc.stdout.split()[-2:]
    return seconds, float(cpu), int(peak)


def _named(name: str, hidden: int) -> str:
    return name if hidden == SPEC.hidden else f"{name}-h{hidden}"


def narrow_run(cache: Path, hidden: int = SPEC.hidden) -> Path:
    """The real run at 2 ranks (`hidden`: SPEC's model at another width, its own run)."""
    run = cache / _named("wide-run-2", hidden)
    if not (run / "tailor_demo_spec.json").is_file():
        print(f"making the real ZeRO-3 run in {run} (once)…", flush=True)
        shutil.rmtree(run, ignore_errors=True)
        make_run(run, dataclasses.replace(SPEC, hidden=hidden))
    return run


def wide_run(cache: Path, narrow: Path, ranks: int, hidden: int = SPEC.hidden) -> Path:
    """The run's checkpoints resharded into `ranks` ranks, side by side in one save_dir (their
    provenance records left out: to the scan they are the run's own checkpoints)."""
    run = cache / _named(f"wide-run-{ranks}", hidden)
    if (run / "latest").is_file():
        return run
    print(f"resharding the run into {ranks} ranks (once)…", flush=True)
    shutil.rmtree(run, ignore_errors=True)
    run.mkdir(parents=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        for tag in TAGS:
            recipe = Path(tmp) / f"{tag}.yaml"
            recipe.write_text(f"version: 1\nbase: {narrow / tag}\noutput: {Path(tmp) / tag}\n")
            subprocess.run([TAILOR, "--apply", recipe, "--world-size", str(ranks), "--no-fsync"], check=True,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            shutil.move(Path(tmp) / tag / tag, run / tag)
    for script in ("zero_to_fp32.py",):
        if (narrow / script).is_file():
            shutil.copy(narrow / script, run / script)
    (run / "latest").write_text(TAGS[-1])
    return run


def recipe_of(run: Path, folder: Path, name: str) -> Path:
    """Rows from three checkpoints: the newest as base, every third layer from each older one."""
    recipe = folder / f"{name}.yaml"
    lines = ["version: 1", f"base: {run / TAGS[-1]}", f"output: {folder / name}", "layers:"]
    lines += [f"  layers.{i}: {run / TAGS[(i // 3) % 3]}" for i in range(0, SPEC.layers, 3)]
    recipe.write_text("\n".join(lines) + "\n")
    return recipe


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, nargs="+", default=[256, 512])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cache", type=Path, default=ROOT / ".tailor-cache" / "bench")
    ap.add_argument("--against", type=Path, help="another checkout of tailor-tui, measured in the same rounds")
    ap.add_argument("--only", nargs="+", choices=("apply", "stats", "reshard"), default=["apply", "stats", "reshard"])
    args = ap.parse_args()
    as_installed()
    trees = {"": ROOT}
    if args.against is not None:
        as_installed(args.against.resolve())
        trees[" (against)"] = args.against.resolve()
    narrow = narrow_run(args.cache)
    runs = {2: narrow, **{w: wide_run(args.cache, narrow, w) for w in args.ranks}}
    rows: dict[tuple[int, str], list[tuple[float, float, int]]] = {}
    with tempfile.TemporaryDirectory(dir=args.cache) as tmp:
        work = Path(tmp)
        for w, run in runs.items():  # scanned once before, as the TUI or an earlier command would have
            subprocess.run([TAILOR, "--apply", recipe_of(run, work, f"scan-{w}"), "--dry-run"], check=True,
                           stdout=subprocess.DEVNULL)
        for repeat in range(args.repeats):
            for w, run in runs.items():
                out = work / f"out-{w}"
                shutil.rmtree(out, ignore_errors=True)
                out.mkdir()
                started = time.perf_counter()
                subprocess.run(["cp", "-r", run / TAGS[-1], out / "copy"], check=True)
                rows.setdefault((w, "cp -r of one checkpoint"), []).append((time.perf_counter() - started, 0.0, 0))
                for mark, tree in trees.items():
                    code = {"PYTHONPATH": str(tree)}
                    out = work / f"out-{w}{mark.strip(' ()')}"
                    shutil.rmtree(out, ignore_errors=True)
                    out.mkdir()
                    if "apply" in args.only:
                        rows.setdefault((w, "--apply --no-fsync, rows from 3 checkpoints" + mark), []).append(
                            measure([TAILOR, "--apply", recipe_of(run, out, "composed"), "--no-fsync"], code))
                    if "stats" in args.only:
                        rows.setdefault((w, "cold --stats of 4 checkpoints" + mark), []).append(
                            measure([TAILOR, "--stats", run], code | {"TAILOR_TUI_CACHE": str(out / f"stats-{repeat}")}))
                    if w != 2 and "reshard" in args.only:
                        reshard = work / f"reshard-{w}.yaml"
                        reshard.write_text(f"version: 1\nbase: {narrow / TAGS[-1]}\noutput: {out / 'resharded'}\n")
                        rows.setdefault((w, f"--world-size {w} of one checkpoint" + mark), []).append(
                            measure([TAILOR, "--apply", reshard, "--world-size", str(w), "--no-fsync"], code))
    sizes = {w: sum(f.stat().st_size for f in (run / TAGS[-1]).rglob("*") if f.is_file()) for w, run in runs.items()}
    print("\none checkpoint: " + ", ".join(f"{w} ranks {sizes[w] / 2**20:.1f} MiB" for w in runs))
    print(f"{'ranks':>5}  {'what':<56} {'median s':>9} {'vs 2 ranks':>10} {'vs cp -r':>9} {'CPU s':>6} "
          f"{'CPU vs 2':>8} {'peak MiB':>9}")
    for (w, what), samples in sorted(rows.items()):
        median, cpu = (statistics.median(s[i] for s in samples) for i in (0, 1))
        peak = max(s[2] for s in samples)
        narrow_time = statistics.median(s[0] for s in rows[(2, what)]) if (2, what) in rows else None
        narrow_cpu = statistics.median(s[1] for s in rows[(2, what)]) if (2, what) in rows else None
        cp = statistics.median(s[0] for s in rows[(w, "cp -r of one checkpoint")])
        ratio = f"{median / narrow_time:.2f}x" if narrow_time else "—"
        cpu_ratio = f"{cpu / narrow_cpu:.2f}x" if narrow_cpu else "—"
        print(f"{w:>5}  {what:<56} {median:>9.2f} {ratio:>10} {median / cp:>8.1f}x {cpu:>6.2f} {cpu_ratio:>8} "
              f"{peak / 2**20:>9.0f}")


if __name__ == "__main__":
    main()
