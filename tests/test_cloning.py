"""Where the filesystem shares blocks, an output costs what changes: its rank and model files start
as clones of the base's (`cloning`) and only the replaced rows are written — the same bytes as
`--no-clone` writes, the same checks, resumed by DeepSpeed and the HF Trainer.

On a loop-mounted XFS with reflink (the `xfs` fixture, `runs.scratch_xfs`: root and xfsprogs; `.ci/run`
installs xfsprogs where it can); where one cannot be mounted, the tests say why in their skip reason.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import time
from pathlib import Path

import pytest
from helpers import (
    assert_one_line_error,
    assert_optim_states_equal,
    flat_record,
    flip_byte,
    hidden,
    on_xfs,
    output_files,
    slurm_tasks,
    start_apply,
    tailor,
    wait_for_line,
    write_recipe,
)
from runs import resume_and_step
from scratch_xfs import shared_bytes

from tailor_tui.checkpoints.checkpoint import open_checkpoint
from tailor_tui.cloning import clone, filesystem_type, may_share


@pytest.mark.parametrize("name", ["hf_bf16_2", "ds_bf16_3_subgroups", "hf_bin"])
def test_a_cloned_output_is_the_bytes_no_clone_writes_shares_the_rest_and_resumes(real_run, xfs, tmp_path, name):
    run, spec, ckpts = on_xfs(real_run, xfs, name)
    picks = {"layers.0": ckpts[0], "layers.1": ckpts[1]}  # rows from two checkpoints, most from the base
    (run / "cloned").mkdir()
    (run / "every").mkdir()
    (run / "written").mkdir()
    recipe = write_recipe(run / "cloned", ckpts[-1], picks, output="out")
    plain = write_recipe(run / "written", ckpts[-1], picks, output="out")
    plan = tailor("--apply", recipe, "--dry-run")
    assert "blocks: the output is on the base's xfs filesystem" in plan.stdout, plan.stdout
    assert "blocks:" not in tailor("--apply", plain, "--dry-run", "--no-clone").stdout

    cloned = tailor("--apply", recipe)
    assert cloned.returncode == 0, cloned.stderr
    assert "sharing its sources' blocks (reflink): " in cloned.stdout, cloned.stdout
    # the progress counts bytes composed, each rank's last line says how many it wrote: never all of them
    assert "to compose (on the base's xfs filesystem: " in cloned.stderr, cloned.stderr
    ends = [line for line in cloned.stderr.splitlines() if line.startswith("rank ") and ": done, " in line]
    cloned_ends = [line for line in ends if re.fullmatch(r"rank \d+: done, [\d.]+ \w+: [\d.]+ \w+ written, "
                                                          r"[\d.]+ \w+ sharing its sources' blocks \(reflink\)", line)]
    assert cloned_ends and all(line in cloned_ends or line.endswith(" composed") for line in ends), ends
    written = tailor("--apply", plain, "--no-clone")
    assert written.returncode == 0 and "sharing" not in written.stdout, written.stdout + written.stderr
    assert " to write" in written.stderr and " composed" not in written.stderr, written.stderr  # every byte written
    out, reference = run / "cloned" / "out", run / "written" / "out"
    assert output_files(out) == output_files(reference)  # bit for bit what every byte written gives
    took = [{k: v for k, v in json.loads((o / "tailor_provenance.json").read_text()).items()
             if k in ("taken", "taken_weights")} for o in (out, reference)]
    assert took[0] == took[1] and took[0]["taken"], took  # what each took, as the record keeps it

    # blocks of the base's, not copies (copy_file_range shares a few too where a copy is block-aligned)
    shared = {f: shared_bytes(out / f) for f in output_files(out) if f.endswith(("optim_states.pt", ".safetensors", ".bin"))
              and not f.endswith("training_args.bin")}
    assert shared and all(shared.values()), shared
    assert sum(shared.values()) > sum(shared_bytes(reference / f) for f in shared)
    # every row from the oldest checkpoint: each rank file is a clone of that checkpoint's (its flat tensors lie
    # where the base's do), the base's bytes written over it; the same bytes as every byte written
    rows = {r.name: ckpts[0] for r in open_checkpoint(ckpts[-1]).rows if not r.tied}
    (run / "every-written").mkdir()
    every, every_written = (write_recipe(run / f, ckpts[-1], rows, output="out") for f in ("every", "every-written"))
    assert "sharing its sources' blocks (reflink)" in tailor("--apply", every).stdout
    assert tailor("--apply", every_written, "--no-clone").returncode == 0
    assert output_files(run / "every" / "out") == output_files(run / "every-written" / "out")
    optim = sorted((run / "every" / "out").rglob("*optim_states.pt"))
    assert optim and all(shared_bytes(f) for f in optim)
    every_verified = tailor("--verify", every)
    assert every_verified.returncode == 0, every_verified.stdout + every_verified.stderr
    verified = tailor("--verify", recipe)
    assert verified.returncode == 0, verified.stdout + verified.stderr

    losses = resume_and_step(out, spec, tmp_path / "resume")  # DeepSpeed; the HF Trainer for an HF run
    assert losses and all(math.isfinite(x) for x in losses)
    assert_optim_states_equal(out, tmp_path / "resume" / "resaved")


def test_a_clone_reads_the_kept_rows_and_counts_their_nan_unless_the_statistics_did(real_run, xfs, tmp_path,
                                                                                     monkeypatch):
    """Rows kept in shared blocks cost no writes; they are read and checked against their CRC-32s always,
    and their NaN/Inf counted unless the run's cached statistics found them whole and finite as the files
    are now (`--stats`, the composer, or `--apply` itself, which computes the statistics of the cells it takes
    before writing; not `--allow-nonfinite`, which writes whatever they find)."""
    monkeypatch.setenv("TAILOR_TUI_CACHE", str(tmp_path / "cache"))  # (the XFS copy is shared: its statistics not)
    run, spec, ckpts = on_xfs(real_run, xfs, "hf_bf16_2")
    (run / "stats").mkdir()
    recipe = write_recipe(run / "stats", ckpts[-1], {"layers.0": ckpts[0]}, output="out")
    read = tailor("--apply", recipe, "--allow-nonfinite")
    assert read.returncode == 0 and "sharing its sources' blocks (reflink)" in read.stdout, read.stderr
    assert "the run's statistics found those bytes finite" not in read.stdout and "statistics of" not in read.stderr
    unread = tailor("--apply", recipe, "--force")
    assert ("(the rows kept were read and checked against their CRC-32s, their NaN/Inf not counted again: the run's "
            "statistics found those bytes finite)") in unread.stdout, unread.stdout
    assert tailor("--verify", recipe).returncode == 0


@pytest.mark.parametrize("size", [(130, 32), (80, 24)])
async def test_the_composer_says_what_a_clone_shared_and_did_not_read(real_run, xfs, size):
    """In the composer (whose statistics vouch for the rows kept and taken), a composition on the XFS says,
    as the log does, what it shared and what it did not read or count again (`Composed.unread`), all
    of it on screen, at 80x24 too."""
    from pilot_helpers import on_screen, scanned, start_composing, wait_for

    from tailor_tui.ui.app import make_app

    run, spec, ckpts = on_xfs(real_run, xfs, "hf_bf16_2")
    app = make_app(run, workers=1)
    async with app.run_test(size=size) as pilot:
        await scanned(pilot)
        await pilot.press("left", "space")  # the first row from the checkpoint before the base
        progress = await start_composing(pilot)
        await wait_for(pilot, lambda: not progress.running, tries=2400)
        await pilot.pause()
        widget = progress.query_one("#compose-status")
        status = " ".join(widget.render().plain.split())
        shown_now = "".join(on_screen(app, widget))
        rate = progress.query_one("#compose-rate").render().plain
    assert progress.has_class("finished"), status
    assert " composed · " in rate and "written" not in rate, rate  # a clone's bytes are not all written
    assert "sharing its sources' blocks (reflink)" in status, status
    assert ("The rows kept were read and checked against their CRC-32s, their NaN/Inf not counted again: the "
            "run's statistics found those bytes finite.") in status, status
    assert "The rows taken were found whole and finite by the run's statistics" in status, status
    assert "".join(status.split()) in "".join(shown_now.split()), (status, shown_now)  # none of it cut off


def test_a_flipped_byte_the_base_keeps_is_refused_by_a_clone_as_without(real_run, xfs):
    """Damage in a kept row: a clone reads the kept rows and refuses it, as --no-clone does (after the run's
    statistics too, the file's identity unchanged: test_changed_sources)."""
    run, spec, ckpts = on_xfs(real_run, xfs, "hf_bf16_2")
    damaged = xfs / "damaged"
    shutil.copytree(ckpts[-1], damaged)
    rank0 = sorted(damaged.rglob("*rank_0_mp_rank_00_optim_states.pt"))[0]
    flip_byte(rank0, flat_record(rank0), where=0.9)
    recipe = write_recipe(xfs, damaged, {"layers.0": ckpts[0]}, output="from-damaged")
    for how in ([], ["--no-clone"]):
        assert_one_line_error(tailor("--apply", recipe, *how), 4, str(rank0), "CRC")
        assert not (xfs / "from-damaged").exists() and hidden(xfs) == []



def test_a_flipped_byte_of_the_checkpoint_every_row_is_taken_from_is_refused_by_its_clone_as_without(real_run, xfs):
    """Every row taken from one checkpoint: the output is a clone of its rank files, whose bytes are read and
    checked all the same: a flipped byte there is refused, as --no-clone refuses it, and nothing published."""
    run, spec, ckpts = on_xfs(real_run, xfs, "hf_bf16_2")
    damaged = xfs / "damaged-source" / ckpts[0].name
    shutil.copytree(ckpts[0], damaged)
    rank1 = sorted(damaged.rglob("*rank_1_mp_rank_00_optim_states.pt"))[0]
    flip_byte(rank1, flat_record(rank1), where=0.3)
    rows = {r.name: damaged for r in open_checkpoint(ckpts[-1]).rows if not r.tied}
    recipe = write_recipe(xfs, ckpts[-1], rows, output="from-damaged-source")
    for how in ([], ["--no-clone"]):
        assert_one_line_error(tailor("--apply", recipe, *how), 4, str(rank1), "CRC")
        assert not (xfs / "from-damaged-source").exists() and hidden(xfs) == []


def test_a_flipped_byte_of_a_kept_tensor_in_a_torch_format_weight_file_is_refused_by_a_clone_as_without(
        real_run, xfs):
    """`pytorch_model.bin` as a clone of the base's, its picked records written over: the records it keeps,
    their blocks shared, are still read once and checked against their stored CRC-32s, as `--no-clone`
    checks each record it copies."""
    from tailor_tui.formats.ptfile import read_structure

    run, spec, ckpts = on_xfs(real_run, xfs, "hf_bin")
    damaged = xfs / "damaged-bin"
    shutil.copytree(ckpts[-1], damaged)
    obj, _records, prefix = read_structure(damaged / "pytorch_model.bin")
    flip_byte(damaged / "pytorch_model.bin", f"{prefix}data/{obj['model.norm.weight'].storage.key}")  # kept
    recipe = write_recipe(xfs, damaged, {"layers.0": ckpts[0]}, output="from-damaged-bin")
    for how in ([], ["--no-clone"]):
        assert_one_line_error(tailor("--apply", recipe, *how), 4, "pytorch_model.bin", "CRC")
        assert not (xfs / "from-damaged-bin").exists() and hidden(xfs) == []


def test_a_non_finite_row_the_base_keeps_is_refused_in_a_clone(real_run, xfs):
    run, spec, ckpts = on_xfs(real_run, xfs, "ds_blown_up")
    stats = tailor("--stats", run, "--check")
    assert stats.returncode == 8, stats.stderr  # the statistics see the blown row: they vouch for none
    (run / "nan").mkdir()
    recipe = write_recipe(run / "nan", ckpts[-1], {"layers.1": ckpts[1]}, output="out")
    assert_one_line_error(tailor("--apply", recipe), 8, "layers.2 from global_step6 (5,120 NaN/Inf", "--allow-nonfinite")
    assert not (run / "nan" / "out").exists()


def test_a_clone_counts_the_nan_inf_of_a_row_it_takes_unless_the_statistics_found_it_finite(real_run, xfs):
    """After the statistics, a clone whose kept rows they vouched for takes a row they found finite without
    counting its NaN/Inf again (its bytes still checked against their CRC-32s), and says so; a row they
    found blown up is counted and refused, as ever."""
    run, spec, ckpts = on_xfs(real_run, xfs, "ds_blown_up")
    assert tailor("--stats", run).returncode == 0
    (run / "taken").mkdir()
    good = write_recipe(run / "taken", ckpts[1], {"layers.1": ckpts[0]}, output="good")
    applied = tailor("--apply", good)
    assert applied.returncode == 0, applied.stderr
    assert "the rows taken were found whole and finite by the run's statistics: their bytes checked against " \
           "their CRC-32s, their NaN/Inf not counted again" in applied.stdout, applied.stdout
    assert tailor("--verify", good).returncode == 0
    bad = write_recipe(run / "taken", ckpts[1], {"layers.2": ckpts[2]}, output="bad")
    assert_one_line_error(tailor("--apply", bad), 8, "layers.2 from global_step6 (5,120 NaN/Inf", "--allow-nonfinite")
    assert not (run / "taken" / "bad").exists()


def test_killed_while_patching_a_clone_nothing_is_published(real_run, xfs):
    run, spec, ckpts = on_xfs(real_run, xfs, "hf_bf16_2")
    recipe = write_recipe(run, ckpts[-1], {"layers.1": ckpts[0]}, output="killed")
    proc = start_apply(recipe, "-j", "2")
    wait_for_line(proc, "rank ")
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    time.sleep(0.5)
    assert not (run / "killed").exists()
    again = tailor("--apply", recipe, "-j", "2")
    assert again.returncode == 0, again.stderr
    assert "sharing its sources' blocks" in again.stdout and hidden(run) == []
    assert tailor("--verify", recipe).returncode == 0


def test_two_slurm_tasks_each_clone_and_patch_their_own_ranks(real_run, xfs):
    """A job over several processes: each clones and patches the files of its ranks; process 0 adds up
    what every process shared, and the output is the one a single process writes."""
    run, spec, ckpts = on_xfs(real_run, xfs, "ds_bf16_3_subgroups")
    picks = {"layers.0": ckpts[0], "layers.1": ckpts[1]}
    (run / "team").mkdir()
    (run / "alone").mkdir()
    recipe = write_recipe(run / "team", ckpts[-1], picks, output="out")
    alone = tailor("--apply", write_recipe(run / "alone", ckpts[-1], picks, output="out"))
    tasks = slurm_tasks(["--apply", recipe], job="4747")
    said = [task.communicate(timeout=300) for task in tasks]
    assert [task.returncode for task in tasks] == [0, 0], said
    lead = said[0][0]
    assert "sharing its sources' blocks (reflink)" in lead and "sharing" in alone.stdout, (lead, alone.stdout)
    assert _shared_line(lead) == _shared_line(alone.stdout)  # every process's shares, added up
    # process 0's log says what each rank shared, its own and the other process's (posted with their progress)
    ends = {line.split(":")[0] for line in said[0][1].splitlines()
            if re.fullmatch(r"rank \d+: done, .+ written, .+ sharing its sources' blocks \(reflink\)", line)}
    assert ends == {f"rank {r}" for r in range(spec.world_size)}, said[0][1]
    assert output_files(run / "team" / "out") == output_files(run / "alone" / "out")
    assert tailor("--verify", recipe).returncode == 0


def _shared_line(log: str) -> str:
    return next(line for line in log.splitlines() if line.startswith("sharing its sources' blocks"))


def test_where_blocks_cannot_be_shared_every_byte_is_written(tmp_path):
    """ext4, tmpfs, another filesystem: `clone` says it cannot and leaves the output empty."""
    if filesystem_type(tmp_path) in {"xfs", "btrfs", "zfs", "bcachefs"}:
        pytest.skip(f"{tmp_path} is on {filesystem_type(tmp_path)}, which may share blocks")
    src, dst = tmp_path / "a", tmp_path / "b"
    src.write_bytes(os.urandom(1 << 16))
    fin, fout = os.open(src, os.O_RDONLY), os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    try:
        assert clone(fin, fout) is None and os.fstat(fout).st_size == 0
    finally:
        os.close(fin)
        os.close(fout)
    assert may_share(src, tmp_path) is None


def test_on_a_network_filesystem_the_server_copies_or_every_byte_is_written(tmp_path, monkeypatch):
    """NFS 4.2, CephFS, SMB: no FICLONE, a copy in the server (`copy_file_range`) instead. Here on a local
    filesystem that cannot clone, told it is NFS: the copy is whole, or, cut short, the output is left
    empty for the writer to write every byte (never half a file)."""
    if filesystem_type(tmp_path) in {"xfs", "btrfs", "zfs", "bcachefs"}:
        pytest.skip(f"{tmp_path} is on {filesystem_type(tmp_path)}, which clones with FICLONE first")
    src = tmp_path / "a"
    src.write_bytes(os.urandom((1 << 16) + 7))

    def cloned(name: str) -> tuple[str | None, bytes]:
        fin, fout = os.open(src, os.O_RDONLY), os.open(tmp_path / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        try:
            return clone(fin, fout, fs_type="nfs4"), (tmp_path / name).read_bytes()
        finally:
            os.close(fin)
            os.close(fout)

    assert cloned("whole") == ("server-side copy", src.read_bytes())
    copy = os.copy_file_range
    monkeypatch.setattr(os, "copy_file_range", lambda fin, fout, n, at, to: copy(fin, fout, min(n, 4096), at, to)
                        if at == 0 else 0)  # the server stops after 4 KiB
    assert cloned("short") == (None, b"")


def test_clone_shares_a_file_and_says_so_on_xfs(xfs):
    src, dst = xfs / "c", xfs / "d"
    src.write_bytes(os.urandom(1 << 20))
    fin, fout = os.open(src, os.O_RDONLY), os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    try:
        assert clone(fin, fout) == "reflink"
    finally:
        os.close(fin)
        os.close(fout)
    assert dst.read_bytes() == src.read_bytes() and shared_bytes(dst) == 1 << 20
    assert filesystem_type(xfs) == "xfs" and may_share(src, xfs) == "the base's xfs filesystem"


def test_the_log_and_the_composer_say_what_was_written_and_what_shared():
    from tailor_tui.compose.compose_run import Composed

    plain = Composed(output=Path("out"), seconds=1.0, bytes_written=3 << 30, peak_rss=0)
    assert plain.amount() == "3.0 GiB written"
    cloned = Composed(output=Path("out"), seconds=1.0, bytes_written=3 << 30, peak_rss=0,
                      bytes_shared=(3 << 30) - (135 << 20), shared_how="reflink")
    assert cloned.amount() == "3.0 GiB: 135.0 MiB written, 2.9 GiB sharing its sources' blocks (reflink)"
