"""After the run's statistics, a cloned composition reads of its sources only the blocks that hold
the rows it takes, each checked against the CRC-32 the statistics recorded of it (`crc.BlockCrcs`,
`checkpoints.file_facts`, `planning.reads`, `compose.source_blocks`); without them, the records it takes from whole.

The XFS tests run on a loop-mounted XFS with reflink (the `xfs` fixture: root and xfsprogs; skipped,
saying why, where one cannot be mounted). The test runs' records are smaller than the 1 MiB blocks the
statistics record by default, so where a test needs a row to be a few blocks of many, it computes
the statistics with 4 KiB blocks (`compute_health(crc_block=...)`).
"""

from __future__ import annotations

import base64
import json
import os
import random
import shutil
import struct
import zlib
from dataclasses import replace
from pathlib import Path

import pytest
from helpers import assert_one_line_error, flat_record, flip_byte, hidden, on_xfs, output_files, tailor, write_recipe

from tailor_tui.checked import crc
from tailor_tui.checked.crc import BLOCK, BlockCrcs, RecordBlocks
from tailor_tui.checkpoints import file_facts
from tailor_tui.checkpoints.scan import scan
from tailor_tui.compose.compose_run import run_compose
from tailor_tui.formats.ptfile import read_structure
from tailor_tui.health.stats_rank import rank_stats
from tailor_tui.health.stats_run import compute_health, stats_jobs
from tailor_tui.planning.build import build_plan
from tailor_tui.planning.recipe_file import load_recipe

SMALL = 4096  # blocks a test run's record holds dozens of
TAKEN = "layers.1"


def test_block_crcs_are_each_blocks_and_combine_to_the_whole():
    data = random.Random(47).randbytes(3 * BLOCK + 1234)
    blocks = BlockCrcs()
    for at in range(0, len(data), 100_003):  # reads that straddle the blocks' bounds
        blocks.feed(memoryview(data)[at: at + 100_003])
    assert blocks.finish() == zlib.crc32(data)
    assert blocks.values == [zlib.crc32(data[i: i + BLOCK]) for i in range(0, len(data), BLOCK)]


def test_the_statistics_record_each_records_block_crcs_either_way_they_read_it(real_run, tmp_path):
    """The flat reading (`stats_flat`) and the record by record one (`stats_rank`) record the same blocks:
    each the CRC-32 of its bytes, together the record's; a record that fails its CRC-32 gets none."""
    run, _spec = real_run("hf_bf16_2")
    checkpoints = tuple(scan(run).checkpoints)
    job = stats_jobs(checkpoints, len(checkpoints) - 1, crc_block=SMALL)[0]
    flat = rank_stats(job, lambda e: None, lambda: False)
    by_record = rank_stats(replace(job, table=None), lambda e: None, lambda: False)
    assert flat.blocks and flat.blocks == by_record.blocks

    path = job.files.optim_states
    data = path.read_bytes()
    records = {r.name: r for r in read_structure(path)[1].values()}
    for name, blocks in flat.blocks.items():
        r = records[name]
        assert blocks.describes(r) and blocks.combined() == r.crc and blocks.block == SMALL
        assert [blocks.value(i) for i in range(-(-r.size // SMALL))] == [
            zlib.crc32(data[at: min(at + SMALL, r.data_offset + r.size)])
            for at in range(r.data_offset, r.data_offset + r.size, SMALL)]
    assert max(len(b.values) // 4 for b in flat.blocks.values()) > 10

    damaged = tmp_path / path.name
    shutil.copy(path, damaged)
    rotten = flip_byte(damaged, flat_record(damaged))
    found = rank_stats(replace(job, files=replace(job.files, optim_states=damaged)), lambda e: None, lambda: False)
    assert rotten not in found.blocks and found.blocks.keys() == flat.blocks.keys() - {rotten}


def _composing(run: Path, ckpts: list[Path], name: str) -> tuple[Path, Path]:
    """A 1-row recipe (TAKEN from the oldest checkpoint onto the newest) writing `name`/out, and one
    writing `name`-written/out (for `--no-clone`)."""
    (run / name).mkdir()
    (run / f"{name}-written").mkdir()
    picks = {TAKEN: ckpts[0]}
    return (write_recipe(run / name, ckpts[-1], picks, output="out"),
            write_recipe(run / f"{name}-written", ckpts[-1], picks, output="out"))


def _records_bytes(ckpt: Path) -> int:
    """The bytes of the records of a checkpoint's optim files (what a source was read as, whole)."""
    return sum(r.size for f in ckpt.rglob("*optim_states.pt") for r in read_structure(f)[1].values())


def test_after_the_statistics_a_clone_reads_of_its_sources_only_the_blocks_it_takes(real_run, xfs, monkeypatch,
                                                                                     tmp_path):
    run, _spec, ckpts = on_xfs(real_run, xfs, "hf_bf16_2")
    monkeypatch.setenv("TAILOR_TUI_CACHE", str(tmp_path / "cache"))
    recipe, plain = _composing(run, ckpts, "blocks")
    compute_health(tuple(scan(run).checkpoints), cache=tmp_path / "cache", crc_block=SMALL, workers=1)

    result = run_compose(build_plan(load_recipe(recipe)))
    assert result.bytes_shared and result.kept_checked
    assert result.sources_unread > 0.6 * _records_bytes(ckpts[0]), (result.sources_unread, _records_bytes(ckpts[0]))
    written = tailor("--apply", plain, "--no-clone")
    assert written.returncode == 0, written.stderr
    assert output_files(run / "blocks" / "out") == output_files(run / "blocks-written" / "out")
    verified = tailor("--verify", recipe)
    assert verified.returncode == 0, verified.stdout + verified.stderr

    said = tailor("--apply", recipe, "--force")  # the log says what was read of the sources, and what not
    assert said.returncode == 0, said.stderr
    line = next((x for x in said.stdout.splitlines() if x.startswith("reading only the sources' blocks")), "")
    assert line.endswith(" of their records not read, so not checked (the blocks read were checked against the "
                         "CRC-32s the run's statistics recorded)"), said.stdout


def _rewrite_blocks(cache: Path, change) -> int:
    """Apply `change` to the fields of every record's blocks ([offset, size, crc, block, base64 values])
    in every cached entry; how many records it changed."""
    changed = 0
    for entry in (cache / "facts").rglob("*.json"):
        data = json.loads(entry.read_text())
        for facts in data["files"].values():
            for fields in facts["blocks"].values():
                change(fields)
                changed += 1
        entry.write_text(json.dumps(data))
    return changed


def _flip_each_block(fields: list) -> None:
    values = bytearray(base64.b64decode(fields[4]))
    for i in range(0, len(values), 4):
        values[i] ^= 1
    fields[4] = base64.b64encode(bytes(values)).decode()


def _rot_in_every_block(fields: list) -> None:
    """Every block's value changed as bit rot in the record's bytes would change it, and the values still
    combining to the record's CRC-32, as those of a file that rotted since the statistics, its identity
    unchanged, do (`checked.evidence.blocks_usable` takes no other entry): a change `d` to block i's value moves
    the record's CRC-32 by `shift(d, bytes after block i)`, one of `shift(d, len(block i+1))` to block
    i+1's by the same, so each pair of neighbours is changed by both and the whole is unchanged."""
    values = bytearray(base64.b64decode(fields[4]))
    size, block = fields[1], fields[3]
    count = len(values) // 4  # (a record of one block is left as it is: not one TAKEN lies in)
    for i in range(count - 1):
        d = 0x1234_5678 + i
        after = min(block, size - (i + 1) * block)  # block i+1's length
        mine, theirs = struct.unpack_from("<2I", values, 4 * i)
        struct.pack_into("<2I", values, 4 * i, mine ^ d, theirs ^ crc.shift(d, after))
    fields[4] = base64.b64encode(bytes(values)).decode()


def test_a_block_that_fails_its_recorded_crc_fails_the_composition_in_one_line(real_run, xfs, tmp_path):
    """What the statistics recorded and what a source holds now differ where its identity did not change
    (bit rot; here the recorded values changed as rot would change them): the composition fails as on a
    failed CRC-32, nothing published."""
    run, _spec, ckpts = on_xfs(real_run, xfs, "hf_bf16_2")
    cache = tmp_path / "cache"
    env = {"TAILOR_TUI_CACHE": str(cache)}
    recipe, _plain = _composing(run, ckpts, "tampered")
    compute_health(tuple(scan(run).checkpoints), cache=cache, crc_block=SMALL, workers=1)
    assert _rewrite_blocks(cache, _rot_in_every_block)
    assert all(b.combined() == b.crc for f in file_facts.cached(cache, paths=sorted(ckpts[0].rglob("*optim*")))
               .values() for b in f.blocks.values())
    failed = tailor("--apply", recipe, env=env)
    assert_one_line_error(failed, 4, str(ckpts[0]), "optim_states.pt: record ", ", bytes ",
                          "fails the CRC-32 the run's statistics recorded of them")
    assert not (run / "tampered" / "out").exists() and hidden(run / "tampered") == []


def _shortened(fields: list) -> None:
    fields[4] = base64.b64encode(base64.b64decode(fields[4])[:-4]).decode()


def _changed_in_place(ckpt: Path) -> None:
    """Every optim file of `ckpt` written again with the same bytes, its mtime set back (`touch -r`): only its
    ctime tells (its identity's)."""
    for f in ckpt.rglob("*optim_states.pt"):
        st = f.stat()
        f.write_bytes(f.read_bytes())
        os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))


@pytest.mark.parametrize("case", ["no statistics", "no facts cached", "blocks of another shape",
                                  "blocks that do not combine to the record's CRC-32", "source changed"])
def test_without_blocks_recorded_of_a_source_as_it_is_a_clone_reads_what_it_takes_from_whole(
        real_run, xfs, monkeypatch, tmp_path, case):
    run, _spec, ckpts = on_xfs(real_run, xfs, "hf_bf16_2")
    cache = tmp_path / "cache"
    monkeypatch.setenv("TAILOR_TUI_CACHE", str(cache))
    name = case.replace(" ", "-").replace("'", "")
    recipe, plain = _composing(run, ckpts, name)
    if case != "no statistics":
        compute_health(tuple(scan(run).checkpoints), cache=cache, crc_block=SMALL, workers=1)
        assert file_facts.cached(cache, paths=sorted(ckpts[0].rglob("*optim_states.pt")))  # (recorded, and found)
    if case == "no facts cached":
        shutil.rmtree(cache / "facts")
    elif case == "blocks of another shape":
        assert _rewrite_blocks(cache, _shortened)
    elif case == "blocks that do not combine to the record's CRC-32":
        assert _rewrite_blocks(cache, _flip_each_block)
    elif case == "source changed":
        _changed_in_place(ckpts[0])

    result = run_compose(build_plan(load_recipe(recipe)))
    # (an entry whose blocks are not well formed is not ours: the rows it found finite are not taken either)
    vouched = case in ("blocks that do not combine to the record's CRC-32", "source changed")
    assert result.bytes_shared and result.kept_checked == vouched
    assert result.sources_unread == 0
    assert tailor("--apply", plain, "--no-clone").returncode == 0
    assert output_files(run / name / "out") == output_files(run / f"{name}-written" / "out")


def test_a_cached_entry_is_taken_for_no_more_than_it_claims():
    """`from_json` refuses every field out of its type or range, and values that are not one per block."""
    good = RecordBlocks("archive/data/0", 64, 4096, 0x1234, 4096, bytes(4))
    assert file_facts.blocks_from_json(file_facts.blocks_to_json({good.name: good})) == {good.name: good}
    fields = file_facts.blocks_to_json({good.name: good})[good.name]
    for i, bad in [(0, -1), (1, True), (2, 1 << 32), (3, 3000), (3, 1 << 40), (4, "!!"),
                   (4, base64.b64encode(bytes(8)).decode())]:
        with pytest.raises((ValueError, TypeError)):
            file_facts.blocks_from_json({good.name: [*fields[:i], bad, *fields[i + 1:]]})
    for bad_value in ([], {good.name: fields[:4]}, {good.name: "x"}):
        with pytest.raises((ValueError, TypeError)):
            file_facts.blocks_from_json(bad_value)
    facts = file_facts.FileFacts({good.name: good}, frozenset({"layers.0"}), (("mp_rank_00_model_states.pt", "[1]"),))
    assert file_facts.from_json(file_facts.to_json(facts)) == facts
    for key, bad in [("finite", "layers.0"), ("finite", [""]), ("finite", [7]), ("finite", ["x" * 2000]),
                     ("along", []), ("along", {"../model_states.pt": "[1]"}), ("along", {"a/b": "[1]"}),
                     ("along", {"..": "[1]"}), ("along", {"m.pt": 1}), ("blocks", [])]:
        with pytest.raises((ValueError, TypeError)):
            file_facts.from_json({**file_facts.to_json(facts), key: bad})
