"""A zip archive is checked as torch's reader will read it, before anything is trusted or copied
(issue 43, item 2): one bit flipped in a central-directory entry of a rank file or of a file
copied whole — the "encrypted" flag, the compression method — left every CRC-32 matching, so
`--apply` published a file torch cannot load (or ended in zipfile's NotImplementedError). Each is
now refused through the real command line in one line naming file and record, exit 4, nothing
written; the other ways an archive can disagree with torch's reader are refused by the reader
every path uses (tests/test_fuzz.py flips every bit)."""

from __future__ import annotations

import shutil
import struct
import zipfile
from pathlib import Path

import pytest
from helpers import assert_one_line_error, tailor, write_recipe

from tailor_tui.errors import CheckpointError
from tailor_tui.formats.ptfile import MatchedRecords, check_crcs, read_structure, records_in, stored, structure_in

FILES = {
    "optim_states": "global_step6/bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt",
    "model_states": "global_step6/zero_pp_rank_1_mp_rank_00_model_states.pt",
    "rng_state": "rng_state_1.pth",
    "scheduler.pt": "scheduler.pt",
}


def central_entry(path: Path, suffix: str) -> tuple[int, str]:
    """(offset, name) of the central-directory entry of the record whose name ends with `suffix`."""
    data = path.read_bytes()
    with zipfile.ZipFile(path) as z:
        i = z.start_dir
    while data[i: i + 4] == b"PK\x01\x02":
        name_len, extra_len, comment_len = struct.unpack_from("<HHH", data, i + 28)
        name = data[i + 46: i + 46 + name_len].decode()
        if name.endswith(suffix):
            return i, name
        i += 46 + name_len + extra_len + comment_len
    raise KeyError(suffix)


def poke(path: Path, at: int, fmt: str, change) -> None:
    data = bytearray(path.read_bytes())
    struct.pack_into(fmt, data, at, change(struct.unpack_from(fmt, data, at)[0]))
    path.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def source(real_run):
    return real_run("hf_bf16_2")[0]


@pytest.fixture
def run(source, tmp_path):
    shutil.copytree(source, tmp_path / "run", symlinks=True)
    return tmp_path / "run"


# (what is flipped, offset in the central entry, field format, how it changes, what the line says)
FLIPS = {
    "encrypted flag": (8, "<H", lambda v: v | 1, "marked encrypted"),
    "compression method 0→1": (10, "<H", lambda v: v ^ 1, "compressed (method 1)"),
    "compression method 0→8": (10, "<H", lambda v: 8, "compressed (method 8)"),
    "folder attribute": (38, "<I", lambda v: v | 0x10, "marked a folder"),
}


@pytest.mark.parametrize("flip", list(FLIPS))
@pytest.mark.parametrize("kind", list(FILES))
def test_a_flipped_directory_bit_is_refused_in_one_line_naming_file_and_record(run, tmp_path, kind, flip):
    target = run / "checkpoint-6" / FILES[kind]
    offset, fmt, change, needle = FLIPS[flip]
    at, name = central_entry(target, "data/0" if kind == "optim_states" else "data.pkl")
    poke(target, at + offset, fmt, change)
    recipe = write_recipe(tmp_path, run / "checkpoint-6", {"layers.1": run / "checkpoint-4"})
    assert_one_line_error(tailor("--apply", recipe), 4, str(target), f"record {name}: {needle}",
                          "re-copy it from the training run")
    assert not (tmp_path / "composed").exists()


def test_heal_refuses_a_compressed_scheduler_in_one_line(run, tmp_path):
    """The traceback of item 2 (`--heal`: NotImplementedError from zipfile.testzip) is one line."""
    target = run / "checkpoint-6" / "scheduler.pt"
    at, name = central_entry(target, "data.pkl")
    poke(target, at + 10, "<H", lambda v: 1)
    result = tailor("--heal", run, "--recipe", tmp_path / "healed.yaml")
    assert not (tmp_path / "healed.yaml").exists()
    assert_one_line_error(result, 4, str(target), f"record {name}: compressed")


def copy_of(run: Path, kind: str, tmp_path: Path) -> Path:
    target = tmp_path / Path(FILES[kind]).name
    shutil.copy(run / "checkpoint-6" / FILES[kind], target)
    return target


def refused(path: Path, *needles: str) -> None:
    for small in (None, 0):  # read whole, and streamed
        with pytest.raises(CheckpointError) as caught:
            check_crcs(path, small=small)
        assert all(n in str(caught.value) for n in (str(path), *needles)), str(caught.value)
    with pytest.raises(CheckpointError, match="|".join(needles[:1])):
        read_structure(path)


def local_header(path: Path, suffix: str) -> int:
    with zipfile.ZipFile(path) as z:
        return next(i for i in z.infolist() if i.filename.endswith(suffix)).header_offset


def test_a_local_header_disagreeing_with_its_directory_entry_is_refused(run, tmp_path):
    for at, fmt, change in ((6, "<H", lambda v: v | 1), (8, "<H", lambda v: 8), (30 + 3, "<B", lambda v: v ^ 1)):
        target = copy_of(run, "optim_states", tmp_path)  # its flags, its method, its name
        poke(target, local_header(target, "data/1") + at, fmt, change)
        refused(target, "data/1", "local header")


def test_a_data_descriptor_disagreeing_with_its_directory_entry_is_refused(run, tmp_path):
    target = copy_of(run, "optim_states", tmp_path)
    with zipfile.ZipFile(target) as z:
        info = next(i for i in z.infolist() if i.filename.endswith("data/1"))
    name_len, extra_len = struct.unpack_from("<HH", target.read_bytes(), info.header_offset + 26)
    poke(target, info.header_offset + 30 + name_len + extra_len + info.file_size + 4, "<I", lambda v: v ^ 1)
    refused(target, "data/1", "data descriptor")


def test_overlapping_records_are_refused(run, tmp_path):
    """Two directory entries pointing at the same local header (data read twice, under two names)."""
    target = copy_of(run, "optim_states", tmp_path)
    at1, _ = central_entry(target, "data/1")
    at2, name2 = central_entry(target, "data/2")
    offset1 = struct.unpack_from("<I", target.read_bytes(), at1 + 42)[0]
    poke(target, at2 + 42, "<I", lambda v: offset1)
    refused(target, "data/2")


def test_a_name_listed_twice_is_refused(run, tmp_path):
    """Two records of one name (ASCII case aside: torch's reader ignores case): which one is read
    would be the reader's choice."""
    target = copy_of(run, "optim_states", tmp_path)
    at, name = central_entry(target, "data/2")
    data = bytearray(target.read_bytes())
    for where in (at + 46, local_header(target, "data/2") + 30):  # data/2 -> DATA/1, in both headers
        cut = where + len(name) - len("data/2")
        data[cut: cut + 6] = b"DATA/1"
    target.write_bytes(bytes(data))
    refused(target, "listed twice")


def test_data_past_the_directory_is_refused(run, tmp_path):
    target = copy_of(run, "optim_states", tmp_path)
    at, name = central_entry(target, "data/1")
    with zipfile.ZipFile(target) as z:
        start = z.start_dir
    poke(target, at + 20, "<I", lambda v: start)  # its stored and listed sizes: past the directory
    poke(target, at + 24, "<I", lambda v: start)
    refused(target, name)


def test_a_zip_archive_whose_first_local_header_is_damaged_is_refused(run, tmp_path):
    """torch.load would take it for a legacy-format file and fail; it used to be copied unchecked."""
    target = copy_of(run, "scheduler.pt", tmp_path)
    poke(target, 3, "<B", lambda v: v ^ 0x10)
    with pytest.raises(CheckpointError, match="does not start with a record's local header"):
        check_crcs(target)


@pytest.mark.parametrize("flip", ["encrypted flag", "compression method 0→1"])
def test_verify_proves_a_copied_file_loads_as_torch_would(run, tmp_path, flip):
    """`--verify` said "verified" for an rng file torch cannot load (its bytes match the base's):
    each copied torch file is now read by torch's own reader too."""
    recipe = write_recipe(tmp_path, run / "checkpoint-6", {"layers.1": run / "checkpoint-4"})
    assert tailor("--apply", recipe).returncode == 0
    assert tailor("--verify", recipe).returncode == 0
    offset, fmt, change, _needle = FLIPS[flip]
    for folder in (run / "checkpoint-6", tmp_path / "composed"):  # the base's and the output's, alike
        target = folder / "rng_state_1.pth"
        at, _name = central_entry(target, "data.pkl")
        poke(target, at + offset, fmt, change)
    result = tailor("--verify", recipe)
    assert result.returncode == 7, result.stdout + result.stderr
    assert "rng_state_1.pth: torch's reader cannot read it" in result.stdout, result.stdout


def test_verify_checks_a_copied_files_records_as_it_reads_it(run, tmp_path):
    """A copied torch file's records are checked against their CRC-32s on the one read that compares it with the
    base's (not by reading it again by path): a byte of its pickle changed alike in the base and the output, so that
    they still match, is a FAIL line naming the file and the record."""
    recipe = write_recipe(tmp_path, run / "checkpoint-6", {"layers.1": run / "checkpoint-4"})
    assert tailor("--apply", recipe).returncode == 0
    for folder in (run / "checkpoint-6", tmp_path / "composed"):
        target = folder / "rng_state_1.pth"
        with zipfile.ZipFile(target) as z:
            at = next(i for i in z.infolist() if i.filename.endswith("data.pkl")).header_offset
        with open(target, "rb") as f:
            f.seek(at + 26)
            name, extra = struct.unpack("<HH", f.read(4))  # the local header's own lengths
        poke(target, at + 30 + name + extra + 5, "<B", lambda v: v ^ 0x01)
    result = tailor("--verify", recipe)
    assert result.returncode == 7, result.stdout + result.stderr
    assert "composed/rng_state_1.pth: torch's reader cannot read it (record rng_state_1/data.pkl fails its " \
           "CRC-32 check" in result.stdout, result.stdout


def test_a_rank_file_laid_out_as_one_checked_before_passes_or_fails_as_it_would_alone(run, tmp_path):
    """A file laid out as one checked before but for its records' names and bytes (the next rank's, issue
    47) is taken by one comparison and a CRC-32 per record (`zipdir.CheckedArchives`): whatever byte of it is
    changed, it passes or fails exactly as when checked record by record, with nothing checked before."""
    tag = run / "checkpoint-6" / "global_step6"
    for first, second in [("zero_pp_rank_0_mp_rank_00_model_states.pt", "zero_pp_rank_1_mp_rank_00_model_states.pt"),
                          ("bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt",
                           "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt")]:
        check_crcs(tag / first)  # checked whole: a reference
        assert structure_in(tag / first, (tag / first).read_bytes())[1] == read_structure(tag / first)[1]
        whole = (tag / second).read_bytes()
        assert len(whole) <= 4 << 20
        found = structure_in(tag / second, whole)  # laid out as the first: its records, its own names and CRCs
        alone = read_structure(tag / second)[1]
        assert isinstance(found[1], MatchedRecords) and found[1:] == (alone, read_structure(tag / second)[2])
        assert sorted(found[1]) == sorted(alone) and len(found[1]) == len(alone)
        assert sorted(stored(found[1])) == sorted(r for r in alone.values() if r.size or r.crc)
        assert all(found[1][name] is found[1][name] for name in alone)  # (readers tell records apart by identity)
        assert f"{found[2]}nothing" not in found[1] and "nothing" not in found[1]
        check_crcs(tag / second)
        changed = tmp_path / second
        for at in sorted({*range(0, len(whole), max(1, len(whole) // 1500)), *range(max(0, len(whole) - 3000),
                                                                                    len(whole))}):
            data = bytearray(whole)
            data[at] ^= 0x10
            changed.write_bytes(bytes(data))
            try:
                list(records_in(changed, bytes(data)))  # every record, the empty ones too
                alone = None
            except CheckpointError as exc:
                alone = str(exc)
            try:
                check_crcs(changed)
                taken = None
            except CheckpointError as exc:
                taken = str(exc)
            assert (taken is None) == (alone is None), f"byte {at}: {taken or alone}"


@pytest.mark.parametrize("whole", [True, False], ids=["read whole", "read record by record"])
def test_a_structure_and_the_identity_given_with_it_are_of_the_one_file_read(run, tmp_path, monkeypatch, whole):
    """`ptfile.structure_as` reads a rank file's structure (directory, local headers, pickle) through one descriptor
    and gives that descriptor's fstat, which `--verify` holds the file's bytes to: another file put in its place
    while it is read (the next rank's) changes neither, so no byte is compared under another file's structure."""
    from tailor_tui.formats import ptfile

    tag = run / "checkpoint-6" / "global_step6"
    mine, other = (tag / f"bf16_zero_pp_rank_{rank}_mp_rank_00_optim_states.pt" for rank in (0, 1))
    read = tmp_path / "read.pt"
    shutil.copyfile(mine, read)
    before, expected = read.stat(), read_structure(mine)
    swaps = []
    if not whole:
        monkeypatch.setattr(ptfile, "SMALL_RANK_FILE", 0)  # (the run's files are small)
        real = ptfile._records_of

        def swapped_midway(path, fd):
            if not swaps:  # once, the file opened: the path now names another, whose directory is not read yet
                shutil.copyfile(other, tmp_path / "next.pt")
                swaps.append((tmp_path / "next.pt").stat())
                (tmp_path / "next.pt").replace(read)
            return real(path, fd)

        monkeypatch.setattr(ptfile, "_records_of", swapped_midway)
    (obj, records, prefix), seen = ptfile.structure_as(read)
    assert seen is not None and (seen.st_dev, seen.st_ino) == (before.st_dev, before.st_ino)
    assert dict(records) == dict(expected[1]) and prefix == expected[2]
    if not whole:
        assert read.stat().st_ino == swaps[0].st_ino != before.st_ino
        assert dict(read_structure(read)[1]) != dict(records)  # (the other file's records: its CRC-32s)


def test_a_legacy_format_files_structure_is_read_through_the_one_descriptor_too(tmp_path, monkeypatch):
    """A legacy-format (non-zip) torch file's structure, too, is read through the descriptor whose fstat
    `structure_as` gives: another file put in its place once it is opened is not the one read."""
    import torch

    from tailor_tui.formats import ptfile

    mine, other, read = tmp_path / "mine.pt", tmp_path / "other.pt", tmp_path / "read.pt"
    torch.save({"exp_avg": torch.zeros(10)}, mine, _use_new_zipfile_serialization=False)
    torch.save({"exp_avg": torch.ones(30), "step": torch.zeros(2)}, other, _use_new_zipfile_serialization=False)
    shutil.copyfile(mine, read)
    before, expected = read.stat(), read_structure(mine)
    real = ptfile._legacy_records

    def swapped_midway(path, *args, **kwargs):
        shutil.copyfile(other, tmp_path / "next.pt")
        (tmp_path / "next.pt").replace(read)  # the path now names the other file, nothing of it read yet
        return real(path, *args, **kwargs)

    monkeypatch.setattr(ptfile, "_legacy_records", swapped_midway)
    (_obj, records, _prefix), seen = ptfile.structure_as(read)
    assert (seen.st_dev, seen.st_ino) == (before.st_dev, before.st_ino) != (read.stat().st_dev, read.stat().st_ino)
    assert dict(records) == dict(expected[1])
