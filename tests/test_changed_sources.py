"""Every byte an output relies on is checked where it is used, at the speed of a clone too (issue 58):
bit rot in a kept row after the run's statistics is refused, a checkpoint saved again between the
plan and the workers' reads is refused, and `--verify` names a source that changed since the
composition instead of comparing with its new bytes. Each through the real command line, on real runs.

Bit rot here is real: the byte is changed on the loop XFS's disk image, under the filesystem, so
the file's device, inode, size, mtime and ctime stay as they were (the run's cached statistics still
name the file as it is); its page cache is dropped so the next read sees the disk.
"""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
import sys
import zipfile
import zlib
from pathlib import Path

import pytest
from helpers import assert_one_line_error, flat_record, hidden, on_xfs, tailor, tensors, write_recipe

from tailor_tui.checked.files import FileIdentity, PlannedFiles
from tailor_tui.checkpoints.cache import cache_dir
from tailor_tui.checkpoints.scan import scan
from tailor_tui.errors import CheckpointError
from tailor_tui.health.stats_run import compute_health


def _record_data(path: Path, suffix: str) -> tuple[zipfile.ZipInfo, int]:
    """The zip entry of the record whose name ends with `suffix`, and where its data starts."""
    with zipfile.ZipFile(path) as z:
        info = next(i for i in z.infolist() if i.filename.endswith(suffix))
    with open(path, "rb") as f:
        f.seek(info.header_offset + 26)
        name_len, extra_len = struct.unpack("<HH", f.read(4))
    return info, info.header_offset + 30 + name_len + extra_len


def real_sync(*files: Path) -> None:
    """sync (of `files`, or of everything): for real where the suite runs under eatmydata, whose preloaded
    library makes this process's sync and fsync no-ops (`sync`, a process of its own, without it)."""
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    subprocess.run(["sync", *map(str, files)], check=True, env=env)


def _physical(path: Path, offset: int) -> int:
    """Where byte `offset` of `path` lies on its filesystem's device (FIEMAP, through `filefrag`)."""
    real_sync()  # every page of the file on its disk: none written back over the rot later
    done = subprocess.run(["filefrag", "-v", "-b1", str(path)], capture_output=True, text=True, check=True)
    for line in done.stdout.splitlines():
        fields = line.replace(":", " ").replace("..", " ").split()
        if len(fields) >= 6 and fields[0].isdigit():
            start, end, physical = int(fields[1]), int(fields[2]), int(fields[3])
            if start <= offset <= end:
                return physical + offset - start
    raise AssertionError(f"no extent of {path} holds byte {offset}:\n{done.stdout}")


def rot_on_disk(xfs: Path, path: Path, offset: int, data: bytes) -> None:
    """Write `data` at byte `offset` of `path` under the filesystem (into the loop XFS's image), as bit
    rot would: nothing of the file's identity changes; its cached pages are dropped."""
    where = _physical(path, offset)
    assert where // 4096 == (where + len(data) - 1) // 4096, "one block"
    with open(xfs.parent / "image", "r+b") as image:
        image.seek(where)
        image.write(data)
    real_sync(xfs.parent / "image")  # on the image's disk: a loop device may read it there (direct I/O)
    for drop in (_drop_file_pages, _drop_page_cache):  # the file's pages; where one stays (in use), every clean page
        drop(path)
        if _read(path, offset, len(data)) == data:
            return
    raise AssertionError(f"{path}: its cached pages could not be dropped: the rot is not seen through the filesystem")


def _drop_file_pages(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _drop_page_cache(_path: Path) -> None:
    Path("/proc/sys/vm/drop_caches").write_text("1\n")


def _read(path: Path, offset: int, n: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(n)


def nan_in_place(path: Path, suffix: str, where: float) -> None:
    """Training saving the file again in place, a NaN inside: a float32 NaN written into a record and the
    record's CRC-32 made right in both its headers (a valid archive); the same inode, a new ctime."""
    info, data = _record_data(path, suffix)
    at = data + (int(info.file_size * where) // 4) * 4
    with open(path, "r+b") as f:
        f.seek(at)
        f.write(struct.pack("<f", float("nan")))
        f.seek(data)
        value = zlib.crc32(f.read(info.file_size))
        f.seek(info.header_offset + 14)
        f.write(struct.pack("<I", value))
        if info.flag_bits & 0x08:  # a data descriptor after the data holds it too (torch's writer adds one)
            f.seek(data + info.file_size)
            f.seek(data + info.file_size + (4 if f.read(4) == b"PK\x07\x08" else 0))
            f.write(struct.pack("<I", value))
        with zipfile.ZipFile(path) as z:
            z.fp.seek(z.start_dir)  # the central directory: this record's entry holds the CRC-32 too
            directory = z.fp.read()
            start = z.start_dir
        entry = 0
        while directory[entry: entry + 4] == b"PK\x01\x02":
            name_len, extra_len, comment_len = struct.unpack_from("<3H", directory, entry + 28)
            if directory[entry + 46: entry + 46 + name_len].decode() == info.filename:
                f.seek(start + entry + 16)
                f.write(struct.pack("<I", value))
                break
            entry += 46 + name_len + extra_len + comment_len
        else:
            raise AssertionError(f"{info.filename} not in the central directory of {path}")
    with zipfile.ZipFile(path) as z:
        assert z.testzip() is None, "the archive is valid: every CRC-32 right"


def _rank0(ckpt: Path) -> Path:
    return sorted(ckpt.rglob("*rank_0_mp_rank_00_optim_states.pt"))[0]


def test_bit_rot_in_a_kept_row_after_the_statistics_is_refused_and_nothing_published(real_run, xfs):
    """The base's kept bytes rot after `--stats` vouched for its rows, the file's identity unchanged: a
    clone still reads every byte it keeps once and checks it against its record's CRC-32 (the statistics'
    are evidence of what the bytes should be, not of what they are now): exit 4, nothing published, as
    `--no-clone` does."""
    run, _spec, ckpts = on_xfs(real_run, xfs, "hf_bf16_2")
    rotten_run = xfs / "rotten-run"
    shutil.copytree(run, rotten_run)
    ckpts = [rotten_run / c.relative_to(run) for c in ckpts]
    (rotten_run / "rot").mkdir()
    recipe = write_recipe(rotten_run / "rot", ckpts[-1], {"layers.0": ckpts[0]}, output="out")
    # the run's statistics (`--stats`'s), with blocks of 4 KiB: a test run's record is dozens of them, as a
    # real run's is of the 1 MiB blocks `--stats` records (the rot lies in one the recipe does not cut)
    compute_health(tuple(scan(rotten_run).checkpoints), cache=cache_dir(), crc_block=4096, workers=1)

    rank0 = _rank0(ckpts[-1])
    info, data = _record_data(rank0, flat_record(rank0))
    before = FileIdentity.of(os.stat(rank0))
    at = data + (int(info.file_size * 0.9) // 4) * 4  # a kept row (the recipe takes layers.0 only)
    rot_on_disk(xfs, rank0, at, struct.pack("<f", float("nan")))
    assert FileIdentity.of(os.stat(rank0)) == before and _read(rank0, at, 4) == struct.pack("<f", float("nan"))

    for how in ([], ["--no-clone"]):
        failed = tailor("--apply", recipe, *how)
        assert_one_line_error(failed, 4, str(rank0), "CRC")
        assert not (rotten_run / "rot" / "out").exists() and hidden(rotten_run / "rot") == []


def _copied_with_recipe(run: Path, folder: Path) -> tuple[list[Path], Path]:
    """`run` copied to `folder`: its checkpoints, oldest first, and a recipe in folder/out taking layers.0
    from the oldest onto the newest, writing folder/out/composed."""
    shutil.copytree(run, folder)
    ckpts = sorted((p for p in folder.iterdir() if p.name.startswith("checkpoint-")),
                   key=lambda p: int(p.name.split("-")[1]))
    (folder / "out").mkdir()
    return ckpts, write_recipe(folder / "out", ckpts[-1], {"layers.0": ckpts[0]}, output="composed")


# The command line's own entry point, in a process of its own, with one fault-injection point of the
# test's: just before `module.function` runs (`compose_run.run_compose`: after the plan was made and the
# statistics vouched for its rows; `stats_run.compute_health`: after the run was scanned), training saves
# a rank file (`path`) again in place, a NaN inside (record `record`).
_SAVED_AGAIN = """
import sys
from pathlib import Path
sys.path.insert(0, {tests!r})
from test_changed_sources import nan_in_place
from tailor_tui.cli.main import main
import {module} as where

real = where.{function}
def saved_again(*args, **kwargs):
    nan_in_place(Path({path!r}), {record!r}, 0.9)
    return real(*args, **kwargs)
where.{function} = saved_again
sys.exit(main(sys.argv[1:]))
"""


def saved_again(path: Path, module: str, function: str, *args: str, env: dict | None = None):
    """tailor-tui `args`, `path` saved again just before `module.function` runs (`_SAVED_AGAIN`)."""
    script = _SAVED_AGAIN.format(tests=str(Path(__file__).parent), path=str(path), record=flat_record(path),
                                 module=module, function=function)
    return subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=300,
                          stdin=subprocess.DEVNULL, env=dict(os.environ, PYTHONWARNINGS="ignore", **(env or {})))


@pytest.mark.parametrize("where", ["xfs after --stats", "plain"])
def test_a_base_saved_again_between_the_plan_and_the_read_is_refused(real_run, xfs, tmp_path, where):
    """Each task compares every file it reads (fstat of what it opened, in the worker) with the identity the
    plan recorded: a base saved again in place after the plan is refused in one line naming it (exit 4), on
    a clone whose kept rows the statistics vouched for too, and nothing is published."""
    if where == "plain":
        run, _spec = real_run("hf_bf16_2")
        folder = tmp_path / "run"
    else:
        run, _spec, _ckpts = on_xfs(real_run, xfs, "hf_bf16_2")
        folder = xfs / "saved-again"
    ckpts, recipe = _copied_with_recipe(run, folder)
    if where != "plain":
        assert tailor("--stats", folder).returncode == 0
    rank0 = _rank0(ckpts[-1])
    done = saved_again(rank0, "tailor_tui.compose.compose_run", "run_compose", "--apply", str(recipe))
    assert_one_line_error(done, 4, str(rank0), "changed since the composition was planned", "ctime")
    assert not (folder / "out" / "composed").exists() and hidden(folder / "out") == []


def test_statistics_of_a_checkpoint_saved_again_after_the_scan_are_refused(real_run, tmp_path):
    """The statistics' tasks read only the files the scan recorded, checked by fstat before and after they
    read: a rank file saved again in between is one line naming it (exit 4), and no sums or facts of its
    old identity are cached from its new bytes; the next `--stats` reads it anew and finds its NaN."""
    run, _spec = real_run("hf_bf16_2")
    ckpts, _recipe = _copied_with_recipe(run, tmp_path / "run")
    rank0 = _rank0(ckpts[-1])
    done = saved_again(rank0, "tailor_tui.health.stats_run", "compute_health", "--stats", str(tmp_path / "run"),
                       "-j", "1", env={"TAILOR_TUI_CACHE": str(tmp_path / "cache")})
    assert_one_line_error(done, 4, str(rank0), "changed since the run was scanned", "ctime")
    again = tailor("--stats", tmp_path / "run", env={"TAILOR_TUI_CACHE": str(tmp_path / "cache")})
    assert again.returncode == 0, again.stderr
    assert "NaN×1" in again.stdout, again.stdout


def test_verify_names_a_source_changed_since_the_composition(real_run, tmp_path):
    """The output's provenance record holds each source file's identity as the composition read it:
    `--verify` of an output whose source was saved again since says so, naming the file (exit 7), and
    does not compare the output with the source's new bytes."""
    run, _spec = real_run("hf_bf16_2")
    folder = tmp_path / "run"
    ckpts, recipe = _copied_with_recipe(run, folder)
    applied = tailor("--apply", recipe)
    assert applied.returncode == 0, applied.stderr
    assert tailor("--verify", recipe).returncode == 0

    source = _rank0(ckpts[0])
    nan_in_place(source, flat_record(source), 0.1)
    verified = tailor("--verify", recipe)
    assert verified.returncode == 7, verified.stdout + verified.stderr
    said = verified.stdout + verified.stderr
    assert f"{source}: changed since the composition (its mtime, its ctime)" in said, said
    assert "Traceback" not in said


def test_planned_files_refuse_a_file_changed_before_or_while_it_is_read(tmp_path):
    path = tmp_path / "file"
    path.write_bytes(b"x" * 100)
    planned = {path: FileIdentity.of(os.stat(path))}
    with PlannedFiles(planned):  # unchanged: read
        assert path.read_bytes() == b"x" * 100
    with pytest.raises(CheckpointError, match="changed while it was read"):
        with PlannedFiles(planned):
            with open(path, "r+b") as f:  # written in place meanwhile: the same size, mtime set back
                f.write(b"y")
            os.utime(path, ns=(planned[path].mtime_ns, planned[path].mtime_ns))
    with pytest.raises(CheckpointError, match="changed since the composition was planned"):
        with PlannedFiles(planned):
            pass
    replaced = tmp_path / "new"
    replaced.write_bytes(b"x" * 100)
    os.replace(replaced, path)  # another file renamed over it
    with pytest.raises(CheckpointError, match="another file is in its place"):
        with PlannedFiles({path: planned[path]}):
            pass


def _change_a_row(out: Path, row: str) -> None:
    """Change one fp32 element of `row` in rank 0's optim file of the output `out`, as a sound file (torch
    saves it again: its CRC-32s right), as a later edit of the output would."""
    import torch

    from tailor_tui.checkpoints.checkpoint import open_checkpoint
    from tailor_tui.formats.ds_format import flat_tensor, optimizer_state

    composed = open_checkpoint(out)
    owner = composed.param_to_row()
    slot = next(s for s in composed.layout.slots if owner[s.name] == row and s.valid(0))
    path = composed.ranks[0].optim_states
    obj = torch.load(path, weights_only=False)
    inner = optimizer_state(obj, path, tuple(composed.layout.group_sizes()))
    flat = flat_tensor(inner, slot.group, "fp32")
    with torch.no_grad():
        flat[slot.offset] = -flat[slot.offset] - 1
    torch.save(obj, path)


@pytest.mark.parametrize("world_size", [None, "1"])
def test_verify_proves_an_output_whose_source_changed_by_what_was_taken(real_run, tmp_path, world_size):
    """Training saves a source again after the composition (a NaN in its rank 0's optim file, a valid
    archive): `--verify` says so (exit 7, a CHANGED line naming the file), does not compare the output with
    its new bytes, and still proves every row against the CRC-32s the output's provenance record keeps of
    what each rank took, and each tensor the model file took from it against those of what that file took,
    at the base's world size and resharded: nothing is left unproven. A row edited in the output afterwards,
    in a rank file or in the model file, is a FAIL, proven wrong by the record alone."""
    import json

    run, _spec = real_run("hf_bf16_2")
    ckpts, recipe = _copied_with_recipe(run, tmp_path / "run")
    extra = ("--world-size", world_size) if world_size else ()
    applied = tailor("--apply", recipe, *extra)
    assert applied.returncode == 0, applied.stderr
    out = recipe.parent / "composed"
    record = json.loads((out / "tailor_provenance.json").read_text())
    taken, weights = record["taken"], record["taken_weights"]
    ranks = int(world_size) if world_size else 2
    assert list(taken) == [str(r) for r in range(ranks)], list(taken)
    assert all(set(rows["layers.0"]) == {"fp32", "exp_avg", "exp_avg_sq"} for rows in taken.values()), taken
    assert list(weights) == ["model.safetensors"], weights
    assert list(weights["model.safetensors"]) == sorted(tensors(out / "model.safetensors")), weights  # every one
    assert list(record["weight_headers"]) == ["model.safetensors"], record  # and its header

    source = _rank0(ckpts[0])
    nan_in_place(source, flat_record(source), 0.1)  # saved again: layers.0 is among what it holds
    verified = tailor("--verify", recipe, *extra)
    said = verified.stdout + verified.stderr
    assert verified.returncode == 7, said
    changed = [line for line in verified.stdout.splitlines() if line.startswith("CHANGED")]
    assert changed == [f"CHANGED  {source}: changed since the composition (its mtime, its ctime)"], said
    assert "FAIL" not in verified.stdout and "Traceback" not in said, said
    assert any(line.startswith("ok") and "layers.0" in line for line in verified.stdout.splitlines()), said
    assert "UNPROVEN" not in verified.stdout, said
    assert "hold what the composition took" in verified.stderr.splitlines()[-1], said
    assert "ok    layers.0      checkpoint-2: as the composition took it" in verified.stdout, said

    _change_a_row(out, "layers.0")  # the row the changed source gave: proven wrong by the record alone
    edited = tailor("--verify", recipe, *extra)
    failed = [line for line in edited.stdout.splitlines() if line.startswith("FAIL")]
    assert edited.returncode == 7 and len(failed) == 1 and "layers.0" in failed[0], edited.stdout
    assert f"differs from what the composition took from {ckpts[0].name}" in failed[0], failed
    assert "do not resume from this output" in edited.stderr, edited.stderr

    tensor = next(name for name in weights["model.safetensors"] if ".layers.0." in name)
    _change_a_tensor(out / "model.safetensors", tensor)
    edited = tailor("--verify", recipe, "-v", *extra)  # (-v: every problem of the row, the rank file's first)
    assert edited.returncode == 7, edited.stdout
    assert (f"model.safetensors: {tensor} (row layers.0) differs from what the composition took from "
            f"{ckpts[0].name}") in edited.stdout, edited.stdout


@pytest.mark.parametrize("world_size", [None, "1"])
def test_verify_proves_an_output_whose_base_changed_by_what_was_taken_and_copied(real_run, tmp_path, world_size):
    """The base saved again after the composition: its rows in the output are proven against what each rank
    took, the rest of each rank file (the optimizer's param groups, steps and counters, model_states) against
    the records the composition wrote (the CRC-32 of each file's records' listing), and each run-level file
    copied from it (trainer_state.json, the scheduler, RNG states, configs, `latest`) against the CRC-32 the
    record keeps of the bytes copied, and the model file's header and every tensor (the base's kept ones
    too) against the CRC-32s the record keeps of them, at the base's world size and resharded: nothing is
    left unproven. A copied file, a rank file's state, a model file's kept tensor or its header edited in
    the output afterwards is a FAIL, proven by the record alone."""
    import json

    import torch

    run, _spec = real_run("hf_bf16_2")
    ckpts, recipe = _copied_with_recipe(run, tmp_path / "run")
    extra = ("--world-size", world_size) if world_size else ()
    assert tailor("--apply", recipe, *extra).returncode == 0
    out = recipe.parent / "composed"
    record = json.loads((out / "tailor_provenance.json").read_text())
    copied, archives = record["copied"], record["archives"]
    assert {"trainer_state.json", "scheduler.pt", "config.json", "latest"} <= set(copied), copied
    assert all(zlib.crc32((out / f).read_bytes()) == value for f, value in copied.items()), copied
    assert len(archives) == 2 * int(world_size or 2) and all((out / f).is_file() for f in archives), archives

    source = _rank0(ckpts[-1])
    nan_in_place(source, flat_record(source), 0.5)
    verified = tailor("--verify", recipe, *extra)
    said = verified.stdout + verified.stderr
    assert verified.returncode == 7 and "FAIL" not in verified.stdout and "Traceback" not in said, said
    assert f"CHANGED  {source}: changed since the composition" in verified.stdout, said
    assert "ok    layers.1      checkpoint-6: as the composition took it" in verified.stdout, said
    assert "UNPROVEN" not in verified.stdout, said
    assert "hold what the composition took" in verified.stderr.splitlines()[-1], said

    state = out / "trainer_state.json"
    state.write_text(state.read_text().replace('"global_step": 6', '"global_step": 7'))
    optim = sorted(out.rglob("*rank_0_mp_rank_00_optim_states.pt"))[0]
    saved = torch.load(optim, weights_only=False)
    saved["ds_version"] += "+edited"  # the state around the rows edited, the rows untouched
    torch.save(saved, optim)
    kept = "model.norm.weight"  # a row kept from the base (`_copied_with_recipe` moves layers.0 alone)
    _change_a_tensor(out / "model.safetensors", kept)
    edited = tailor("--verify", recipe, *extra)
    assert edited.returncode == 7, edited.stdout
    assert (f"FAIL  {state}: differs from what the composition copied from the base's trainer_state.json"
            in edited.stdout), edited.stdout
    assert f"FAIL  {optim}: its records are not those the composition wrote" in edited.stdout, edited.stdout
    assert (f"model.safetensors: {kept} (row norm) differs from what the composition took from {ckpts[-1].name}"
            in edited.stdout), edited.stdout

    model = out / "model.safetensors"
    data = bytearray(model.read_bytes())
    at = data.index(b'"format":"pt"')  # the header's metadata edited (a sound file still): not the one written
    data[at + 11] = ord("x")
    model.write_bytes(bytes(data))
    header = tailor("--verify", recipe, *extra)
    assert header.returncode == 7, header.stdout
    assert f"FAIL  {model}: its header is not the one the composition wrote" in header.stdout, header.stdout


def test_verify_proves_a_torch_format_weight_file_whose_source_changed_by_what_was_taken(real_run, tmp_path):
    """transformers 4.x's `pytorch_model.bin`: the provenance record keeps the CRC-32 of each storage the file
    took from a source, under its tensors' names; once that
    source changed, `--verify` proves them against it (nothing unproven), and a tensor edited in the output
    afterwards is a FAIL proven by the record alone."""
    import json

    import torch

    run, _spec = real_run("hf_bin")
    ckpts, recipe = _copied_with_recipe(run, tmp_path / "run")
    assert tailor("--apply", recipe).returncode == 0
    out = recipe.parent / "composed"
    weights = json.loads((out / "tailor_provenance.json").read_text())["taken_weights"]
    assert list(weights) == ["pytorch_model.bin"] and weights["pytorch_model.bin"], weights
    assert all(".layers.0." in name for name in weights["pytorch_model.bin"]), weights  # what it took, no more

    source = _rank0(ckpts[0])
    nan_in_place(source, flat_record(source), 0.1)
    verified = tailor("--verify", recipe)
    said = verified.stdout + verified.stderr
    assert verified.returncode == 7 and "CHANGED" in verified.stdout, said
    assert "FAIL" not in verified.stdout and "UNPROVEN" not in verified.stdout and "Traceback" not in said, said
    assert "hold what the composition took" in verified.stderr.splitlines()[-1], said

    tensor = next(iter(weights["pytorch_model.bin"]))
    state = torch.load(out / "pytorch_model.bin", weights_only=True)
    with torch.no_grad():
        state[tensor].view(-1)[0] += 1
    torch.save(state, out / "pytorch_model.bin")  # a sound archive, edited afterwards
    edited = tailor("--verify", recipe, "-v")
    assert edited.returncode == 7, edited.stdout
    assert (f"pytorch_model.bin: {tensor} (row layers.0) differs from what the composition took from "
            f"{ckpts[0].name}") in edited.stdout, edited.stdout


def test_verify_proves_a_torch_format_weight_file_whose_base_changed_by_its_records(real_run, tmp_path):
    """`pytorch_model.bin` once the base changed: its names, their order and the base's kept tensors are
    proven by the listing of the file's records the provenance record keeps (each record checked against its
    stored CRC-32 as it is read); nothing is unproven, and a kept tensor edited afterwards is a FAIL."""
    import torch

    run, _spec = real_run("hf_bin")
    ckpts, recipe = _copied_with_recipe(run, tmp_path / "run")
    assert tailor("--apply", recipe).returncode == 0
    out = recipe.parent / "composed"
    base = _rank0(ckpts[-1])
    nan_in_place(base, flat_record(base), 0.5)
    proven = tailor("--verify", recipe)
    said = proven.stdout + proven.stderr
    assert proven.returncode == 7 and "CHANGED" in proven.stdout, said
    assert "FAIL" not in proven.stdout and "UNPROVEN" not in proven.stdout, said
    kept = "model.norm.weight"  # kept from the base
    state = torch.load(out / "pytorch_model.bin", weights_only=True)
    with torch.no_grad():
        state[kept].view(-1)[0] += 1
    torch.save(state, out / "pytorch_model.bin")
    edited = tailor("--verify", recipe)
    assert edited.returncode == 7, edited.stdout
    assert f"FAIL  {out / 'pytorch_model.bin'}: its records are not those the composition wrote" in edited.stdout, \
        edited.stdout


def _change_a_tensor(path: Path, name: str) -> None:
    """Flip a bit of tensor `name` in the safetensors file `path`, in place (a sound file still: safetensors
    keeps no checksum)."""
    import json

    data = path.read_bytes()
    (header_len,) = struct.unpack("<Q", data[:8])
    at = 8 + header_len + json.loads(data[8: 8 + header_len])[name]["data_offsets"][0]
    with open(path, "r+b") as f:
        f.seek(at)
        f.write(bytes([data[at] ^ 0x01]))


def test_verify_of_an_output_whose_record_holds_no_crcs_compares_nothing_once_a_source_changed(real_run, tmp_path):
    """An output of an older tailor-tui (its provenance record without what was taken): a source changed
    since the composition leaves nothing to prove its rows by; `--verify` says so and compares nothing
    (exit 7)."""
    import json

    run, _spec = real_run("hf_bf16_2")
    ckpts, recipe = _copied_with_recipe(run, tmp_path / "run")
    assert tailor("--apply", recipe).returncode == 0
    record_file = recipe.parent / "composed" / "tailor_provenance.json"
    record = json.loads(record_file.read_text())
    del record["taken"]
    record_file.write_text(json.dumps(record))
    assert tailor("--verify", recipe).returncode == 0  # its sources as they were: compared with them
    source = _rank0(ckpts[0])
    nan_in_place(source, flat_record(source), 0.1)
    verified = tailor("--verify", recipe)
    assert verified.returncode == 7, verified.stdout + verified.stderr
    assert f"FAIL  {source}: changed since the composition" in verified.stdout, verified.stdout
    assert "the output is not compared" in verified.stdout and "CHANGED" not in verified.stdout
    assert "do not resume" in verified.stderr


@pytest.mark.parametrize("world_size", [None, "1"])
def test_verify_proves_an_output_whose_source_was_deleted_since(real_run, tmp_path, world_size):
    """The HF Trainer's save_total_limit deletes old checkpoints: `--verify` of an output whose source was
    deleted since the composition plans it from the output's provenance record (the base's layout, nothing
    of it read), says so in one CHANGED line (exit 7), and proves the rows and model-file tensors it gave
    against what was taken, at the base's world size and resharded. Without the record to plan it by, the
    missing folder is the one line it always was (exit 4)."""
    import json

    run, _spec = real_run("hf_bf16_2")
    ckpts, recipe = _copied_with_recipe(run, tmp_path / "run")
    extra = ("--world-size", world_size) if world_size else ()
    assert tailor("--apply", recipe, *extra).returncode == 0
    out = recipe.parent / "composed"
    files = len(json.loads((out / "tailor_provenance.json").read_text())["sources"][0]["files"])
    shutil.rmtree(ckpts[0])  # rotated away

    verified = tailor("--verify", recipe, *extra)
    said = verified.stdout + verified.stderr
    assert verified.returncode == 7, said
    changed = [line for line in verified.stdout.splitlines() if line.startswith("CHANGED")]
    assert changed == [f"CHANGED  {ckpts[0]}: gone since the composition (it read {files:,} file(s) there)"], said
    assert "FAIL" not in verified.stdout and "UNPROVEN" not in verified.stdout and "Traceback" not in said, said
    assert "ok    layers.0      checkpoint-2: as the composition took it" in verified.stdout, said

    _change_a_row(out, "layers.0")
    edited = tailor("--verify", recipe, *extra)
    assert edited.returncode == 7 and "FAIL  layers.0" in edited.stdout, edited.stdout

    (out / "tailor_provenance.json").unlink()  # nothing to plan the deleted source by
    assert_one_line_error(tailor("--verify", recipe, *extra), 4, str(ckpts[0]), "no such checkpoint folder")


def test_verify_of_an_output_whose_partial_source_was_deleted_says_it_is_gone(real_run, tmp_path):
    """A partial save's rows and slices are its own: an output that took rows from one deleted since cannot be
    planned again from its record. --verify says which source is gone (CHANGED) and that nothing was compared,
    exit 7 — not that the recipe names a missing folder (exit 4), as if the recipe were wrong."""
    from helpers import compose_newest_per_row

    source, _spec = real_run("ds_selective_parity")
    runs = tmp_path / "runs"
    shutil.copytree(source / "run", runs)
    (_full, p4, _p6), _out = compose_newest_per_row(runs, tmp_path)
    shutil.rmtree(p4.path)
    verified = tailor("--verify", tmp_path / "recipe.yaml")
    said = verified.stdout + verified.stderr
    assert verified.returncode == 7, said
    assert [line for line in verified.stdout.splitlines() if line.startswith("CHANGED")] == [
        next(line for line in verified.stdout.splitlines() if line.startswith(f"CHANGED  {p4.path}: gone since"))], said
    errors = [line for line in verified.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and str(p4.path) in errors[0] and "nothing of it was compared" in errors[0], said
    assert "Traceback" not in said
