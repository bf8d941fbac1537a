"""Benchmark: `tailor-tui --verify` against `cat` of the bytes it needs, in one run, and its peak RSS.

Three real ZeRO-3 compositions, each verified several times in turn with `cat` of the same bytes (the output's
tag folder, the base's and each source's: every byte a verifier could need, read once), page cache warm:

- the bench checkpoint (bench_merge.py: 12 layers, hidden 1024, bf16, 4 ranks of 593 MiB; 2.3 GiB), a recipe
  taking every other layer and the embeddings from the older save, composed without cloning;
- the same run resharded to 2 ranks (rank files of 1.2 GiB, made once by tailor-tui --world-size 2): the
  same bytes in files twice the size, so the peak RSS shows whether it grows with the rank files;
- the wide run of bench_wide.py (80 layers, 256 ranks: 1,024 small files per checkpoint), rows from three
  checkpoints; `wide-large` (not run by default: 11 GiB of runs to make once): the same 80 layers and 256 ranks,
  hidden 384 instead of 8, the same recipe: as many rank files, slots and claims, each holding thousands of
  times the bytes; what is left of the ratio at the wide run's few bytes is a cost per slot, not per byte;
- `xfs` (root, xfsprogs): the bench checkpoint copied onto a loop-mounted XFS with reflink and composed there as
  `--apply` does by default, its kept bytes clones of the base's (sharing their blocks), measured warm and with
  the page cache emptied before each command (cold). A clone is no evidence: the verifier reads and compares
  every byte as anywhere else.

Prints medians, the ratio --verify / cat, and the peak RSS of the verifying process (wait4's: its threads
included, the largest process there is). `py read`, the least any verifier in Python takes: a process that
imports what `--verify` imports and reads every file cat reads once, a buffer at a time, checking nothing (on a
run of small files, such as the wide run's 0.09 GiB, that alone is over cat's time: a cost per process and per
file, not per byte).

    python bench/bench_verify.py [--repeats 3] [--cache .tailor-cache/bench] [--only big half wide wide-large xfs]
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests"))  # (the loop-mounted XFS of the tests: scratch_xfs)

from bench_clone import drop_page_cache  # noqa: E402
from bench_merge import SPEC as BIG  # noqa: E402
from bench_merge import as_installed, bench_run  # noqa: E402
from bench_wide import MEASURE, TAGS, narrow_run, recipe_of, wide_run  # noqa: E402

TAILOR = str(Path(sys.executable).with_name("tailor-tui"))
LARGE_HIDDEN = 384  # `wide-large`: the wide run's 80 layers and 256 ranks, each layer 2,300 times the bytes
PY_READ = ("import os, sys\n"
           "import tailor_tui.cli.main, tailor_tui.verifying.against_recipe\n"
           "from tailor_tui.checked.ranges import READ_CHUNK\n"
           "buffer = [bytearray(READ_CHUNK)]\n"
           "for path in sys.argv[1:]:\n"
           "    fd = os.open(path, os.O_RDONLY)\n"
           "    while os.readv(fd, buffer):\n"
           "        pass\n"
           "    os.close(fd)\n")


def measured(cmd: list) -> tuple[float, int]:
    """(seconds, peak RSS in bytes of the command's process) of `cmd`, which must succeed."""
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", MEASURE, *map(str, cmd)], capture_output=True, text=True)
    seconds = time.perf_counter() - started
    if proc.returncode != 0:
        raise SystemExit(f"bench: {' '.join(map(str, cmd[:3]))} failed:\n{proc.stderr}")
    return seconds, int(proc.stdout.split()[-1])


def parity(folder: Path, base: Path, older: Path, name: str) -> Path:
    """Every other layer and the embeddings from `older`, the rest `base`'s: the recipe the issue measured."""
    recipe = folder / f"{name}.yaml"
    rows = [f"layers.{i}" for i in range(1, BIG.layers, 2)] + ["embed_tokens"]
    recipe.write_text(f"version: 1\nbase: {base}\noutput: {folder / name}\nlayers:\n"
                      + "".join(f"  {row}: {older}\n" for row in rows))
    return recipe


def halved(cache: Path, run: Path) -> Path:
    """The bench run's two checkpoints resharded to 2 ranks (made once)."""
    half, run = (cache / "llama12-h1024-w2-bf16").resolve(), run.resolve()
    if (half / "latest").is_file():
        return half
    print(f"resharding the bench run into 2 ranks in {half} (once)…", flush=True)
    shutil.rmtree(half, ignore_errors=True)
    half.mkdir(parents=True)
    for tag in ("global_step1", "global_step2"):
        recipe = half / f"{tag}.yaml"
        recipe.write_text(f"version: 1\nbase: {run / tag}\noutput: {half / 'made'}\n")
        subprocess.run([TAILOR, "--apply", recipe, "--world-size", "2", "--no-fsync"], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        shutil.move(half / "made" / tag, half / tag)
        shutil.rmtree(half / "made")
        recipe.unlink()
    (half / "latest").write_text("global_step2")
    return half


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cache", type=Path, default=ROOT / ".tailor-cache" / "bench")
    ap.add_argument("--only", nargs="+", choices=("big", "half", "wide", "wide-large", "xfs"),
                    default=["big", "half", "wide"])
    args = ap.parse_args()
    with contextlib.ExitStack() as stack:
        _bench(args, stack)


def _bench(args, stack: contextlib.ExitStack) -> None:
    as_installed()
    work = args.cache / "verify-work"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    cases: dict[str, tuple[Path, list[Path]]] = {}  # name -> (recipe, folders cat reads)
    cold: set[str] = set()  # cases measured cold too
    if "xfs" in args.only:
        from scratch_xfs import loop_xfs, unavailable

        if (why := unavailable()) is not None:
            raise SystemExit(f"bench: cannot mount a loop XFS: {why}")
        xfs = stack.enter_context(loop_xfs(work / "xfs.img", work / "xfs", size=16 << 30))
        print(f"copying the bench run onto {xfs} (byte by byte)…", flush=True)
        subprocess.run(["cp", "-r", "--reflink=never", str(bench_run(args.cache).resolve()), str(xfs / "run")],
                       check=True)
        base, older = xfs / "run" / "global_step2", xfs / "run" / "global_step1"
        recipe = parity(xfs, base, older, "clone")
        name = f"xfs, cloned: {_sizes(base)}"
        cases[name] = (recipe, [xfs / "clone" / "global_step2", base, older])
        cold.add(name)
    if "big" in args.only or "half" in args.only:
        run = bench_run(args.cache)
        runs = {"big": run} | ({"half": halved(args.cache, run)} if "half" in args.only else {})
        for name, found in runs.items():
            if name in args.only:
                base, older = found / "global_step2", found / "global_step1"
                recipe = parity(work, base, older, name)
                cases[f"{name}: {_sizes(base)}"] = (recipe, [work / name / "global_step2", base, older])
    for name, hidden in (("wide", 8), ("wide-large", LARGE_HIDDEN)):
        if name in args.only:
            run = wide_run(args.cache, narrow_run(args.cache, hidden), 256, hidden)
            recipe = recipe_of(run, work, name)
            cases[f"{name}: {_sizes(run / TAGS[-1])}"] = (recipe, [work / name / TAGS[-1], *(run / tag for tag in TAGS)])
    for recipe, _folders in cases.values():
        subprocess.run([TAILOR, "--apply", recipe, "--no-fsync"], check=True, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL)
    read = {name: sorted(f for folder in folders for f in folder.rglob("*") if f.is_file())
            for name, (_recipe, folders) in cases.items()}
    rows: dict[tuple[str, str], list[tuple[float, int]]] = {}
    for _ in range(args.repeats):
        for name, (recipe, _folders) in cases.items():
            rows.setdefault((name, "cat"), []).append(
                measured(["sh", "-c", 'cat "$@" > /dev/null', "cat", *read[name]]))
            rows.setdefault((name, "py read"), []).append(measured([sys.executable, "-c", PY_READ, *read[name]]))
            rows.setdefault((name, "--verify"), []).append(measured([TAILOR, "--verify", recipe]))
    for _ in range(args.repeats):  # (after every warm round: a page cache emptied leaves the next command cold)
        for name in sorted(cold):
            recipe = cases[name][0]
            drop_page_cache()
            rows.setdefault((f"{name} (cold)", "cat"), []).append(
                measured(["sh", "-c", 'cat "$@" > /dev/null', "cat", *read[name]]))
            drop_page_cache()
            rows.setdefault((f"{name} (cold)", "--verify"), []).append(measured([TAILOR, "--verify", recipe]))
    sizes = {name: sum(f.stat().st_size for f in files) for name, files in read.items()}
    shutil.rmtree(work, ignore_errors=True)
    print(f"\nwarm page cache, medians of {args.repeats}; cat: every file of the output and of the checkpoints "
          "it was composed from")
    print(f"{'composition':<52} {'cat s':>7} {'--verify s':>10} {'ratio':>7} {'GiB/s':>7} {'peak RSS MiB':>13} "
          f"{'py read s':>10} {'ratio':>7}")
    for name in [*cases, *(f"{name} (cold)" for name in cases if name in cold)]:
        cat = statistics.median(s for s, _p in rows[(name, "cat")])
        verify = statistics.median(s for s, _p in rows[(name, "--verify")])
        peak = max(p for _s, p in rows[(name, "--verify")])
        total = sizes[name.removesuffix(" (cold)")]
        py_read = statistics.median(s for s, _p in rows[(name, "py read")]) if (name, "py read") in rows else None
        floor = "" if py_read is None else f" {py_read:>10.2f} {py_read / cat:>6.2f}x"  # (not measured cold)
        print(f"{name:<52} {cat:>7.2f} {verify:>10.2f} {verify / cat:>6.2f}x "
              f"{total / 2**30 / verify:>7.2f} {peak / 2**20:>13.0f}{floor}")


def _sizes(tag: Path) -> str:
    files = [f for f in tag.iterdir() if f.name.endswith("optim_states.pt")]
    total = sum(f.stat().st_size for f in tag.iterdir() if f.is_file())
    return f"{len(files)} ranks, rank files {max(f.stat().st_size for f in files) / 2**20:,.0f} MiB, " \
           f"{total / 2**30:.2f} GiB"


if __name__ == "__main__":
    main()
