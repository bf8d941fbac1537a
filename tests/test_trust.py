"""Trust on a shared cluster: caches that notice change, no symlink followed when a file is
created, side files read within bounds, and nothing taken whole from a base unchecked. Each
case on a real run, through the command line where a user meets it."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest
from conftest import checkpoints_of
from helpers import assert_one_line_error, flat_record, flip_byte, tailor, tailor_peak, write_recipe
from refusal_cases import rebuild_bomb, size_bomb

from tailor_tui.errors import OutputError


def _copy_run(real_run, tmp_path: Path, name: str = "hf_bf16_2") -> tuple[Path, object]:
    run, spec = real_run(name)
    copy = tmp_path / "run"
    shutil.copytree(run, copy, symlinks=True)
    return copy, spec


def _cells(result) -> list[dict]:
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)["cells"]


def test_a_rank_file_changed_in_place_with_its_times_set_back_is_read_again(real_run, tmp_path):
    """`touch -r`: the same path, size and mtime, other bytes. Its ctime (which no user can set
    back) is in the cache key: the damage is found, not the cached health served."""
    run, spec = _copy_run(real_run, tmp_path)
    newest = checkpoints_of(run, spec)[-1]
    cache = {"TAILOR_TUI_CACHE": str(tmp_path / "cache")}
    first = _cells(tailor("--stats", run, "--json", env=cache))
    assert all(c["crc_ok"] for c in first)
    target = next((newest / "global_step6").glob("*rank_0_*optim_states.pt"))
    st = target.stat()
    time.sleep(0.01)  # a ctime that differs even on coarse clocks
    flip_byte(target, flat_record(target))
    os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (target.stat().st_size, target.stat().st_mtime_ns) == (st.st_size, st.st_mtime_ns)
    second = _cells(tailor("--stats", run, "--json", env=cache))
    damaged = [c for c in second if c["checkpoint"] == str(newest) and (not c["crc_ok"] or c.get("error"))]
    assert damaged, "the cached statistics of the changed file were served"


def test_a_symlink_planted_as_the_outputs_lock_is_not_followed(real_run, tmp_path):
    run, spec = real_run("hf_bf16_2")
    c2, _c4, c6 = checkpoints_of(run, spec)
    recipe = write_recipe(tmp_path, c6, {"layers.1": c2})
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    (tmp_path / ".composed.tailor-lock").symlink_to(victim)
    result = tailor("--apply", recipe)
    assert_one_line_error(result, 6, ".composed.tailor-lock", "symbolic link", "not followed")
    assert victim.read_text() == "precious\n"
    assert not (tmp_path / "composed").exists()


def test_the_batch_script_is_never_written_through_a_planted_link(tmp_path):
    from tailor_tui.team.sbatch import script_path, write_sbatch

    recipe = tmp_path / "fix.yaml"
    recipe.write_text("version: 1\n")
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    script_path(recipe).symlink_to(victim)
    with pytest.raises(OutputError, match="not written by tailor-tui"):
        write_sbatch(recipe, 1 << 40)
    assert victim.read_text() == "precious\n"
    script_path(recipe).unlink()
    planted = script_path(recipe).with_name(f".{script_path(recipe).name}.{os.getpid()}.tmp")
    planted.symlink_to(victim)  # at the temporary name it writes first
    with pytest.raises(OutputError, match="cannot be written"):
        write_sbatch(recipe, 1 << 40)
    assert victim.read_text() == "precious\n" and planted.is_symlink()
    planted.unlink()
    assert "tailor-tui" in write_sbatch(recipe, 1 << 40).read_text()


def test_side_files_that_are_fifos_or_nest_deeply_do_not_hang_or_crash_the_statistics(real_run, tmp_path):
    run, spec = _copy_run(real_run, tmp_path)
    c2, c4, _c6 = checkpoints_of(run, spec)
    (c2 / "trainer_state.json").unlink()
    os.mkfifo(c2 / "trainer_state.json")  # opening it for reading would wait for a writer
    (c4 / "trainer_state.json").write_text("[" * 100_000 + "]" * 100_000)
    started = time.monotonic()
    result = tailor("--stats", run, "--json", env={"TAILOR_TUI_CACHE": str(tmp_path / "cache")}, timeout=120)
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
    logged = {c["step"]: c["loss"] for c in json.loads(result.stdout)["checkpoints"]}
    assert logged[2] is None and logged[4] is None and logged[6] is not None  # the others' logs are not read
    assert time.monotonic() - started < 60


@pytest.mark.parametrize("config", ["deep", "fifo", "device", "huge"])
def test_an_export_config_that_is_no_config_is_refused_in_one_line(real_run, tmp_path, config):
    run, spec = real_run("hf_bf16_2")
    c2, _c4, c6 = checkpoints_of(run, spec)
    recipe = write_recipe(tmp_path, c6, {"layers.1": c2})
    path = tmp_path / "config.json"
    if config == "deep":
        path.write_text('{"a": ' * 5000 + "1" + "}" * 5000)
    elif config == "fifo":
        os.mkfifo(path)
    elif config == "huge":
        with open(path, "wb") as f:
            f.truncate(8 << 20)
    else:
        path = Path("/dev/zero")
    result, peak = tailor_peak("--export", recipe, "--to", tmp_path / "hf", "--config", path, timeout=60)
    assert_one_line_error(result, 2, str(path), "not a regular file" if config in ("fifo", "device")
                          else "not a model config")
    assert peak < 256 << 20, peak
    assert not (tmp_path / "hf").exists()


def test_heal_refuses_a_base_whose_rng_state_fails_its_crc(real_run, tmp_path):
    run, spec = _copy_run(real_run, tmp_path)
    newest = checkpoints_of(run, spec)[-1]
    flip_byte(newest / "rng_state_0.pth", "data/0")
    recipe = tmp_path / "healed.yaml"
    result = tailor("--heal", run, "--recipe", recipe, env={"TAILOR_TUI_CACHE": str(tmp_path / "cache")})
    assert_one_line_error(result, 4, "rng_state_0.pth", "CRC")
    assert not recipe.exists()


def test_a_safetensors_header_far_larger_than_its_tensors_is_refused_within_bounds(real_run, tmp_path):
    """90 MB of header for one tensor (the safetensors library would parse it, into gigabytes of
    Python objects): refused before it is parsed, one line, well under 256 MiB."""
    import struct

    run, spec = _copy_run(real_run, tmp_path)
    _c2, c4, c6 = checkpoints_of(run, spec)
    header = json.dumps({"__metadata__": {"format": "pt"}, "t": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
                         "pad": [0] * 30_000_000}, separators=(",", ":")).encode()
    with open(c4 / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header + bytes(4))
    recipe = write_recipe(tmp_path, c6, {"layers.1": c4})
    result, peak = tailor_peak("--apply", recipe)
    assert_one_line_error(result, 4, "model.safetensors", "for 1 tensor(s)")
    assert peak < 256 << 20, peak
    assert not (tmp_path / "composed").exists()


@pytest.mark.parametrize(("bomb", "why"), [(size_bomb, "MiB of objects"), (rebuild_bomb, "MiB of objects")])
def test_a_pickle_that_reuses_its_memo_to_build_gigabytes_is_refused_in_little_memory(real_run, tmp_path, bomb,
                                                                                        why):
    """Small pickles whose objects are each cheap to write but large to build (one memoized tuple
    used over and over): bounded by what each construction builds, not by bytes alone."""
    import zipfile

    run, spec = real_run("hf_bf16_2")
    c2, _c4, c6 = checkpoints_of(run, spec)
    bad = tmp_path / "checkpoint-2"
    shutil.copytree(c2, bad)
    target = bad / "global_step2" / "zero_pp_rank_0_mp_rank_00_model_states.pt"
    with zipfile.ZipFile(c2 / "global_step2" / target.name) as z, \
            zipfile.ZipFile(target, "w", zipfile.ZIP_STORED) as out:
        for info in z.infolist():
            out.writestr(info, bomb() if info.filename.endswith("/data.pkl") else z.read(info))
    recipe = write_recipe(tmp_path, c6, {"layers.1": bad})
    result, peak = tailor_peak("--apply", recipe, "--dry-run")
    assert_one_line_error(result, 4, target.name, why)
    assert peak < 256 << 20, peak
