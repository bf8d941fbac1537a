"""`--stats` and `--heal` on a run of PyTorch Distributed Checkpoints (a real FSDP2 run, its layers.1 blown up
before its last save): the cells as a ZeRO-3 run's (RMS and Δ checked against torch's own load of the saves),
the heal recipe taking layers.1 from the newest save where it is finite, composed and verified."""

from __future__ import annotations

import json
import math
import shutil

import torch
import torch.distributed.checkpoint as dcp
from helpers import tailor

from tailor_tui.checkpoints.dcp_checkpoint import open_dcp
from tailor_tui.dcp.metadata import MetadataIndex
from tailor_tui.dcp.reading import archive_records, read_metadata


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
    found = read_metadata(copy / "step-4")
    key = "model.model.layers.2.mlp.up_proj.weight"
    info = found.storage_data[MetadataIndex(key, found.state_dict_metadata[key].chunks[0].offsets)]
    with open(copy / "step-4" / info.relative_path, "r+b") as f:
        record = archive_records(copy / "step-4", f.fileno(), info, "chunk")["data/0"]
        f.seek(record.data_offset + 8)
        value = f.read(1)
        f.seek(record.data_offset + 8)
        f.write(bytes([value[0] ^ 0x01]))
    stats = tailor("--stats", copy)
    line = next(x for x in stats.stdout.splitlines() if x.startswith("layers.2"))
    assert line.split()[2:4] == ["✗", "CRC"], line
