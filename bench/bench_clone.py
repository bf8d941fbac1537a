"""Benchmark: what an output costs where the filesystem shares blocks (issue 47), in one run.

As root on Linux with xfsprogs: makes a loop-mounted XFS with reflink (`mkfs.xfs -m reflink=1` on a
sparse file in the cache folder), copies the bench checkpoint onto it (bench_merge's real ZeRO-3
run: 4 ranks, 2.3 GiB a checkpoint; made by `bench/bench_merge.py`), then, several rounds in turn,
measures the new space (`df` after `sync`, before and after) and the time of:

- `cp -r --reflink=never` of the base's tag folder (the yardstick), the same followed by `sync`
  (tailor-tui fsyncs its output: like for like) and `cp -r --reflink=always`; `cat` of the base's files
  (the floor of a verified clone, which reads every byte it keeps once to check its CRC-32);
- `tailor-tui --apply` of a recipe replacing 1 row (layers.5) and of one replacing every row, each
  cloned (the default) and with `--no-clone`; the 1-row recipe cloned both with an empty statistics
  cache (the base's kept rows are read and checked, not written) and after `--stats` of the run (the
  base's kept rows still read once and checked against their CRC-32s, their NaN/Inf not counted again;
  of the source, only the 1 MiB blocks holding the row taken are read, checked against the CRC-32s the
  statistics recorded: the bench checks the log says so; also with `--no-fsync`), each command with a
  cache of its own (since issue 60 `--apply` computes the statistics of the checkpoints it takes from before
  writing, where none are cached: a command's first round does, its later rounds find them);
- on the cache folder's own filesystem (ext4 here: it cannot share blocks), the 1-row recipe both
  ways and `cp -r`: unchanged, within noise;
- on XFS again, `cp -r` (with and without `sync`), the 1-row recipe (before and after `--stats`) and
  the every-row recipe,
  each with the page cache emptied first (`/proc/sys/vm/drop_caches`): cold, as a checkpoint too
  large for a node's memory, or written by other nodes, is read (a warm `cp -r` of 2.3 GiB copies
  memory to memory).

The bytes the 1-row recipe replaces are the plan's (every slice copied from another checkpoint:
fp32 master, exp_avg, exp_avg_sq). Every other round runs the commands in reverse order (a command
right after a large delete runs slower). Prints medians and each round's ratio to that round's cp.

    sudo python bench/bench_clone.py [--repeats 3] [--cache .tailor-cache/bench]
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
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests"))  # (the loop-mounted XFS of the tests: scratch_xfs)

from bench_merge import SPEC, as_installed, bench_run, fresh_work, gib  # noqa: E402
from scratch_xfs import loop_xfs, unavailable  # noqa: E402

ONE_ROW = "layers.5"
# what is also measured with the page cache emptied before each command (on XFS)
COLD = ("xfs: cp -r --reflink=never", "xfs: cp -r --reflink=never; sync", "xfs: cat of the base", "xfs: --apply 1 row",
        "xfs: --apply 1 row, after --stats", "xfs: --apply 1 row, after --stats, --no-fsync", "xfs: --apply every row")
# what an --apply after --stats says: of the source, only the blocks holding the row taken were read
AFTER_STATS = "reading only the sources' blocks the output takes from: "


def used(folder: Path) -> int:
    """Bytes in use on `folder`'s filesystem, once everything written reached it."""
    subprocess.run(["sync"], check=True)
    st = os.statvfs(folder)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def recipe(path: Path, base: Path, source: Path, output: Path, rows: list[str]) -> Path:
    path.write_text(f"version: 1\nbase: {base}\noutput: {output}\nlayers:\n"
                    + "".join(f"  {r}: {source}\n" for r in rows))
    return path


def replaced_bytes(path: Path) -> int:
    """The bytes of rank files the recipe at `path` takes from another checkpoint (its plan's)."""
    from tailor_tui.formats.ds_format import bytes_per_element
    from tailor_tui.planning.build import build_plan
    from tailor_tui.planning.recipe_file import load_recipe

    plan = build_plan(load_recipe(path), check_output=False)
    return sum(c.length * bytes_per_element(job.keys) for job in plan.rank_jobs() for c in job.copies)


def drop_page_cache() -> None:
    """Empty the kernel's page cache (root): every file is read from its disk again, as a checkpoint
    written hours ago by other nodes is on the node that composes it."""
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def measure(cmd: list[str], out: Path, on: Path, env: dict, expect: str | None = None,
            cold: bool = False) -> tuple[float, int]:
    """(seconds, new bytes on `on`'s filesystem) of running `cmd` (in `env`), which writes `out`; `expect`:
    what its log must say (the path measured is the one meant); `cold`: with the page cache emptied first."""
    shutil.rmtree(out, ignore_errors=True)
    before = used(on)
    time.sleep(1)  # let the filesystem finish freeing the removed output
    before = used(on)
    if cold:
        drop_page_cache()
    started = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"bench: {' '.join(map(str, cmd[:3]))} failed:\n{done.stderr[-2000:]}")
    if expect is not None and expect not in done.stdout:
        raise SystemExit(f"bench: {' '.join(map(str, cmd[:3]))} did not say '{expect}':\n{done.stdout[-2000:]}")
    grown = used(on) - before
    shutil.rmtree(out, ignore_errors=True)
    return seconds, grown


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cache", type=Path, default=ROOT / ".tailor-cache" / "bench")
    args = ap.parse_args()
    if (why := unavailable()) is not None:
        raise SystemExit(f"bench: cannot mount a loop XFS: {why}")
    as_installed()
    run = bench_run(args.cache).resolve()  # (a link to the bench run made elsewhere: its folder copied, not the link)
    work = fresh_work(args.cache, "clone-work")
    tailor = [str(Path(sys.executable).with_name("tailor-tui")), "--apply"]
    with loop_xfs(work / "xfs.img", work / "xfs", size=16 << 30) as xfs:
        print(f"copying the bench run onto {xfs} (byte by byte)…", flush=True)
        subprocess.run(["cp", "-r", "--reflink=never", str(run), str(xfs / "run")], check=True)
        places = {"xfs": (xfs / "run", xfs), "ext4": (run, work)}
        commands: dict[str, tuple[list[str], Path, Path]] = {}
        rows_all = [f"layers.{i}" for i in range(SPEC.layers)] + ["embed_tokens", "norm", "lm_head"]
        for fs, (where, scratch) in places.items():
            base, source, out = where / "global_step2", where / "global_step1", scratch / "out"
            one = recipe(scratch / "one.yaml", base, source, out, [ONE_ROW])
            every = recipe(scratch / "every.yaml", base, source, out, rows_all)
            commands[f"{fs}: cp -r --reflink=never"] = (["cp", "-r", "--reflink=never", str(base), str(out)],
                                                         out, scratch)
            if fs == "xfs":  # tailor-tui fsyncs what it writes (a promise), cp does not: like for like, cp; sync
                commands["xfs: cp -r --reflink=never; sync"] = (
                    ["sh", "-c", f'cp -r --reflink=never "{base}" "{out}" && sync'], out, scratch)
                commands["xfs: cp -r --reflink=always"] = (["cp", "-r", "--reflink=always", str(base), str(out)],
                                                           out, scratch)
                # the floor of a verified clone: every byte it keeps is read once (and its CRC-32 checked)
                commands["xfs: cat of the base"] = (["sh", "-c", f'cat "{base}"/* > /dev/null'], out, scratch)
            commands[f"{fs}: --apply 1 row"] = ([*tailor, str(one)], out, scratch)
            if fs == "xfs":
                commands["xfs: --apply 1 row, after --stats"] = ([*tailor, str(one)], out, scratch)
                commands["xfs: --apply 1 row, after --stats, --no-fsync"] = ([*tailor, str(one), "--no-fsync"], out,
                                                                            scratch)
            commands[f"{fs}: --apply 1 row --no-clone"] = ([*tailor, str(one), "--no-clone"], out, scratch)
            if fs == "xfs":
                commands["xfs: --apply every row"] = ([*tailor, str(every)], out, scratch)
                commands["xfs: --apply every row --no-clone"] = ([*tailor, str(every), "--no-clone"], out, scratch)
        replaced = replaced_bytes(xfs / "one.yaml")
        caches = {name: work / "caches" / str(i) for i, name in enumerate(commands)}  # a statistics cache each
        for name in ("xfs: --apply 1 row, after --stats", "xfs: --apply 1 row, after --stats, --no-fsync"):
            subprocess.run([tailor[0], "--stats", str(xfs / "run")], capture_output=True, check=True,
                           env={**os.environ, "TAILOR_TUI_CACHE": str(caches[name])})
        files = len(list((xfs / "run" / "global_step2").iterdir()))
        # the same on XFS with the page cache emptied before each command: the base (and the source) read
        # from the disk, as a checkpoint too large for a node's memory, or written by other nodes, always is
        cold = {name.replace("xfs:", "xfs, cold:"): name for name in COLD}
        results: dict[str, list[tuple[float, int]]] = {k: [] for k in [*commands, *cold]}
        for i in range(args.repeats):  # every other round in reverse: no command always follows the same one
            for name in (reversed(results) if i % 2 else results):
                cmd, out, scratch = commands[cold.get(name, name)]
                env = {**os.environ, "TAILOR_TUI_CACHE": str(caches[cold.get(name, name)])}
                results[name].append(measure(cmd, out, scratch, env, AFTER_STATS if "after --stats" in name else None,
                                             cold=name in cold))
                seconds, grown = results[name][-1]
                print(f"  round {i + 1}: {name:<52} {seconds:6.2f} s  {gib(grown):>10} new", flush=True)
    shutil.rmtree(work, ignore_errors=True)

    total = sum(f.stat().st_size for f in (run / "global_step2").iterdir())
    print(f"\nbase tag folder: {gib(total)} in {files} files, {SPEC.world_size} ranks; the 1-row recipe replaces "
          f"{replaced / 2**20:.1f} MiB ({ONE_ROW} of {SPEC.layers + 3} rows); {args.repeats} rounds; "
          f"{os.cpu_count()} cores")
    print(f"{'':<52} {'median':>7}  {'x cp (per round)':>16}  {'x cp; sync':>10}  {'new space (median)':>19}  "
          f"{'/ replaced':>10}")
    for name, got in results.items():
        fs = name.split(":")[0]
        cp, synced = results[f"{fs}: cp -r --reflink=never"], results.get(f"{fs}: cp -r --reflink=never; sync")
        ratio = statistics.median(s / c for (s, _), (c, _) in zip(got, cp))
        to_synced = f"{statistics.median(s / c for (s, _), (c, _) in zip(got, synced)):9.2f}x" if synced else ""
        space = statistics.median(g for _, g in got)
        print(f"{name:<52} {statistics.median(s for s, _ in got):6.2f} s  {ratio:14.2f}x  {to_synced:>10}  "
              f"{space / 2**20:15.1f} MiB  {space / replaced:9.2f}x")
    print(f"(goals, on XFS: the 1-row recipe's new space ≤ 2 × replaced + 1 MiB per file = "
          f"{(2 * replaced + files * 2**20) / 2**20:.1f} MiB; cold, after --stats, its time ≤ 0.6 × cp -r "
          "--reflink=never; sync; cold, every row ≤ 1.0 × cp -r --reflink=never; sync)")


if __name__ == "__main__":
    main()
