"""The HF Trainer's FSDP checkpoints are runs as torchtitan's are. A real FSDP2 run saves `checkpoint-N` folders
holding `pytorch_model_fsdp_0/` and `optimizer_0/` (keys `model.*`, `optimizer.*`) beside the Trainer's run-level
files, written by Accelerate's own `save_fsdp_model` and `save_fsdp_optimizer` as the Trainer calls them (the
Trainer keeps a CPU run in DDP; `tests/fsdp_run.py`). Its statistics find the layer that blew up; `--heal` and
`--apply` compose it per row into the same layout, which Accelerate's own loaders (the Trainer's
resume_from_checkpoint) load at world sizes 1 and 2 and train on, every key bit for bit its chosen source's;
`--verify` proves it, run-level files included; rows mix with torchtitan-layout saves of the same model."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from dcp_checks import assert_archives_intact, assert_reads_as_torch
from helpers import tailor, write_recipe
from test_dcp_compose import loaded, same_bits
from test_dcp_export import load_in_fsdp2

from tailor_tui.checkpoints.dcp_checkpoint import HF_MODEL_PART, HF_OPTIM_PART, open_dcp

PARTS = (HF_MODEL_PART, HF_OPTIM_PART)
RUN_FILES = ["rng_state_0.pth", "rng_state_1.pth", "scheduler.pt", "trainer_state.json"]


def loaded_trainer(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of an HF Trainer FSDP checkpoint, as torch's dcp.load gives each of its folders."""
    return {**loaded(folder / HF_MODEL_PART), **loaded(folder / HF_OPTIM_PART)}


def test_stats_of_a_trainer_fsdp_run_find_the_layer_that_blew_up(fsdp_run):
    run, _spec = fsdp_run("fsdp_llama_hf")
    done = tailor("--stats", run)
    assert done.returncode == 0, done.stderr
    lines = {line.split()[0]: line for line in done.stdout.splitlines() if line.strip()}
    assert lines["row"].split() == ["row", "checkpoint-2", "checkpoint-4"]
    assert "✗ NaN" in lines["layers.1"] and "✗" not in lines["layers.0"] + lines["lm_head"]
    found = json.loads(tailor("--stats", run, "--json").stdout)
    cells = {(c["row"], c["checkpoint"].rsplit("/", 1)[1]): c for c in found["cells"]}
    # the loss the Trainer logged at each save (its trainer_state.json), as for a ZeRO-3 run
    logged = {e["step"]: e["loss"] for e in json.loads((run / "checkpoint-4" / "trainer_state.json").read_text())[
        "log_history"]}
    assert [(c["step"], c["loss"]) for c in found["checkpoints"]] == [(2, logged[2]), (4, logged[4])]
    assert lines["loss"].split()[1:] == [f"{logged[2]:.4g}", f"{logged[4]:.4g}"]
    assert cells["layers.1", "checkpoint-4"]["nonfinite"] > 0 and cells["layers.0", "checkpoint-4"]["adam_v_max"] > 0
    assert [r.name for r in open_dcp(run / "checkpoint-4").rows] == [
        "embed_tokens", "layers.0", "layers.1", "layers.2", "layers.3", "norm", "lm_head"]


@pytest.mark.parametrize("world", [1, 2])
def test_a_healed_trainer_checkpoint_resumes_in_accelerate_and_is_verified(fsdp_run, tmp_path, world):
    run, _spec = fsdp_run("fsdp_llama_hf")
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    healed = tailor("--heal", copy, "--recipe", tmp_path / "fix.yaml")
    assert healed.returncode == 0, healed.stderr
    assert "layers.1 <- checkpoint-2" in healed.stdout, healed.stdout
    done = tailor("--apply", tmp_path / "fix.yaml")
    assert done.returncode == 0, done.stderr
    assert "resume the HF Trainer from it" in done.stdout
    out, base, earlier = copy / "checkpoint-4-tailored", copy / "checkpoint-4", copy / "checkpoint-2"
    assert sorted(p.name for p in out.iterdir() if p.is_file()) == sorted([*RUN_FILES, "tailor_provenance.json"])
    for name in RUN_FILES:
        assert (out / name).read_bytes() == (base / name).read_bytes(), name
    for part in PARTS:
        assert_archives_intact(out / part)
        assert assert_reads_as_torch(out / part)
    got, sources = loaded_trainer(out), {base: loaded_trainer(base), earlier: loaded_trainer(earlier)}
    assert got.keys() == sources[base].keys()
    rows = open_dcp(base).row_of_key()
    for key, tensor in got.items():
        source = earlier if rows.get(key) == "layers.1" and not key.endswith(".step") else base
        assert same_bits(tensor, sources[source][key]), (key, source.name)
    assert not any(bool(t.isnan().any()) for t in got.values() if t.is_floating_point())
    state, stepped = load_in_fsdp2(out, run, world, tmp_path, spec_file=run / "spec.json")
    for name, tensor in state["model"].items():
        source = earlier if name.startswith("model.layers.1.") else base
        assert torch.equal(tensor, sources[source][f"model.{name}"]), name
        assert torch.equal(state["optim"]["state"][name]["exp_avg_sq"],
                           sources[source][f"optimizer.state.{name}.exp_avg_sq"]), name
    assert stepped["finite"] and stepped["loss"] == stepped["loss"]
    recipe = tmp_path / "fix.yaml"
    verified = tailor("--verify", recipe)
    assert verified.returncode == 0 and "ok    layers.1      checkpoint-2" in verified.stdout, verified.stdout
    # a run-level file of the output changed: --verify names it
    scheduler = out / "scheduler.pt"
    scheduler.write_bytes(scheduler.read_bytes()[:-1] + bytes([scheduler.read_bytes()[-1] ^ 1]))
    changed = tailor("--verify", recipe)
    assert changed.returncode == 7 and "scheduler.pt: differs at byte" in changed.stdout, changed.stdout


def test_rows_mix_between_a_trainer_checkpoint_and_a_torchtitan_save(fsdp_run, tmp_path):
    """A torchtitan-layout base (`optim.` keys in one folder) with layers.1 from an HF Trainer checkpoint
    (`optimizer.` keys in their own folder), and the other way round: each output is in its base's layout, the row's
    tensors and moments the other's bit for bit, and each loads in FSDP2."""
    titan, _ = fsdp_run("fsdp_llama_4")
    trainer, _ = fsdp_run("fsdp_llama_hf")
    recipe = write_recipe(tmp_path, titan / "step-4", {"layers.1": trainer / "checkpoint-2"})
    done = tailor("--apply", recipe)
    assert done.returncode == 0, done.stderr
    out = tmp_path / "composed"
    assert_archives_intact(out)
    got, theirs = loaded(out), loaded_trainer(trainer / "checkpoint-2")
    name = "model.layers.1.mlp.down_proj.weight"
    assert same_bits(got[f"model.{name}"], theirs[f"model.{name}"])
    assert same_bits(got[f"optim.state.{name}.exp_avg"], theirs[f"optimizer.state.{name}.exp_avg"])
    assert same_bits(got[f"optim.state.{name}.step"], loaded(titan / "step-4")[f"optim.state.{name}.step"])
    assert tailor("--verify", recipe).returncode == 0
    _state, stepped = load_in_fsdp2(out, titan, 2, tmp_path, spec_file=titan / "spec.json")
    assert stepped["finite"]

    (tmp_path / "back").mkdir()
    back = write_recipe(tmp_path / "back", trainer / "checkpoint-4", {"layers.1": titan / "step-2"})
    done = tailor("--apply", back)
    assert done.returncode == 0, done.stderr
    out = tmp_path / "back" / "composed"
    got, theirs = loaded_trainer(out), loaded(titan / "step-2")
    assert same_bits(got[f"optimizer.state.{name}.exp_avg_sq"], theirs[f"optim.state.{name}.exp_avg_sq"])
    assert sorted(p.name for p in (out / HF_OPTIM_PART).iterdir())[:1] == [".metadata"]
    assert tailor("--verify", back).returncode == 0
    _state, stepped = load_in_fsdp2(out, trainer, 1, tmp_path / "back", spec_file=trainer / "spec.json")
    assert stepped["finite"]
