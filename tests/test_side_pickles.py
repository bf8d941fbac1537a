"""The pickles of the files an output takes whole from its base (rng_state, scheduler.pt,
training_args.bin, Accelerate's random_states/scheduler.bin, a `.bin` no row changes) are checked as
torch reads them before they are copied (issue 43): a crafted file whose CRC-32s all match but whose
pickle torch cannot load (a storage with no record or a record of another size, an unknown storage
type, a view past its storage, a pickle cut before its STOP, one naming a global that would run) is
refused in one line naming the file, and torch.load(weights_only=False) indeed fails on each; every
real side file of the fixtures passes. Files are crafted from real runs by rewriting the pickle record
(data.pkl) and re-zipping with Python's zipfile (stored, correct CRCs)."""

from __future__ import annotations

import pickle
import shutil
from pathlib import Path

import pytest
from helpers import assert_one_line_error, tailor, write_recipe
from side_pickles_helpers import rezipped

from tailor_tui.errors import CheckpointError
from tailor_tui.formats.side_pickles import check_side_file


def rezip(src: Path, dst: Path, change=lambda data: data, drop: str | None = None) -> Path:
    """`src` written again to `dst` record by record (stored, CRC-32s right), its data.pkl through `change`."""
    dst.write_bytes(rezipped(src, change, drop))
    return dst


def replace(old: bytes, new: bytes):
    def change(data: bytes) -> bytes:
        assert data.count(old) == 1, old
        return data.replace(old, new)
    return change


# torch.save's pickle of the HF Trainer's RNG state: its CPU generator state, a ByteStorage of 5056 bytes
# (persistent id ('storage', torch.ByteStorage, '0', 'cpu', 5056)), then _rebuild_tensor_v2(storage, 0,
# (5056,), (1,), False, OrderedDict())
STORAGE_ID = b"X\x01\x00\x00\x000q\x20h\x1cM\xc0\x13t"  # key '0', location (memo), numel 5056
VIEW = b"Q\x4b\x00M\xc0\x13\x85q\x22K\x01\x85q\x23\x89"  # offset 0, size (5056,), stride (1,), requires_grad
CRAFTED = {  # what is changed in rng_state's data.pkl, what the line says
    "storage with no record": (replace(STORAGE_ID, STORAGE_ID.replace(b"0q", b"7q")),
                               "names storage 7, but it has no record"),
    "record too short for numel": (replace(STORAGE_ID, STORAGE_ID.replace(b"\xc0\x13", b"\xc1\x13")),
                                   "needs 5057 bytes, its record"),
    "record too long for numel": (lambda data: replace(VIEW, VIEW.replace(b"M\xc0\x13", b"M\xbf\x13"))(
        replace(STORAGE_ID, STORAGE_ID.replace(b"\xc0\x13", b"\xbf\x13"))(data)), "needs 5055 bytes, its record"),
    "unknown storage type": (replace(b"torch\nByteStorage", b"torch\nBogusStorage"), "torch.BogusStorage"),
    "view past its storage": (replace(VIEW, VIEW.replace(b"M\xc0\x13", b"M\xc1\x13")),
                              "reaches past the 5056 elements"),
    "offset past its storage": (replace(VIEW, VIEW.replace(b"K\x00", b"K\x01")), "offset 1"),
    "negative stride": (replace(VIEW, VIEW.replace(b"K\x01", b"J\xff\xff\xff\xff")), "not a view torch makes"),
    "bytes requiring gradients": (replace(VIEW, VIEW[:-1] + b"\x88"), "requires gradients"),
    "unknown device": (replace(b"X\x03\x00\x00\x00cpu", b"X\x03\x00\x00\x00cpt"), "device 'cpt'"),
    "truncated (no STOP)": (lambda data: data[:-1], "before its STOP"),
    "numpy array of another size": (replace(b"K\x01M\x70\x02\x85", b"K\x01M\x71\x02\x85"), "shape (625,)"),
}


@pytest.fixture(scope="module")
def hf_run(real_run):
    return real_run("hf_bf16_2")[0]


@pytest.fixture(scope="module")
def rng(hf_run):
    return hf_run / "checkpoint-6" / "rng_state_1.pth"


def refused(path: Path, *needles: str) -> str:
    with pytest.raises(CheckpointError) as caught:
        check_side_file(path)
    line = str(caught.value)
    assert "\n" not in line and line.startswith(f"{path}: refused to load: "), line
    for needle in needles:
        assert needle in line, line
    return line


def torch_fails(path: Path) -> None:
    import torch

    with pytest.raises(Exception):  # noqa: B017, PT011 (whatever torch raises: it does not load)
        torch.load(path, weights_only=False)


@pytest.mark.parametrize("case", list(CRAFTED))
def test_a_crafted_rng_pickle_torch_cannot_load_is_refused_in_one_line(rng, tmp_path, case):
    change, needle = CRAFTED[case]
    crafted = rezip(rng, tmp_path / rng.name, change)
    refused(crafted, needle)
    torch_fails(crafted)


def test_a_missing_storage_record_is_refused(rng, tmp_path):
    crafted = rezip(rng, tmp_path / rng.name, drop="/data/0")
    refused(crafted, "has no record rng_state_1/data/0")
    torch_fails(crafted)


def test_the_check_reads_the_file_the_copy_reads_whatever_is_at_its_path_by_then(rng, tmp_path):
    """The composer checks a run-level file through the descriptor it copies from (`fd=`): a crafted file
    opened, then a sound one renamed over its path, is refused, naming the path; a sound one opened, then a
    crafted one put at its path, passes (the crafted one is never read, nor copied)."""
    import os

    change, needle = CRAFTED["unknown device"]
    crafted, sound, path = tmp_path / "crafted", tmp_path / "sound", tmp_path / rng.name
    for opened, then, fails in ((crafted, sound, True), (sound, crafted, False)):
        rezip(rng, crafted, change)
        shutil.copyfile(rng, sound)
        shutil.copyfile(opened, path)
        fd = os.open(path, os.O_RDONLY)
        try:
            os.replace(then, path)
            if fails:
                with pytest.raises(CheckpointError) as caught:
                    check_side_file(path, fd=fd)
                assert str(caught.value).startswith(f"{path}: refused to load: ") and needle in str(caught.value)
            else:
                check_side_file(path, fd=fd)
                with pytest.raises(CheckpointError):
                    check_side_file(path)  # (what is at the path now is the crafted one)
        finally:
            os.close(fd)


def test_the_same_records_rezipped_pass_and_load(rng, tmp_path):
    """The crafting itself is no cause: the file re-zipped unchanged passes and torch loads it."""
    import torch

    same = rezip(rng, tmp_path / rng.name)
    check_side_file(same)
    assert torch.equal(torch.load(same, weights_only=False)["cpu"], torch.load(rng, weights_only=False)["cpu"])


def test_a_global_that_would_run_is_refused_and_nothing_is_called(hf_run, tmp_path):
    """A scheduler.pt whose pickle calls posix.system: refused by name, and never called (the file
    named by the command is not created). torch.load(weights_only=False) would run it."""
    marker = tmp_path / "ran"
    payload = (b"\x80\x02cposix\nsystem\nX" + len(f"touch {marker}").to_bytes(4, "little")
               + f"touch {marker}".encode() + b"\x85R.")
    crafted = rezip(hf_run / "checkpoint-6" / "scheduler.pt", tmp_path / "scheduler.pt", lambda data: payload)
    refused(crafted, "posix.system", "would import and call it")
    assert not marker.exists()


def test_a_training_scripts_own_arguments_class_passes(hf_run, tmp_path):
    """training_args.bin of a script that subclassed TrainingArguments pickles `__main__.MyArguments`:
    a load resolves it in the loading program's own script, so it is read as an inert stand-in."""
    payload = b"\x80\x02c__main__\nMyArguments\n)\x81}X\x03\x00\x00\x00lr_G?\x00\x00\x00\x00\x00\x00\x00sb."
    crafted = rezip(hf_run / "checkpoint-6" / "scheduler.pt", tmp_path / "training_args.bin", lambda data: payload)
    check_side_file(crafted)


@pytest.mark.parametrize("why, payload, needle", [
    ("nested too deep", b"\x80\x02" + b"(" * 101 + b"l" * 101 + b".", "nested more than"),
    ("a memo index no checkpoint uses", b"\x80\x02Nr\x00\x00\x00\x40.", "memo index"),
    ("no STOP", b"\x80\x02}q\x00", "before its STOP"),
])
def test_a_pickle_beyond_the_bounds_is_refused(hf_run, tmp_path, why, payload, needle):
    """The bounds every checkpoint pickle is held to (pickle_bounds) hold for side files: a pickle nested
    deeper, or using a larger memo, than any checkpoint's is refused before it is unpickled (torch would
    try: what it would build is the hostile part)."""
    crafted = rezip(hf_run / "checkpoint-6" / "scheduler.pt", tmp_path / "scheduler.pt", lambda data: payload)
    refused(crafted, needle)


def side_files(folder: Path) -> list[Path]:
    skip = (".json", ".safetensors", ".py", ".md", ".txt", ".model", ".jinja", "latest")
    return [p for p in sorted(folder.rglob("*")) if p.is_file() and not p.name.endswith(skip)
            and "_states.pt" not in p.name]


@pytest.mark.parametrize("name", ["hf_bf16_2", "hf_fp32_3_tied", "accelerate_ds", "hf_bin", "hf_peft_lora_bin"])
def test_every_real_side_file_of_the_fixtures_passes_and_loads(real_run, name):
    import torch

    run, _spec = real_run(name)
    found = side_files(run)
    kinds = {p.name.split("_")[0] for p in found}
    assert found and kinds & {"rng", "random", "scheduler.pt", "scheduler.bin"}, kinds
    for path in found:
        check_side_file(path)
        torch.load(path, weights_only=False)


def test_a_legacy_format_side_file_is_checked_too(rng, tmp_path):
    """torch's legacy (non-zip) format: a real RNG state saved so passes; its view made to reach past
    its storage is refused, and torch cannot load it either."""
    import torch

    legacy = tmp_path / "rng_state_1.pth"
    torch.save(torch.load(rng, weights_only=False), legacy, _use_new_zipfile_serialization=False)
    check_side_file(legacy)
    data = legacy.read_bytes()
    view = b"K\x00M\xc0\x13\x85"  # offset 0, shape (5056,)
    assert data.count(view) == 1
    legacy.write_bytes(data.replace(view, b"K\x00M\xc1\x13\x85"))
    refused(legacy, "reaches past the 5056 elements")
    torch_fails(legacy)


def test_a_plain_pickle_is_bounded_and_read_with_stand_ins(tmp_path):
    """Accelerate's older random_states_N.pkl: a plain pickle. A real-shaped one passes; one that would
    run code, or is cut short, is refused in one line."""
    import random

    import numpy as np

    path = tmp_path / "random_states_0.pkl"
    path.write_bytes(pickle.dumps({"random_state": random.getstate(), "numpy_random_seed": np.random.get_state(),
                                   "step": 3}, protocol=2))
    check_side_file(path)
    path.write_bytes(path.read_bytes()[:-1])
    refused(path, "before its STOP")
    path.write_bytes(b"\x80\x02cos\nsystem\nX\x04\x00\x00\x00true\x85R.")
    refused(path, "os.system")


def test_apply_refuses_a_crafted_rng_state_through_the_command_line(hf_run, tmp_path):
    """`--apply` of a recipe whose base holds an rng_state torch cannot load: exit 4, one `error:`
    line naming the file, nothing written."""
    run = tmp_path / "run"
    shutil.copytree(hf_run, run, symlinks=True)
    target = run / "checkpoint-6" / "rng_state_1.pth"
    change, _needle = CRAFTED["view past its storage"]
    rezip(hf_run / "checkpoint-6" / "rng_state_1.pth", target, change)
    recipe = write_recipe(tmp_path, run / "checkpoint-6", {"layers.1": run / "checkpoint-4"})
    assert_one_line_error(tailor("--apply", recipe), 4, str(target), "reaches past the 5056 elements")
    assert not (tmp_path / "composed").exists()
    assert not any(p.name.startswith(".") and "composed" in p.name for p in tmp_path.iterdir())
