"""The cache outside every run: what a scan reads of each model_states file (`scan_cache`) and
the statistics' whole-checkpoint cells (`stats_run`), on real runs. A second look reads no
pickle; a changed file is read again; a cache entry is an input like any other (garbage,
another file's entry, a FIFO, an oversized file: read again and replaced, never trusted);
a cache that cannot be written is skipped."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import checkpoints_of

from tailor_tui.checkpoints import model_states, scan_cache
from tailor_tui.checkpoints.scan import scan
from tailor_tui.formats.ds_format import MODEL_STATES
from tailor_tui.health.stats_run import StatsPlanned, compute_health


@pytest.fixture
def unpickled(monkeypatch) -> list[Path]:
    """Every model_states file a scan unpickles, in order (model_states.read_metadata is the one
    reader of their structure)."""
    seen: list[Path] = []
    real = model_states.read_metadata

    def spy(path):
        seen.append(Path(path))
        return real(path)

    monkeypatch.setattr(model_states, "read_metadata", spy)
    return seen


def entries(cache: Path) -> dict[str, Path]:
    """{resolved model_states path: its entry} of the scan cache."""
    found = {}
    for f in (cache / "scan").rglob("*.json"):
        found[json.loads(f.read_text())["identity"][0]] = f
    return found


def rank0(ckpt: Path) -> Path:
    return ckpt / MODEL_STATES.format(rank=0)


@pytest.mark.parametrize("name", ["hf_bf16_2", "hf_fp32_3_tied", "ds_fp16_2_config_file", "ds_selective_parity"])
def test_a_second_scan_unpickles_nothing_and_finds_the_same(real_run, tmp_path, unpickled, name):
    """bf16 / fp32 / fp16 told by the tensors, tied and frozen rows, sub-groups, partial saves."""
    run, _spec = real_run(name)
    before = sorted(run.rglob("*"))
    fresh = scan(run, cache=None)
    assert fresh.checkpoints and len(unpickled) == len(fresh.checkpoints)
    unpickled.clear()
    cache = tmp_path / "cache"
    assert scan(run, cache=cache) == fresh
    assert len(unpickled) == len(fresh.checkpoints) == len(entries(cache))
    unpickled.clear()
    again = scan(run, cache=cache)
    assert unpickled == []
    assert again == fresh  # every field: layout, rows, dtype, step, version, ranks, saved rows, …
    assert [c.sizes for c in again.checkpoints] == [c.sizes for c in fresh.checkpoints]
    assert sorted(run.rglob("*")) == before  # nothing is written inside the run


def test_scan_caches_under_the_cache_root_by_default(real_run, tmp_path, monkeypatch, unpickled):
    run, _spec = real_run("hf_bf16_2")
    monkeypatch.setenv("TAILOR_TUI_CACHE", str(tmp_path / "root"))
    first = scan(run)
    assert len(entries(tmp_path / "root")) == len(first.checkpoints) == len(unpickled)
    unpickled.clear()
    assert scan(run) == first and unpickled == []


def test_a_plan_after_a_scan_unpickles_nothing_and_is_the_same(real_run, tmp_path, unpickled):
    """build_plan opens its checkpoints as a scan does: from the cache when it holds them."""
    from helpers import write_recipe

    from tailor_tui.planning.build import build_plan
    from tailor_tui.planning.recipe import parse_recipe

    run, spec = real_run("hf_bf16_2")
    c2, c4, c6 = checkpoints_of(run, spec)
    path = write_recipe(tmp_path, c6, {"layers.1": c4, "embed_tokens": c2})
    recipe = parse_recipe(path.read_text(), str(path), path.parent)
    fresh = build_plan(recipe, cache=None)
    cache = tmp_path / "cache"
    scan(run, cache=cache)
    unpickled.clear()
    cached = build_plan(recipe, cache=cache)
    assert unpickled == []
    assert cached.rank_jobs() == fresh.rank_jobs() and cached.model_file_jobs() == fresh.model_file_jobs()


def test_a_changed_model_states_file_is_read_again(real_run, tmp_path, unpickled):
    run, spec = real_run("ds_bf16_3_subgroups")
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    cache = tmp_path / "cache"
    scan(copy, cache=cache)
    c2, c4, _c6 = checkpoints_of(copy, spec)
    unpickled.clear()
    touched = os.stat(rank0(c2))
    os.utime(rank0(c2), ns=(touched.st_atime_ns, touched.st_mtime_ns + 1_000_000))  # same bytes, new mtime
    scan(copy, cache=cache)
    assert unpickled == [rank0(c2)]
    unpickled.clear()
    with open(rank0(c2), "r+b") as f:  # rewritten in place (same inode): step 4's structure
        f.truncate(0)
        f.write(rank0(c4).read_bytes())
    steps = {c.name: c.step for c in scan(copy, cache=cache).checkpoints}
    assert unpickled == [rank0(c2)] and steps == {"global_step2": 4, "global_step4": 4, "global_step6": 6}
    unpickled.clear()
    scan(copy, cache=cache)
    assert unpickled == []


def _garbage(entry: Path, other: Path) -> dict:
    """What may lie where an entry should: {what: a function putting it there}."""
    valid = json.loads(entry.read_text())

    def changed(**fields):
        return lambda: entry.write_text(json.dumps({**valid, **fields}))

    def bad_row():
        rows = [list(r) for r in valid["rows"]]
        rows[0][2] = [1, 2]  # parameter names that are not strings
        return changed(rows=rows)()

    return {
        "not JSON": lambda: entry.write_bytes(b"\x80garbage{"),
        "empty": lambda: entry.write_bytes(b""),
        "a list": lambda: entry.write_text("[]"),
        "another format": changed(format=scan_cache.FORMAT + 1),
        "a row's parameters not names": bad_row,
        "a negative dimension": changed(frozen=[["x", [-1]]]),
        "a world size of 0": changed(world_size=0),
        "a step that is a bool": changed(step=True),
        "an unknown precision": changed(precision="int8"),
        "another file's entry": lambda: shutil.copyfile(other, entry),
        "nested too deep": lambda: entry.write_text("[" * 100_000 + "]" * 100_000),
        "larger than the bound": lambda: entry.write_text(" " * scan_cache.MAX_CACHED + json.dumps(valid)),
        "a FIFO": lambda: (entry.unlink(), os.mkfifo(entry)),
    }


def test_a_corrupt_or_foreign_cache_entry_is_read_again_and_replaced(real_run, tmp_path, unpickled):
    run, spec = real_run("ds_bf16_3_subgroups")
    cache = tmp_path / "cache"
    fresh = scan(run, cache=cache)
    c2, c4, _c6 = checkpoints_of(run, spec)
    entry, other = entries(cache)[str(rank0(c2).resolve())], entries(cache)[str(rank0(c4).resolve())]
    for what, put in _garbage(entry, other).items():
        put()
        unpickled.clear()
        assert scan(run, cache=cache) == fresh, what
        assert unpickled == [rank0(c2)], what
        unpickled.clear()
        assert scan(run, cache=cache) == fresh and unpickled == [], f"{what}: not replaced"


def test_an_entry_that_cannot_be_replaced_is_skipped(real_run, tmp_path, unpickled):
    run, spec = real_run("ds_bf16_3_subgroups")
    cache = tmp_path / "cache"
    fresh = scan(run, cache=cache)
    entry = entries(cache)[str(rank0(checkpoints_of(run, spec)[0]).resolve())]
    entry.unlink()
    entry.mkdir()  # a folder where the entry goes: it cannot be read nor renamed over
    unpickled.clear()
    assert scan(run, cache=cache) == fresh and scan(run, cache=cache) == fresh
    assert len(unpickled) == 2 and entry.is_dir()


def test_an_unwritable_cache_still_scans(real_run, tmp_path, unpickled):
    run, _spec = real_run("hf_bf16_2")
    fresh = scan(run, cache=None)
    blocked = tmp_path / "a-file"
    blocked.write_text("not a folder")  # its entries' folders cannot be made
    assert scan(run, cache=blocked) == fresh and scan(run, cache=blocked) == fresh
    assert len(unpickled) == 3 * len(fresh.checkpoints)  # read every time, as with no cache
    assert blocked.read_text() == "not a folder"


def _planned(checkpoints, cache: Path):
    events = []
    health = compute_health(checkpoints, workers=1, cache=cache, emit=events.append)
    (planned,) = [e for e in events if isinstance(e, StatsPlanned)]
    return health, planned


def test_statistics_come_back_whole_from_the_cache_and_survive_corrupt_entries(real_run, tmp_path):
    run, _spec = real_run("ds_blown_up")
    checkpoints = scan(run, cache=None).checkpoints
    cache = tmp_path / "cache"
    first, planned = _planned(checkpoints, cache)
    ranks = sum(c.world_size for c in checkpoints)
    assert planned.to_read > 0 and planned.cached_ranks == 0
    cells = sorted((cache / "cells").rglob("*.json"))
    # one entry of cells and one of its ranks' sums per checkpoint (not one per rank file)
    assert len(cells) == len(checkpoints) == len(list((cache / "ranks").rglob("*.json")))
    shutil.rmtree(cache / "ranks")  # each checkpoint's cells alone answer
    again, planned = _planned(checkpoints, cache)
    assert (planned.to_read, planned.cached_ranks) == (0, ranks) and again.cells == first.cells
    valid = json.loads(cells[0].read_text())
    row = next(iter(valid["cells"]))
    cells[0].write_text(json.dumps({**valid, "cells": {row: ["x", None, None, None, True]}}))
    cells[1].write_text(json.dumps({**valid, "cells": {"no such row": valid["cells"][row]}}))
    cells[2].write_bytes(b"\x00garbage")
    again, planned = _planned(checkpoints, cache)  # read again: nothing is left to add up
    assert planned.to_read > 0 and again.cells == first.cells
    shutil.rmtree(cache / "cells")
    again, planned = _planned(checkpoints, cache)  # the ranks' sums alone answer
    assert (planned.to_read, planned.cached_ranks) == (0, ranks) and again.cells == first.cells
    for f in (cache / "ranks").rglob("*.json"):
        data = json.loads(f.read_text())
        k = next(iter(data["ranks"]))
        r = next(iter(data["ranks"][k]))
        f.write_text(json.dumps({**data, "ranks": {**data["ranks"], k: {r: ["1", 0, 0.0, None, 0.0, 0.0, 0, False,
                                                                          True]}}}))
    shutil.rmtree(cache / "cells")
    again, planned = _planned(checkpoints, cache)  # rank sums of the wrong types: read again
    assert planned.cached_ranks == 0 and again.cells == first.cells


def test_a_changed_rank_file_is_read_again_alone(real_run, tmp_path):
    """A checkpoint's ranks' sums are cached in one entry, each under the identity of what it
    read: a rank file changed since (its ctime moves) is read again, every other rank is not."""
    run, _spec = real_run("ds_blown_up")
    copy = tmp_path / "run"
    shutil.copytree(run, copy, symlinks=True)
    checkpoints = scan(copy, cache=None).checkpoints
    cache = tmp_path / "cache"
    first, _planned_first = _planned(checkpoints, cache)
    ranks = sum(c.world_size for c in checkpoints)
    newest = max(checkpoints, key=lambda c: c.step)
    os.utime(newest.ranks[0].optim_states)  # the same bytes, another identity
    again, planned = _planned(scan(copy, cache=None).checkpoints, cache)
    assert (planned.cached_ranks, again.cells) == (ranks - 1, first.cells)
    assert planned.to_read > 0


def test_the_process_that_composes_with_workers_does_without_numpy(real_run, tmp_path):
    """`--apply` with worker processes plans and starts them without loading numpy (only the
    workers count non-finite values): 60 ms of every composition's start."""
    run, spec = real_run("ds_blown_up")
    base = sorted(p for p in run.iterdir() if p.is_dir() and p.name.startswith("global_step"))[0]
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"version: 1\nbase: {base}\noutput: {tmp_path / 'composed'}\n")
    code = ("import sys\nfrom tailor_tui.cli.main import main\n"
            f"assert main(['--apply', {str(recipe)!r}, '-j', '2', '--no-fsync']) == 0\n"
            "assert 'numpy' not in sys.modules, 'numpy imported'\n")
    env = dict(os.environ, TAILOR_TUI_CACHE=str(tmp_path / "cache"))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "composed").is_dir()


def test_a_stats_run_does_without_numpy_where_workers_read(real_run, tmp_path):
    """The process that plans the statistics, starts the workers and reads the cache never loads
    numpy (only what reads ranks does): a cached `--stats` would otherwise be mostly imports, and
    a process without it forks its workers instead of spawning them."""
    run, _spec = real_run("ds_blown_up")

    def stats(*extra: str, cache: str) -> subprocess.CompletedProcess:
        code = ("import sys\nfrom tailor_tui.cli.main import main\n"
                f"assert main(['--stats', {str(run)!r}, '--json', *{list(extra)!r}]) == 0\n"
                "assert 'numpy' not in sys.modules, 'numpy imported'\n")
        env = dict(os.environ, TAILOR_TUI_CACHE=str(tmp_path / cache))
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)

    alone = stats("-j", "1", cache="one")
    assert "numpy imported" in alone.stderr  # read in this process: numpy is loaded here
    cold = stats("-j", "2", cache="two")
    assert cold.returncode == 0, cold.stderr
    again = stats(cache="two")
    assert again.returncode == 0, again.stderr
