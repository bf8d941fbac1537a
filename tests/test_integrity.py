"""Corruption is refused, never blessed: every byte the output takes from the base or a
source is checked against the CRC-32 its archive stores, during the merge, before
anything is published (torch.load itself never checks them)."""

from __future__ import annotations

import shutil
import zipfile
from pathlib import Path

import pytest

from conftest import checkpoints_of
from test_cli import assert_one_line_error, tailor, write_recipe


def flip_byte(path: Path, record_suffix: str, where: float = 0.5) -> str:
    """Flip one bit inside a record of a zip-format torch file, as bit rot would; returns its name."""
    with zipfile.ZipFile(path) as z:
        info = next(i for i in z.infolist() if i.filename.endswith(record_suffix))
    with open(path, "r+b") as f:
        f.seek(info.header_offset + 26)
        name_len, extra_len = (int.from_bytes(f.read(2), "little") for _ in range(2))
        at = info.header_offset + 30 + name_len + extra_len + int(info.file_size * where)
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ 0x10]))
    return info.filename


def flat_record(path: Path) -> str:
    """The record of the largest storage (a flat fp32 / exp_avg / exp_avg_sq group)."""
    with zipfile.ZipFile(path) as z:
        return max((i for i in z.infolist() if "/data/" in i.filename), key=lambda i: i.file_size).filename


@pytest.fixture
def run_copy(real_run, tmp_path):
    run, spec = real_run("ds_bf16_3_subgroups")
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    return checkpoints_of(copy, spec)


@pytest.mark.parametrize("where", ["source", "base"])
def test_a_flipped_bit_in_an_optim_file_is_refused(run_copy, tmp_path, where):
    c2, c4, c6 = run_copy
    target = next((c2 if where == "source" else c6).glob("*rank_1_*optim_states.pt"))
    # anywhere in the record: a source's record is checked whole, not only the slices taken
    record = flip_byte(target, flat_record(target), where=0.999)
    # every row from step 2 (then every sub-group's record of the source is taken from), the base's state
    recipe = write_recipe(tmp_path, c6, {r: c2 for r in ("embed_tokens", "layers.0", "layers.1", "layers.2",
                                                         "layers.3", "norm", "lm_head")})
    result = tailor("--apply", recipe, "-j", "2")
    assert_one_line_error(result, 4, target.name, f"record {record} fails its CRC-32 check", "re-copy it")
    assert not (tmp_path / "composed").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_a_flipped_bit_in_a_file_copied_whole_is_refused(run_copy, tmp_path):
    c2, c4, c6 = run_copy
    target = next(c6.glob("*rank_0_*model_states.pt"))
    record = flip_byte(target, "data.pkl", where=0.9)
    recipe = write_recipe(tmp_path, c6, {"layers.0": c2})
    assert_one_line_error(tailor("--apply", recipe), 4, target.name, f"record {record} fails its CRC-32")


def test_verify_refuses_a_corrupt_source(run_copy, tmp_path):
    c2, c4, c6 = run_copy
    recipe = write_recipe(tmp_path, c6, {r: c2 for r in ("embed_tokens", "layers.0", "layers.1", "layers.2",
                                                         "layers.3", "norm", "lm_head")})
    assert tailor("--apply", recipe).returncode == 0
    target = next(c2.glob("*rank_2_*optim_states.pt"))
    flip_byte(target, flat_record(target), where=0.01)
    result = tailor("--verify", recipe)
    assert result.returncode != 0 and "fails its CRC-32 check" in result.stdout + result.stderr


def test_a_partial_base_checks_the_full_sources_it_copies_from(real_run, tmp_path):
    run, spec = real_run("ds_selective_parity")
    copy = tmp_path / "sel"
    shutil.copytree(run / "run", copy)
    full = copy / "global_step2"
    target = next(full.glob("*rank_1_*optim_states.pt"))
    record = flip_byte(target, flat_record(target), where=0.5)
    rows = ("embed_tokens", "layers.0", "layers.1", "layers.2", "layers.3", "norm", "lm_head")
    recipe = write_recipe(tmp_path, copy / "partial-step6", {r: full for r in rows})
    assert_one_line_error(tailor("--apply", recipe), 4, target.name, f"record {record} fails its CRC-32 check")
    assert not (tmp_path / "composed").exists()
