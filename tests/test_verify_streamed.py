"""`--verify` streamed: each byte of each file read once, compared where it is read, in bounded memory, without
torch; what it failed before it still fails (a flipped byte whose CRC-32 was fixed, a row's bytes from the wrong
checkpoint, a damaged output record), row by row."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
import zlib
from pathlib import Path

import pytest
from conftest import checkpoints_of
from helpers import tailor, write_recipe

from tailor_tui.formats.ptfile import read_structure

ROOT = Path(__file__).resolve().parent.parent


def _composed(real_run, tmp_path, name="ds_bf16_3_subgroups"):
    run, spec = real_run(name)
    c2, c4, c6 = checkpoints_of(run, spec)
    recipe = write_recipe(tmp_path, c6, {"layers.1": c2, "embed_tokens": c4})
    applied = tailor("--apply", recipe)
    assert applied.returncode == 0, applied.stderr
    return recipe, tmp_path / "composed", (c2, c4, c6)


def _slot(recipe: Path, row: str, rank: int):
    """A slot of `row` that rank `rank` holds elements of, and the base's layout."""
    from tailor_tui.planning.build import build_plan
    from tailor_tui.planning.recipe_file import load_recipe

    plan = build_plan(load_recipe(recipe), check_output=False)
    param_row = plan.base.param_to_row()
    return next(s for s in plan.base.layout.slots if param_row[s.name] == row and s.valid(rank)), plan


def _write_keeping_crc(path: Path, at: int, data: bytes) -> None:
    """Write `data` at byte `at` of the zip-format torch file `path`, inside one record, and set that record's
    CRC-32 (its local header or data descriptor, and its central directory entry) to what its bytes now give:
    a change no CRC check notices, only a comparison."""
    _obj, records, _prefix = read_structure(path)
    record = next(r for r in records.values() if r.data_offset <= at < r.data_offset + r.size)
    with open(path, "r+b") as f:
        f.seek(at)
        f.write(data)
        f.seek(record.data_offset)
        value = zlib.crc32(f.read(record.size))
        for where in record.crc_offsets:
            f.seek(where)
            f.write(value.to_bytes(4, "little"))
    with zipfile.ZipFile(path) as z:
        assert z.testzip() is None  # every record's CRC-32 holds


def _slot_at(path: Path, slot, key: str = "fp32") -> int:
    """The first byte of `slot`'s elements of flat tensor `key` in the optim file `path`."""
    from tailor_tui.formats.ds_format import flat_tensor
    from tailor_tui.formats.ptfile import locate

    obj, records, prefix = read_structure(path)
    tb = locate(flat_tensor(obj["optimizer_state_dict"], slot.group, key), records, prefix)
    return tb.offset + slot.offset * tb.itemsize


def _fails(result, *rows: str) -> list[str]:
    failed = [line for line in result.stdout.splitlines() if line.startswith("FAIL")]
    assert result.returncode == 7, result.stdout + result.stderr
    assert sorted(line.split()[1] for line in failed) == sorted(rows), result.stdout
    return failed


@pytest.mark.parametrize("key", ["fp32", "exp_avg_sq"])
def test_a_flipped_byte_whose_crc_was_fixed_fails_its_row_alone(real_run, tmp_path, key):
    recipe, out, _ = _composed(real_run, tmp_path)
    slot, _plan = _slot(recipe, "layers.1", 1)
    optim = next(out.glob("*/*rank_1_*optim_states.pt"))
    at = _slot_at(optim, slot, key)
    with open(optim, "rb") as f:
        f.seek(at + 4)
        byte = f.read(1)[0]
    _write_keeping_crc(optim, at + 4, bytes([byte ^ 0x01]))
    failed = _fails(tailor("--verify", recipe), "layers.1")
    assert f"rank 1: {key} of {slot.name} differs from" in failed[0], failed


def test_ranks_verified_in_worker_processes_find_what_one_process_finds(real_run, tmp_path, monkeypatch):
    """A wide run's ranks are verified in shares by worker processes (`ranks_per_process`: 16 by default, 1 here for a
    3-rank run): the same findings as one process, a planted defect among them, and every rank's progress here."""
    from tailor_tui.events import TaskFinished
    from tailor_tui.team import workers
    from tailor_tui.verifying.against_recipe import verify_against_recipe

    recipe, out, _ = _composed(real_run, tmp_path)
    slot, plan = _slot(recipe, "layers.1", 1)
    optim = next(out.glob("*/*rank_1_*optim_states.pt"))
    at = _slot_at(optim, slot)
    with open(optim, "rb") as f:
        f.seek(at)
        byte = f.read(1)[0]
    _write_keeping_crc(optim, at, bytes([byte ^ 0x01]))
    one = verify_against_recipe(plan, workers=2)
    pools, original = [], workers.run_pool
    monkeypatch.setattr(workers, "run_pool", lambda calls, n, *rest, **kw: pools.append((len(calls), n)) or
                        original(calls, n, *rest, **kw))
    events: list = []
    shared = verify_against_recipe(plan, emit=events.append, workers=2, ranks_per_process=1)
    assert pools == [(3, 2)], pools  # three shares of one rank, two processes
    assert (dict(shared.problems), shared.other) == (dict(one.problems), one.other), shared
    assert [row for row, found in shared.problems.items() if found] == ["layers.1"], shared.problems
    assert f"rank 1: fp32 of {slot.name} differs from" in shared.problems["layers.1"][0], shared.problems
    assert {"rank 0", "rank 1", "rank 2"} <= {e.task for e in events if isinstance(e, TaskFinished)}, events


@pytest.mark.skipif(sys.platform != "linux", reason="workers are forked on Linux only")
def test_what_every_share_needs_reaches_the_workers_as_they_start():
    """`run_calls`' `common` (a verification's plan and checkpoints: a MiB for a wide run) is given to each forked
    worker as it starts, not pickled with each batch of calls: a value that cannot be pickled reaches them all (in
    a process of one thread, as the command line's, whose workers are forked)."""
    # (its task is its own, not `helpers.task_with_common`: importing helpers loads torch, and workers spawn then)
    script = """
import os, sys, threading
from types import SimpleNamespace
from tailor_tui.events import TaskOptions
from tailor_tui.team.workers import run_calls, start_method

class Unpicklable:
    def __init__(self, value):
        self.value = value

    def __reduce__(self):
        raise TypeError("pickled: given through a pipe")

def task_with_common(common, job, emit, cancelled, options):
    return common.value, job.task, os.getpid()

assert start_method() == "fork", start_method()
calls = [(task_with_common, (SimpleNamespace(task=f"rank {i}", total_bytes=1),)) for i in range(4)]
for workers in (1, 2):
    found = run_calls(calls, workers, lambda event: None, threading.Event(), TaskOptions(),
                      common=(Unpicklable("the plan"),))
    assert [(value, task) for value, task, _pid in found] == [("the plan", f"rank {i}") for i in range(4)], found
    assert ({pid for *_, pid in found} == {os.getpid()}) == (workers == 1), found
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert (done.returncode, done.stdout) == (0, "ok\n"), done.stderr


def test_what_every_share_needs_reaches_spawned_workers_too():
    """A process with torch loaded (the TUI's, this one) spawns its workers: `common` is pickled to each once, as it
    starts, and every call still takes it first."""
    import threading
    from types import SimpleNamespace

    from helpers import task_with_common

    from tailor_tui.events import TaskOptions
    from tailor_tui.team.workers import run_calls, start_method

    assert start_method() == "spawn"
    calls = [(task_with_common, (SimpleNamespace(task=f"rank {i}", total_bytes=1),)) for i in range(3)]
    found = run_calls(calls, 2, lambda event: None, threading.Event(), TaskOptions(), common=("the plan",))
    assert [(value, task) for value, task, _pid in found] == [("the plan", f"rank {i}") for i in range(3)], found
    assert os.getpid() not in {pid for *_, pid in found}, found


def test_a_row_from_the_wrong_checkpoint_fails(real_run, tmp_path):
    """layers.1's bytes on rank 0 are the base's (step 6), not step 2's the recipe picks: each byte is a real
    value of the right dtype, every CRC-32 holds; only a comparison with the source it names tells."""
    recipe, out, (_c2, _c4, c6) = _composed(real_run, tmp_path)
    slot, _plan = _slot(recipe, "layers.1", 0)
    optim = next(out.glob("*/*rank_0_*optim_states.pt"))
    base = next(c6.glob("*rank_0_*optim_states.pt"))
    theirs = _slot_at(base, slot)
    with open(base, "rb") as f:
        f.seek(theirs)
        wrong = f.read(slot.valid(0) * 4)
    _write_keeping_crc(optim, _slot_at(optim, slot), wrong)
    failed = _fails(tailor("--verify", recipe), "layers.1")
    assert "rank 0: fp32 of" in failed[0] and "differs from" in failed[0], failed


def test_a_damaged_output_record_is_a_failed_verification_naming_it(real_run, tmp_path):
    recipe, out, _ = _composed(real_run, tmp_path)
    slot, _plan = _slot(recipe, "layers.2", 2)  # a row of the base: the output equals it, but for the flip
    optim = next(out.glob("*/*rank_2_*optim_states.pt"))
    at = _slot_at(optim, slot)
    with open(optim, "r+b") as f:
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ 0x40]))
    result = tailor("--verify", recipe)
    assert result.returncode == 7 and "Traceback" not in result.stderr, result.stdout + result.stderr
    assert f"FAIL  {optim}: record" in result.stdout and "fails its CRC-32 check" in result.stdout, result.stdout
    assert "FAIL  layers.2" in result.stdout, result.stdout  # and the row it holds differs from its source


def test_verify_reads_each_byte_once_without_torch(real_run, tmp_path):
    """Every record of the output's files and every record of the sources the rows lie in is read exactly once
    (the engine counts what it reads), in one process that never imports torch, with a progress line per rank."""
    recipe, out, _ = _composed(real_run, tmp_path)
    probe = (
        "import sys, json\n"
        "from pathlib import Path\n"
        "from tailor_tui.planning.build import build_plan\n"
        "from tailor_tui.planning.recipe_file import load_recipe\n"
        "from tailor_tui.verifying import streamed\n"
        "from tailor_tui.verifying.against_recipe import verify_against_recipe\n"
        "read = []\n"
        "original = streamed.run\n"
        "def counted(claims, **kw):\n"
        "    outcome = original(claims, **kw)\n"
        "    read.append((outcome.read, sum(s.length for s in claims.stretches)))\n"
        "    return outcome\n"
        "streamed.run = counted\n"
        "events = []\n"
        f"report = verify_against_recipe(build_plan(load_recipe(Path({str(recipe)!r})), check_output=False),\n"
        "                               emit=events.append)\n"
        "print(json.dumps({'ok': report.ok, 'read': read, 'torch': 'torch' in sys.modules,\n"
        "                  'tasks': sorted({getattr(e, 'task', '') for e in events})}))\n")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout.splitlines()[-1])
    assert found["ok"] and not found["torch"], found
    [(read, stretches)] = found["read"]
    assert read == stretches, found  # each stretch read whole, once: no byte twice, none skipped
    # the sources' flat tensors are read beside the output's (`streamed.Spread`): none is left for a "sources" bar
    assert {"rank 0", "rank 1", "rank 2"} <= set(found["tasks"]) and "sources" not in found["tasks"], found


def _sparse_archive(path: Path, size: int) -> tuple[int, int]:
    """A zip archive laid out as torch.save lays one out (stored records, `data.pkl` then `data/0`) whose one large
    record is `size` zero bytes, written as a hole (nothing on disk): (the record's first byte, its size)."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED, allowZip64=True) as z:
        z.writestr("archive/data.pkl", b"\x80\x02}q\x00.")
        info = zipfile.ZipInfo("archive/data/0")
        with z.open(info, "w", force_zip64=True) as w:
            zero = bytes(1 << 20)
            for _ in range(size >> 20):
                w.write(zero)
    _obj, records, _prefix = read_structure(path)
    record = records["archive/data/0"]
    fd = os.open(path, os.O_RDWR)
    try:  # the zeros given back to the file system: the archive is sparse, its bytes read as zeros still
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        punch_hole_keep_size = 0x03
        libc.fallocate(fd, punch_hole_keep_size, ctypes.c_longlong(record.data_offset), ctypes.c_longlong(record.size))
    finally:
        os.close(fd)
    return record.data_offset, record.size


def test_memory_stays_bounded_on_files_many_times_the_bound(tmp_path):
    """Two archives of 1 GiB records (4x the 256 MiB a verifying process may hold), compared whole, byte for byte,
    and a flipped byte found: the comparing process's peak RSS stays far below either file's size."""
    size = 1 << 30
    out, source = tmp_path / "out.pt", tmp_path / "source.pt"
    at, n = _sparse_archive(out, size)
    _sparse_archive(source, size)
    probe = (
        "import json\n"
        "from pathlib import Path\n"
        "from tailor_tui.checked import crc\n"
        "from tailor_tui.verifying import streamed\n"
        f"at, n = {at}, {n}\n"
        "claims = streamed.Comparison()\n"
        f"out = claims.file(Path({str(out)!r}), label='rank 0')\n"
        f"src = claims.file(Path({str(source)!r}))\n"
        "for f in (out, src):\n"
        "    claims.evidence(f, at, n, crc.zeros(n), 'archive/data/0')\n"
        "claims.claim(out, at, n // 2, src, at, 0)\n"
        "claims.zeros(out, at + n // 2, n - n // 2, 1)\n"
        "outcome = streamed.run(claims, workers=2)\n"
        # this process's own peak (ru_maxrss would carry the forking test process's over exec)
        "peak = next(int(line.split()[1]) for line in open('/proc/self/status') if line.startswith('VmHWM')) << 10\n"
        "print(json.dumps([sorted(outcome.differing), len(outcome.failed), outcome.read, peak]))\n")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr
    differing, failed, read, peak = json.loads(done.stdout)
    assert differing == [] and failed == 0 and read == 2 * size, done.stdout
    assert peak < 256 << 20, f"peak RSS {peak >> 20} MiB verifying two {size >> 30} GiB files"
    # one byte flipped in the middle of the output's claimed half: found, as a difference and as a CRC failure
    with open(out, "r+b") as f:
        f.seek(at + size // 4)
        f.write(b"\x01")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr
    differing, failed, read, peak = json.loads(done.stdout)
    assert differing == [0] and failed == 1 and peak < 256 << 20, done.stdout



def test_a_spread_over_files_many_times_the_bound_reads_each_once_and_names_the_part_that_differs(tmp_path):
    """A spread (a ZeRO rank's flat tensor: parts from two checkpoints and zero padding, laid out alike) over
    records of 1 GiB: every byte of the three files read once (a source's bytes between its parts too), parts
    astride chunks and tasks, each part's CRC-32 put together, in bounded memory; a byte flipped in the output is
    found in the part holding it, one flipped where no part of a source lies fails that source's record."""
    size, block = 1 << 30, 96 << 20  # (96 MiB parts: astride the 4 MiB chunks and the 64 MiB tasks)
    paths = [tmp_path / f"{name}.pt" for name in ("out", "a", "b")]
    for path in paths:
        at, n = _sparse_archive(path, size)
    probe = (
        "import json\n"
        "from pathlib import Path\n"
        "from tailor_tui.checked import crc\n"
        "from tailor_tui.verifying import streamed\n"
        f"at, n, block = {at}, {n}, {block}\n"
        "claims = streamed.Comparison()\n"
        f"names = {[str(p) for p in paths]!r}\n"
        "out, a, b = (claims.file(Path(p), label='rank 0' if i == 0 else None) for i, p in enumerate(names))\n"
        "for f in (out, a, b):\n"
        "    claims.evidence(f, at, n, crc.zeros(n), 'archive/data/0')\n"
        "parts = tuple((start, min(block, n - start), (0, 1, streamed.ZERO)[k % 3])\n"
        "              for k, start in enumerate(range(0, n, block)))\n"
        "claims.spread(out, at, ((a, at), (b, at)), streamed.Pattern(parts, 2), 0)\n"
        "outcome = streamed.run(claims, workers=2)\n"
        "peak = next(int(line.split()[1]) for line in open('/proc/self/status') if line.startswith('VmHWM')) << 10\n"
        "crcs = outcome.spread_crcs[0] == [crc.zeros(length) for _at, length, _which in parts]\n"
        "failed = sorted(claims.paths[s.file].name for s, _value in outcome.failed)\n"
        "print(json.dumps([sorted(outcome.spread_differing.get(0, ())), failed, outcome.read, peak, crcs]))\n")

    def probed():
        done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, timeout=300)
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)

    differing, failed, read, peak, crcs = probed()
    assert differing == [] and failed == [] and read == 3 * size and crcs, (differing, failed, read, crcs)
    assert peak < 256 << 20, f"peak RSS {peak >> 20} MiB verifying three {size >> 30} GiB files"
    with open(paths[0], "r+b") as f:  # part 4 (b's), 5 MiB into it: the second chunk of a task's
        f.seek(at + 4 * block + (5 << 20))
        f.write(b"\x01")
    with open(paths[1], "r+b") as f:  # in a's bytes of part 1 (b's): no part of a's lies there
        f.seek(at + block + 7)
        f.write(b"\x01")
    differing, failed, read, peak, crcs = probed()
    assert differing == [4] and failed == ["a.pt", "out.pt"] and read == 3 * size and not crcs, \
        (differing, failed, read)
    assert peak < 256 << 20, f"peak RSS {peak >> 20} MiB"

def _claimed(tmp_path, size: int):
    """Two sparse archives of a `size`-byte record each, the output's claimed whole against the source's."""
    from tailor_tui.checked import crc
    from tailor_tui.verifying import streamed

    out, source = tmp_path / "out.pt", tmp_path / "source.pt"
    at, n = _sparse_archive(out, size)
    _sparse_archive(source, size)
    claims = streamed.Comparison()
    f, g = claims.file(out, label="rank 0"), claims.file(source)
    for file in (f, g):
        claims.evidence(file, at, n, crc.zeros(n), "archive/data/0")
    claims.claim(f, at, n, g, at, 0)
    return claims, source


def test_a_cancel_stops_every_reading_thread_at_its_next_chunk(tmp_path):
    from tailor_tui.events import Cancelled
    from tailor_tui.verifying import streamed

    claims, _source = _claimed(tmp_path, 512 << 20)
    read = []
    with pytest.raises(Cancelled):
        streamed.run(claims, workers=2, on_bytes=lambda label, n: read.append(n),
                     cancelled=lambda: sum(read) > 8 << 20)
    assert sum(read) < 64 << 20, sum(read)  # stopped within a chunk per thread, not at the end of the files


def test_a_source_written_while_it_is_read_proves_nothing(tmp_path):
    """The source is written to between two reads (its ctime moves): the run says so, and settles no verdict."""
    from tailor_tui.verifying import streamed

    claims, source = _claimed(tmp_path, 256 << 20)
    touched = []

    def on_bytes(label: str, n: int) -> None:
        if not touched:
            touched.append(True)
            with open(source, "r+b") as f:  # a write of the same byte: the bytes alike, the file not the one opened
                f.seek(0)
                f.write(f.read(1))

    outcome = streamed.run(claims, workers=2, on_bytes=on_bytes)
    assert source in outcome.moved and not outcome.failed and not outcome.differing


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_the_cast_rule_is_torchs_with_any_nan_for_a_nan(dtype):
    """`formats.dtypes.cast` is torch's `Tensor.to` (round to nearest even: ties, the smallest normals and
    subnormals, overflow to inf), on torch's scalar kernels, which write one NaN; `cast_difference` takes any NaN
    for a NaN (torch's vectorized kernels write 0xFFFF for a bf16 NaN on some CPUs) and nothing else."""
    import numpy as np
    import torch

    from tailor_tui.formats.dtypes import cast, cast_difference

    bits = np.random.default_rng(0).integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32)
    ties = (np.arange(4096, dtype=np.uint32) << 16) | np.uint32(0x8000)  # halfway between two bf16 values
    special = np.array([0x7F800000, 0xFF800000, 0x7F7FFFFF, 0x477FF000, 0x477FE000, 0x00000001, 0x33800000,
                        0x7FC00000, 0xFFC00000, 0x7F800001], dtype=np.uint32)  # inf, max, fp16's edge, tiny, NaNs
    fp32 = np.concatenate([bits, ties, special]).view("<f4")
    want = torch.from_numpy(fp32.copy()).to(getattr(torch, dtype)).view(torch.int16).numpy().view("<u2")
    got = np.frombuffer(cast(fp32.tobytes(), "float32", dtype), "<u2")
    nan = np.isnan(fp32)
    assert np.array_equal(got[~nan], want[~nan])  # every number as torch casts it
    assert cast_difference(want.tobytes(), fp32.tobytes(), dtype) is None  # whichever NaN this CPU's torch wrote
    assert cast_difference(got.tobytes(), fp32.tobytes(), dtype) is None
    other_nan = got.copy()
    other_nan[nan] = 0xFFFF
    assert cast_difference(other_nan.tobytes(), fp32.tobytes(), dtype) is None
    for i, wrong in [(5, got[5] ^ 1), (int(np.flatnonzero(nan)[0]), 0x7F80 if dtype == "bfloat16" else 0x7C00)]:
        off = got.copy()
        off[i] = wrong  # one unit in the last place; a NaN cast to inf
        assert cast_difference(off.tobytes(), fp32.tobytes(), dtype) == i


def _interleaved(tmp_path, flip_at: int | None = None):
    """An output of 2,048 claims of 512 bytes, alternately from two sources, each claim 512 bytes after the last on
    its source (the rows of a wide run's rank, from two checkpoints): every file evidenced whole by its CRC-32, taken
    before source A's byte `flip_at` is flipped."""
    import random
    import zlib

    from tailor_tui.verifying import streamed

    rng = random.Random(7)
    sources = {name: bytearray(rng.randbytes(2 << 20)) for name in "AB"}
    out = bytearray()
    for k in range(2048):
        at = (k // 2) * 1024
        out += sources["AB"[k % 2]][at: at + 512]
    paths = {name: tmp_path / name for name in ("out", "A", "B")}
    crcs = {"out": zlib.crc32(out), **{name: zlib.crc32(data) for name, data in sources.items()}}
    if flip_at is not None:
        sources["A"][flip_at] ^= 0x10
    paths["out"].write_bytes(out)
    for name, data in sources.items():
        paths[name].write_bytes(data)
    claims = streamed.Comparison()
    files = {name: claims.file(path, label="rank 0" if name == "out" else None) for name, path in paths.items()}
    for name, path in paths.items():
        claims.evidence(files[name], 0, path.stat().st_size, crcs[name], name)
    for k in range(2048):
        claims.claim(files["out"], k * 512, 512, files["AB"[k % 2]], (k // 2) * 1024, k)
    return claims


def _counting_reads(monkeypatch) -> list[int]:
    """The length of every read `verifying.streamed` makes from here on (its `pread_into`, counted)."""
    from tailor_tui.checked.ranges import pread_into
    from tailor_tui.verifying import streamed

    reads: list[int] = []

    def counted(fd: int, view: memoryview, at: int) -> None:
        reads.append(len(view))
        pread_into(fd, view, at)

    monkeypatch.setattr(streamed, "pread_into", counted)
    return reads


@pytest.mark.parametrize("flip", [None, "claimed", "between claims"])
def test_small_claims_on_alternating_sources_are_read_a_window_at_a_time_and_every_byte_checked(tmp_path, monkeypatch,
                                                                                                flip):
    """A wide run's ranks are thousands of claims of a few KiB whose sources alternate: each source's bytes are read a
    window at a time for the claims on it that follow, and the bytes between them (another source's rows there) with
    them, not a read each (those reads took 6 s of a 256-rank verification). Still, a source byte a claim reads that
    differs fails that claim alone, and one between claims fails its source's CRC-32."""
    from tailor_tui.verifying import streamed

    flip_at = {None: None, "claimed": 5 * 1024 + 3, "between claims": 5 * 1024 + 700}[flip]
    claims = _interleaved(tmp_path, flip_at)
    reads = _counting_reads(monkeypatch)
    outcome = streamed.run(claims, workers=2)
    assert not outcome.moved
    assert outcome.differing == ({10} if flip == "claimed" else set())  # claim 10: source A's sixth
    assert [stretch.name for stretch, _value in outcome.failed] == ([] if flip is None else ["A"])
    assert len(reads) < 40, len(reads)  # not 2,048 reads of sources, nor 2,048 of what lies between
    assert sum(reads) == outcome.read == (1 << 20) + 2 * (2 << 20)  # every byte of every file read, once


@pytest.mark.parametrize("segment", [64 << 10, (64 << 10) + 256])
def test_a_windows_bytes_are_read_once_where_tasks_share_an_output_file(tmp_path, monkeypatch, segment):
    """An output file read by several tasks (a large one's segments), cut between claims or through one: what a
    task's windows read of its sources stops where its share of the claims does, so the next task's windows do not
    read those bytes again (two reads of a stretch's bytes would have it read whole a third time)."""
    from tailor_tui.verifying import streamed

    claims = _interleaved(tmp_path)
    reads = _counting_reads(monkeypatch)
    monkeypatch.setattr(streamed, "SEGMENT", segment)
    outcome = streamed.run(claims, workers=2)
    assert not outcome.moved and not outcome.differing and not outcome.failed
    assert outcome.read == (1 << 20) + 2 * (2 << 20)  # no stretch read whole again
    assert sum(reads) < 2 * outcome.read  # (what lies between the few bytes left, read with them: fewer reads)


def test_a_claim_larger_than_a_window_is_read_as_it_is_where_an_output_chunk_cuts_it_short(tmp_path):
    """A claim of more than a window that an output chunk ends soon after it starts: its first part is small, and
    read through a window it would take a window's bytes of the source, which its next part reads again (the
    source's stretch then read whole a third time: a 593 MiB rank's verification took a fifth longer). Each part of
    it is read as it is: every byte of every file read once."""
    import random
    import zlib

    from tailor_tui.checked.ranges import READ_CHUNK
    from tailor_tui.verifying import streamed

    rng = random.Random(3)
    first = READ_CHUNK - (100 << 10)  # claim 0 ends 100 KiB before the output's first chunk does; claim 1 goes on 5 MiB
    sources = {"A": rng.randbytes(first), "B": rng.randbytes(5 << 20)}
    paths = {"out": tmp_path / "out", "A": tmp_path / "A", "B": tmp_path / "B"}
    paths["out"].write_bytes(sources["A"] + sources["B"])
    for name, data in sources.items():
        paths[name].write_bytes(data)
    claims = streamed.Comparison()
    files = {name: claims.file(path, label="rank 0" if name == "out" else None) for name, path in paths.items()}
    for name, path in paths.items():
        claims.evidence(files[name], 0, path.stat().st_size, zlib.crc32(path.read_bytes()), name)
    claims.claim(files["out"], 0, first, files["A"], 0, 0)
    claims.claim(files["out"], first, 5 << 20, files["B"], 0, 1)
    outcome = streamed.run(claims, workers=1)
    assert not outcome.moved and not outcome.differing and not outcome.failed
    assert outcome.read == 2 * (first + (5 << 20))


def test_windows_of_two_outputs_over_one_sources_bytes_are_kept_once_and_every_byte_checked(tmp_path):
    """Two output files whose claims alternate on one source (a resharded output's ranks: each takes its share of a
    source rank's partition of each parameter): each output's windows reach over the bytes the other's claims read.
    The source's CRC-32 is put together from pieces that do not overlap, what lies between them read again: not the
    whole source once more; a source byte flipped is still found."""
    import random
    import zlib

    from tailor_tui.verifying import streamed

    rng = random.Random(11)
    source = bytearray(rng.randbytes(2 << 20))
    blocks = [bytes(source[k * 512: (k + 1) * 512]) for k in range(len(source) // 512)]
    paths = {"even": tmp_path / "even", "odd": tmp_path / "odd", "S": tmp_path / "S"}
    paths["even"].write_bytes(b"".join(blocks[0::2]))
    paths["odd"].write_bytes(b"".join(blocks[1::2]))
    crcs = {name: zlib.crc32(path.read_bytes()) for name, path in paths.items() if name != "S"}
    crcs["S"] = zlib.crc32(source)
    for flip in (None, 700_001):
        data = bytearray(source)
        if flip is not None:
            data[flip] ^= 0x04
        paths["S"].write_bytes(data)
        claims = streamed.Comparison()
        files = {name: claims.file(path, label=name if name != "S" else None) for name, path in paths.items()}
        for name, path in paths.items():
            claims.evidence(files[name], 0, path.stat().st_size, crcs[name], name)
        for k in range(len(blocks)):
            out = files["even" if k % 2 == 0 else "odd"]
            claims.claim(out, (k // 2) * 512, 512, files["S"], k * 512, k)
        outcome = streamed.run(claims, workers=2)
        assert not outcome.moved
        assert [stretch.name for stretch, _value in outcome.failed] == ([] if flip is None else ["S"])
        assert outcome.differing == ({flip // 512} if flip is not None else set())
        assert outcome.read < len(source) + 2 * len(source) + len(source) // 2  # the outputs, S twice, not thrice


@pytest.mark.parametrize("flip", [None, "claimed", "between claims"])
def test_a_sources_claims_far_apart_are_read_in_windows_that_tile_its_record(tmp_path, monkeypatch, flip):
    """A source that gives every ninth row of a wide run's rank: its claims lie further apart than a read takes
    neighbours together. Its windows tile its record, each from where the one before ended through the claims it
    holds, their CRC-32s taken of the bytes between too: every byte read once, in a few reads (a read a claim, then
    the bytes between read again with the claims among them: a tenth of a 256-rank verification's reading time). A
    byte flipped in a claim fails it alone; one between claims fails the source's CRC-32."""
    import random
    import zlib

    from tailor_tui.verifying import streamed

    rng = random.Random(5)
    source = bytearray(rng.randbytes(2 << 20))
    step, size = 128 << 10, 16 << 10  # claims 112 KiB apart: more than a read takes together (`NEAR`)
    out = b"".join(bytes(source[k * step: k * step + size]) for k in range(16))
    paths = {"out": tmp_path / "out", "C": tmp_path / "C"}
    paths["out"].write_bytes(out)
    crcs = {"out": zlib.crc32(out), "C": zlib.crc32(source)}
    flip_at = {None: None, "claimed": 3 * step + 5, "between claims": 9 * step + size + 7}[flip]
    if flip_at is not None:
        source[flip_at] ^= 0x08
    paths["C"].write_bytes(source)
    claims = streamed.Comparison()
    files = {name: claims.file(path, label="rank 0" if name == "out" else None) for name, path in paths.items()}
    for name, path in paths.items():
        claims.evidence(files[name], 0, path.stat().st_size, crcs[name], name)
    for k in range(16):
        claims.claim(files["out"], k * size, size, files["C"], k * step, k)
    reads = _counting_reads(monkeypatch)
    outcome = streamed.run(claims, workers=1)
    assert not outcome.moved
    assert outcome.differing == ({3} if flip == "claimed" else set())
    assert [stretch.name for stretch, _value in outcome.failed] == ([] if flip is None else ["C"])
    assert sum(reads) == outcome.read == len(out) + len(source)  # every byte of every file read, once
    assert len(reads) <= 5, reads  # the output; two windows of C; what follows its last claim
