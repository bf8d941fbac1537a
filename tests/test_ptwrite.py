"""The torch-free writer of torch's archive (`ptpickle` + `ptwrite`) writes what torch.save writes.

Every `.pt` file of real runs (several DeepSpeed releases, HF and DeepSpeed layouts, a partial
checkpoint's skeletons), read by the torch-free reader and written back, is byte-identical to
the file torch wrote (given the same serialization id, torch's one random record). Beyond
4 GiB (zip64 sizes and offsets) the writer's archive is torch's own, compared on sparse files.
"""

from __future__ import annotations

import collections
import pickle
import zipfile
from pathlib import Path

import pytest
import torch
from conftest import INSTALLED_DEEPSPEED, OLDEST_DEEPSPEED, checkpoints_of
from helpers import flip_byte

from tailor_tui.errors import CheckpointError
from tailor_tui.formats.ptfile import file_format, read_structure
from tailor_tui.formats.ptpickle import dumps, storage_bytes
from tailor_tui.formats.ptwrite import Copied, Reserved, write_archive


def _rewrite(path: Path, out: Path, *, keep_id: bool = True) -> None:
    """Read `path` without torch and write it back to `out` as torch.save would."""
    refs = {}
    obj, records, prefix = read_structure(path, refs)
    data, storages = dumps(obj, location=None)
    fills = [Copied(path, records[f"{prefix}data/{s.key}"], records[f"{prefix}data/{s.key}"].data_offset,
                    storage_bytes(s)) for s in storages]
    ident = None
    if keep_id:
        with zipfile.ZipFile(path) as z:
            ident = z.read(f"{prefix}.data/serialization_id").decode()
    write_archive(out, archive=prefix.rstrip("/") or out.stem, pickle=data, storages=fills, ident=ident)


@pytest.mark.parametrize(("name", "release"), [
    ("hf_fp32_3_tied", INSTALLED_DEEPSPEED),  # HF layout, fp32, tied embeddings
    ("ds_fp16_2_config_file", OLDEST_DEEPSPEED),  # 0.14.4: fp16's dynamic loss scaler, a pickled set
    ("ds_selective_parity", INSTALLED_DEEPSPEED),  # partial checkpoints' skeletons
])
def test_every_real_file_is_written_back_byte_for_byte(real_run, tmp_path, name, release):
    run, _spec = real_run(name, deepspeed=release)
    files = sorted(f for f in run.rglob("*.pt") if file_format(f) == "zip" and "rng_state" not in f.name
                   and "scheduler" not in f.name and "training_args" not in f.name)
    assert len(files) >= 6
    for i, f in enumerate(files):
        out = tmp_path / str(i) / f.name  # (checkpoints' files share names: each written new)
        out.parent.mkdir()
        _rewrite(f, out)
        assert out.read_bytes() == f.read_bytes(), f


def test_a_legacy_file_is_written_as_an_archive_torch_loads_alike(real_run, tmp_path):
    run, spec = real_run("ds_legacy_serialization")
    newest = checkpoints_of(run, spec)[-1]
    for f in sorted(newest.rglob("*.pt")):
        assert file_format(f) == "legacy"
        out = tmp_path / f.name
        _rewrite(f, out, keep_id=False)
        assert file_format(out) == "zip"
        _assert_same(torch.load(out, weights_only=False), torch.load(f, weights_only=False))


def _assert_same(a, b, where="") -> None:
    assert type(a) is type(b), where
    if torch.is_tensor(a):
        assert (a.dtype, a.shape, a.stride(), a.requires_grad) == (b.dtype, b.shape, b.stride(), b.requires_grad)
        assert bytes(a.untyped_storage()) == bytes(b.untyped_storage()), where  # bits, NaN too
        assert a.storage_offset() == b.storage_offset(), where
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for k in a:
            _assert_same(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{where}[{i}]")
    elif hasattr(a, "__dict__") and not isinstance(a, type):
        _assert_same(vars(a), vars(b), where)
    else:
        assert a == b, where


def test_beyond_4_gib_the_archive_is_torchs_own(tmp_path):
    """zip64 sizes (a 5 GiB record), zip64 offsets (records after 4 GiB), both at once, an empty
    record: torch.save's archive with every storage reserved (skip_data) against the writer's,
    compared outside the holes (sparse files: nothing near 12 GiB is written or read)."""
    obj = {"a": torch.ones(3), "big": torch.empty((5 << 30) // 4), "c": torch.ones(2),
           "big2": torch.empty((1 << 30) // 4), "big3": torch.empty((5 << 30) // 2, dtype=torch.bfloat16),
           "empty": torch.zeros(0), "shape": torch.Size([2, 3]), "od": collections.OrderedDict(x=1)}
    theirs, mine = tmp_path / "t.pt", tmp_path / "mine.pt"
    with torch.serialization.skip_data():
        torch.save(obj, theirs)
    structure, records, prefix = read_structure(theirs)
    data, storages = dumps(structure)
    with zipfile.ZipFile(theirs) as z:
        ident = z.read(f"{prefix}.data/serialization_id").decode()
    written = write_archive(mine, archive="t", pickle=data, storages=[Reserved(storage_bytes(s)) for s in storages],
                            ident=ident)
    assert written == records  # every record where torch put it, CRC fields included
    size = theirs.stat().st_size
    assert mine.stat().st_size == size > 11 << 30
    holes = sorted((r.data_offset, r.size) for n, r in records.items() if "/data/" in n)
    with open(theirs, "rb") as a, open(mine, "rb") as b:
        at = 0
        for start, length in [*holes, (size, 0)]:
            a.seek(at)
            b.seek(at)
            assert a.read(start - at) == b.read(start - at), f"bytes {at}..{start} differ"
            at = start + length


# bench/bench_ptwrite.py, 2 cores: write_archive takes ~0.5 s for 10k records, ~3.5 s for 66k and ~7.5 s
# for 200k (linear: 40-55 µs a record); this test (torch.save, read, write back) 16-26 s alone, ~37 s
# beside another test process. Quadratic, as the writer once was, it took ~4 minutes: the limit is
# ~5-7x the linear time.
@pytest.mark.timeout(180)
def test_more_than_65535_records_are_written_as_torch_writes_them(tmp_path):
    """Past 65,535 records the zip end record says 0xFFFF and the zip64 end record the count,
    byte for byte as torch.save writes it (a structure of 66,000 tensors)."""
    obj = [torch.full((1,), float(i)) for i in range(66_000)]
    theirs, mine = tmp_path / "t.pt", tmp_path / "mine.pt"
    torch.save(obj, theirs)
    _rewrite(theirs, mine)
    assert mine.read_bytes() == theirs.read_bytes()  # (what torch.load reads: torch's own file, byte for byte)


def test_only_what_a_checkpoint_holds_is_pickled():
    with pytest.raises(pickle.PicklingError, match="not a global"):
        dumps({"f": print})
    with pytest.raises(pickle.PicklingError):
        dumps({"b": b"raw bytes"})  # protocol 2 pickles bytes through codecs.encode: not a checkpoint's


def test_a_copied_storage_whose_source_rotted_is_refused(real_run, tmp_path):
    run, spec = real_run("hf_fp32_3_tied")
    f = next(checkpoints_of(run, spec)[-1].rglob("*optim_states.pt"))
    copy = tmp_path / f.name
    copy.write_bytes(f.read_bytes())
    flip_byte(copy, "data/0")  # a sub-group's fp32 weights
    with pytest.raises(CheckpointError, match="fails its CRC-32 check"):
        _rewrite(copy, tmp_path / "out.pt")


def test_archives_of_one_structure_under_many_names_are_what_write_archive_writes(real_run, tmp_path):
    """`SameArchives` (a resharded output's rank files) lays out the first archive of each name
    length and writes the others as renamed copies of it: byte for byte write_archive's, copied
    records' CRC-32s set as they are copied, reserved ones left for the caller, and torch loads them."""
    from tailor_tui.formats.ptwrite import SameArchives

    run, spec = real_run("hf_bf16_2")
    source = next(checkpoints_of(run, spec)[-1].rglob("*optim_states.pt"))
    refs = {}
    obj, records, prefix = read_structure(source, refs)
    data, storages = dumps(obj, location=None)
    fills = [Copied(source, records[f"{prefix}data/{s.key}"], records[f"{prefix}data/{s.key}"].data_offset,
                    storage_bytes(s)) for s in storages]
    k = next(i for i, f in enumerate(fills) if f.size)
    kept, fills[k] = fills[k], Reserved(fills[k].size)  # one reserved, the rest copied
    same = SameArchives(data, fills)
    names = ["rank_7_states", "rank_8_states", "rank_10_states", "ränk_9_states", "rank_99_states"]
    for name in names:
        mine, theirs = tmp_path / "same" / f"{name}.pt", tmp_path / "one" / f"{name}.pt"
        mine.parent.mkdir(exist_ok=True)
        theirs.parent.mkdir(exist_ok=True)
        got = same.write(mine, name)
        assert got == write_archive(theirs, archive=name, pickle=data, storages=fills), name
        assert mine.read_bytes() == theirs.read_bytes(), name
        assert all(n.startswith(f"{name}/") for n in got)
    with zipfile.ZipFile(tmp_path / "same" / "rank_8_states.pt") as z:
        assert z.testzip() == storage_name(z, k)  # the reserved record alone: not filled
    fills[k] = kept
    same = SameArchives(data, fills)
    same.write(tmp_path / "x_1.pt", "x_1")
    renamed = tmp_path / "x_2.pt"
    same.write(renamed, "x_2")
    with zipfile.ZipFile(renamed) as z:
        assert z.testzip() is None and z.read("x_2/.data/serialization_id") != b""
    loaded, original = torch.load(renamed, weights_only=False), torch.load(source, weights_only=False)
    assert loaded.keys() == original.keys()


def storage_name(z: zipfile.ZipFile, key: int) -> str | None:
    names = [n for n in z.namelist() if n.endswith(f"/data/{key}")]
    return names[0] if names else None
