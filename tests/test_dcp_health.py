"""`--stats` and `--heal` on a run of PyTorch Distributed Checkpoints (a real FSDP2 run, its layers.1 blown up
before its last save): the cells as a ZeRO-3 run's (RMS and Δ checked against torch's own load of the saves),
the heal recipe taking layers.1 from the newest save where it is finite, composed and verified."""

from __future__ import annotations

import json
import math
import shutil

import torch
import torch.distributed.checkpoint as dcp
from dcp_checks import flip_chunk_byte
from helpers import tailor

from tailor_tui.checkpoints.dcp_checkpoint import open_dcp


def weights(folder, names) -> dict[str, torch.Tensor]:
    state = {f"model.{n}": torch.zeros(0) for n in names}
    entries = dcp.FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    state = {k: torch.zeros(entries[k].size, dtype=entries[k].properties.dtype) for k in state}
    dcp.load(state, checkpoint_id=folder, no_dist=True)
    return {k.removeprefix("model."): v.double() for k, v in state.items()}


def test_stats_of_an_fsdp2_run_are_its_rows_health(fsdp_run):
    run, _spec = fsdp_run("fsdp_llama")
    done = tailor("--stats", run)
    assert done.returncode == 0, done.stderr
    lines = {line.split()[0]: line for line in done.stdout.splitlines() if line.strip()}
    assert lines["row"].split() == ["row", "step-2", "step-4", "step-6"]
    assert "✗ NaN×3,072" in lines["layers.1"] and "✗" not in lines["layers.0"]  # weights and exp_avg_sq
    assert "1 unhealthy cell(s)" in done.stdout
    checked = tailor("--stats", run, "--check")
    assert checked.returncode == 8 and "layers.1 in step-6" in checked.stderr
    cells = {(c["row"], c["checkpoint"].rsplit("/", 1)[1]): c for c in json.loads(tailor("--stats", run, "--json").stdout)["cells"]}
    params = [p for r in open_dcp(run / "step-6").rows if r.name == "layers.0" for p in r.params]
    now, before = weights(run / "step-6", params), weights(run / "step-4", params)
    count = sum(t.numel() for t in now.values())
    rms = math.sqrt(sum(float((t * t).sum()) for t in now.values()) / count)
    change = math.sqrt(sum(float(((now[p] - before[p]) ** 2).sum()) for p in params)) / math.sqrt(
        sum(float((before[p] ** 2).sum()) for p in params))
    cell = cells["layers.0", "step-6"]
    assert math.isclose(cell["weight_rms"], rms, rel_tol=1e-9) and math.isclose(cell["rel_change"], change, rel_tol=1e-9)
    assert cells["layers.1", "step-6"]["nonfinite"] == 3072 and cells["layers.1", "step-6"]["weight_rms"] is None
    assert cells["layers.0", "step-2"]["rel_change"] is None and cells["layers.0", "step-6"]["adam_v_max"] > 0


def test_heal_apply_verify_an_fsdp2_run(fsdp_run, tmp_path):
    run, _spec = fsdp_run("fsdp_llama")
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    healed = tailor("--heal", copy, "--recipe", tmp_path / "fix.yaml")
    assert healed.returncode == 0, healed.stderr
    assert "layers.1 <- step-4 (step-6: 3,072 non-finite value(s))" in healed.stdout
    assert tailor("--apply", tmp_path / "fix.yaml").returncode == 0
    verified = tailor("--verify", tmp_path / "fix.yaml")
    assert verified.returncode == 0 and "ok    layers.1      step-4" in verified.stdout, verified.stdout
    columns = tailor("--stats", copy).stdout.splitlines()[0].split()
    assert columns == ["row", "step-2", "step-4", "step-6"]  # its output (step-6-tailored) is no training save
    # a chunk whose bytes no longer match their CRC-32: its row's cell says so
    flip_chunk_byte(copy / "step-4", "model.model.layers.2.mlp.up_proj.weight", at=8, bit=0x01)
    stats = tailor("--stats", copy)
    line = next(x for x in stats.stdout.splitlines() if x.startswith("layers.2"))
    assert line.split()[2:4] == ["✗", "CRC"], line


def test_the_statistics_of_a_dcp_run_are_cached_until_a_file_is_saved_again(fsdp_run, tmp_path):
    """A second --stats reads nothing and prints the same table; a save written again (another identity) is read again,
    and the next one too (its Δ is against it)."""
    run, _spec = fsdp_run("fsdp_llama")
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    env = {"TAILOR_TUI_CACHE": str(tmp_path / "cache")}
    first = tailor("--stats", copy, env=env)
    assert first.returncode == 0 and ", 3 cached" not in first.stderr, first.stderr
    again = tailor("--stats", copy, env=env)
    assert again.stdout == first.stdout
    assert "statistics of 3 checkpoint(s): 6 .distcp file(s), 6 cached, 0 Bytes to read" in again.stderr, again.stderr
    step4 = copy / "step-4" / "__0_0.distcp"
    step4.write_bytes(step4.read_bytes())  # the same bytes, saved again: another file
    third = tailor("--stats", copy, env=env)
    assert third.stdout == first.stdout and "6 .distcp file(s), 2 cached" in third.stderr, third.stderr
