"""Both formats in one recipe, both ways. A ZeRO-3 base (the HF Trainer's, plain DeepSpeed's) takes rows from a real
FSDP2 run's PyTorch Distributed Checkpoint of the same model: the output is a ZeRO-3 checkpoint whose rows' fp32
masters, exp_avg and exp_avg_sq are the DCP checkpoint's bit for bit (its 16-bit weights their cast), every other
row the base's; real DeepSpeed resumes it at 2 and 3 ranks and takes a finite step. A DCP base takes rows from a
ZeRO-3 checkpoint: the output is a DCP checkpoint FSDP2 loads at 1 and 3 ranks, the rows' tensors and moments the
ZeRO-3 checkpoint's bit for bit. `--verify` proves each (and fails a recipe naming another save); NaN is never
taken silently; another optimizer or another model is refused in one line."""

from __future__ import annotations

import shutil

import torch
import torch.distributed.checkpoint as dcp
from conftest import checkpoints_of
from dcp_checks import flip_chunk_byte
from helpers import assert_one_line_error, tailor, tensors, write_recipe
from test_dcp_export import load_in_fsdp2
from test_reshard import resumes_at
from zero_reader import read_full_state

ROW = "layers.1"


def dcp_state(folder) -> dict[str, torch.Tensor]:
    """Every tensor of a DCP checkpoint, as torch's dcp.load gives it."""
    entries = dcp.FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    state = {k: torch.zeros(v.size, dtype=v.properties.dtype) for k, v in entries.items() if hasattr(v, "size")}
    dcp.load(state, checkpoint_id=folder, no_dist=True)
    return state


def assert_rows_from_dcp(out, base, source, row: str) -> None:
    """Each parameter of `row` in the ZeRO-3 output `out`: the DCP checkpoint `source`'s fp32 and moments, bit for bit;
    every other parameter the base's. The key sets compared whole."""
    got, mine, theirs = read_full_state(out), read_full_state(base), dcp_state(source)
    assert got.keys() == mine.keys() and all(got[k].keys() == mine[k].keys() for k in got)
    prefix = f"model.{row}."
    taken = [name for name in got["fp32"] if name.startswith(prefix)]
    assert taken
    for key, by_name in got.items():
        for name, tensor in by_name.items():
            if name in taken:
                want = theirs[f"model.{name}"] if key == "fp32" else theirs[f"optim.state.{name}.{key}"]
            else:
                want = mine[key][name]
            assert torch.equal(tensor.float(), want.float()), (key, name)


def test_an_hf_trainer_zero3_checkpoint_takes_a_row_from_an_fsdp2_save_and_resumes(real_run, fsdp_run, tmp_path):
    run, spec = real_run("hf_bf16_2")
    fsdp, _ = fsdp_run("fsdp_llama_4")
    base = checkpoints_of(run, spec)[-1]
    recipe = write_recipe(tmp_path, base, {ROW: fsdp / "step-4"})
    done = tailor("--apply", recipe)
    assert done.returncode == 0, done.stderr
    # the plan says what the output keeps of the base's: the hyperparameters (the Trainer's schedule ended at 0) and
    # the step count
    assert "step-4's hyperparameters differ from the base's, whose are kept: lr 0.001 (the base 0.0)" in done.stderr
    assert "rows from step-4 (step 4) keep their weights and moments with the base's step count (6)" in done.stderr
    out = tmp_path / "composed"
    assert_rows_from_dcp(out, base, fsdp / "step-4", ROW)
    weights, masters = tensors(out / "model.safetensors"), dcp_state(fsdp / "step-4")
    for name, tensor in weights.items():  # the 16-bit weights: the masters cast, as ZeRO-3 casts them
        if name.startswith(f"model.{ROW}."):
            assert torch.equal(tensor, masters[f"model.{name}"].to(tensor.dtype)), name
    verified = tailor("--verify", recipe)
    assert verified.returncode == 0 and f"ok    {ROW}      step-4" in verified.stdout, verified.stdout
    (tmp_path / "other").mkdir()
    wrong = write_recipe(tmp_path / "other", base, {ROW: fsdp / "step-2"}, output=str(out))
    failed = tailor("--verify", wrong)
    assert failed.returncode == 7 and f"FAIL  {ROW}" in failed.stdout, failed.stdout
    resumes_at(out, spec, 2, tmp_path)
    assert_one_line_error(tailor("--export", recipe, "--to", tmp_path / "hf"), 2, "--apply the recipe, then --export")


def test_a_flipped_bit_in_the_fsdp2_save_is_refused(real_run, fsdp_run, tmp_path):
    run, spec = real_run("hf_bf16_2")
    fsdp, _ = fsdp_run("fsdp_llama_4")
    copy = tmp_path / "step-4"
    shutil.copytree(fsdp / "step-4", copy)
    flip_chunk_byte(copy, "optim.state.model.layers.1.mlp.up_proj.weight.exp_avg", chunk=-1, bit=0x04)
    recipe = write_recipe(tmp_path, checkpoints_of(run, spec)[-1], {ROW: copy})
    assert_one_line_error(tailor("--apply", recipe), 4, "CRC-32")
    assert not (tmp_path / "composed").exists()


def test_a_deepspeed_run_heals_its_blown_up_layer_from_an_fsdp2_save_at_three_ranks(real_run, fsdp_run, tmp_path):
    run, spec = real_run("ds_blown_up")
    fsdp, _ = fsdp_run("fsdp_llama_4")
    base = checkpoints_of(run, spec)[-1]
    recipe = write_recipe(tmp_path, base, {"layers.2": fsdp / "step-4"})
    plan = tailor("--apply", recipe, "--world-size", "3", "--dry-run")
    assert plan.returncode == 0 and "reshard: 2 → 3 ranks" in plan.stdout, plan.stdout + plan.stderr
    done = tailor("--apply", recipe, "--world-size", "3")
    assert done.returncode == 0, done.stderr
    out = tmp_path / "composed"
    assert_rows_from_dcp(out, base, fsdp / "step-4", "layers.2")
    assert tailor("--verify", recipe, "--world-size", "3").returncode == 0
    resumes_at(out, spec, 3, tmp_path)


def test_another_optimizer_or_another_model_is_refused_in_one_line(real_run, fsdp_run, tmp_path):
    run, spec = real_run("ds_amsgrad")
    fsdp, _ = fsdp_run("fsdp_llama_4")
    recipe = write_recipe(tmp_path, checkpoints_of(run, spec)[-1], {ROW: fsdp / "step-4"})
    assert_one_line_error(tailor("--apply", recipe), 5, "per element", "different optimizers")
    other, _ = fsdp_run("fsdp_llama")  # 3 layers
    hf, hf_spec = real_run("hf_bf16_2")
    recipe = write_recipe(tmp_path, checkpoints_of(hf, hf_spec)[-1], {ROW: other / "step-4"})
    assert_one_line_error(tailor("--apply", recipe), 5, "cannot be combined with", "model.layers.3")
    assert not (tmp_path / "composed").exists()


def test_a_dcp_base_takes_a_row_from_a_zero3_checkpoint_and_fsdp2_loads_it(real_run, fsdp_run, tmp_path):
    run, spec = real_run("hf_bf16_2")
    fsdp, _ = fsdp_run("fsdp_llama_4")
    zero = checkpoints_of(run, spec)[-1]
    recipe = write_recipe(tmp_path, fsdp / "step-4", {ROW: zero})
    done = tailor("--apply", recipe)
    assert done.returncode == 0, done.stderr
    assert "checkpoint-6's hyperparameters differ from the base's, whose are kept: lr 0.0 (the base 0.001)" in done.stderr
    out = tmp_path / "composed"
    got, base, theirs = dcp_state(out), dcp_state(fsdp / "step-4"), read_full_state(zero)
    assert got.keys() == base.keys()
    taken = 0
    for key, tensor in got.items():
        name = key.removeprefix("model.") if key.startswith("model.") else key.removeprefix("optim.state.").rpartition(".")[0]
        if name.startswith(f"model.{ROW}.") and not key.endswith(".step"):
            flat = "fp32" if key.startswith("model.") else key.rpartition(".")[2]
            assert torch.equal(tensor.reshape(-1), theirs[flat][name].float().reshape(-1)), key
            taken += 1
        else:
            assert torch.equal(tensor, base[key]), key
    assert taken == 3 * 9  # layers.1's nine parameters: their weights, exp_avg, exp_avg_sq
    verified = tailor("--verify", recipe)
    assert verified.returncode == 0 and f"ok    {ROW}      checkpoint-6" in verified.stdout, verified.stdout
    (tmp_path / "other").mkdir()
    wrong = write_recipe(tmp_path / "other", fsdp / "step-4", {ROW: checkpoints_of(run, spec)[-2]}, output=str(out))
    failed = tailor("--verify", wrong)
    assert failed.returncode == 7 and f"FAIL  {ROW}" in failed.stdout, failed.stdout
    for world in (1, 3):
        state, stepped = load_in_fsdp2(out, fsdp, world, tmp_path, spec_file=fsdp / "spec.json")
        name = f"model.{ROW}.mlp.down_proj.weight"
        assert torch.equal(state["model"][name], theirs["fp32"][name].float())
        assert torch.equal(state["optim"]["state"][name]["exp_avg_sq"], theirs["exp_avg_sq"][name].float())
        assert stepped["finite"], world


def test_a_dcp_base_never_takes_nan_from_a_zero3_row_silently(real_run, fsdp_run, tmp_path):
    run, spec = real_run("ds_blown_up")
    fsdp, _ = fsdp_run("fsdp_llama_4")
    recipe = write_recipe(tmp_path, fsdp / "step-4", {"layers.2": checkpoints_of(run, spec)[-1]})
    assert_one_line_error(tailor("--apply", recipe), 8, "row layers.2 holds", "NaN/Inf", "--allow-nonfinite")
    assert not (tmp_path / "composed").exists()
    done = tailor("--apply", recipe, "--allow-nonfinite")
    assert done.returncode == 0, done.stderr
    assert bool(dcp_state(tmp_path / "composed")["model.model.layers.2.mlp.down_proj.weight"].isnan().any())


def test_the_hf_trainers_fsdp_checkpoint_takes_zero3_rows_into_both_its_folders(real_run, fsdp_run, tmp_path):
    """The HF Trainer's layout as the base: the row's weights go into `pytorch_model_fsdp_0/`, its moments into
    `optimizer_0/` (under `optimizer.` keys); Accelerate's own loaders load it and it trains; --verify proves it."""
    run, spec = real_run("ds_blown_up")
    hf, _ = fsdp_run("fsdp_llama_hf")
    zero = checkpoints_of(run, spec)[1]  # step 4: healthy
    recipe = write_recipe(tmp_path, hf / "checkpoint-4", {ROW: zero})  # (its own layers.1 blew up)
    done = tailor("--apply", recipe)
    assert done.returncode == 0, done.stderr
    out = tmp_path / "composed"
    for part in ("pytorch_model_fsdp_0", "optimizer_0"):
        assert sorted(p.name for p in (out / part).glob("__tailor_*")) == ["__tailor_1_0_0.distcp", "__tailor_1_1_0.distcp"]
    got, theirs = {**dcp_state(out / "pytorch_model_fsdp_0"), **dcp_state(out / "optimizer_0")}, read_full_state(zero)
    name = f"model.{ROW}.mlp.down_proj.weight"
    assert torch.equal(got[f"model.{name}"].reshape(-1), theirs["fp32"][name].float().reshape(-1))
    assert torch.equal(got[f"optimizer.state.{name}.exp_avg"].reshape(-1), theirs["exp_avg"][name].float().reshape(-1))
    assert tailor("--verify", recipe).returncode == 0
    state, stepped = load_in_fsdp2(out, hf, 2, tmp_path, spec_file=hf / "spec.json")
    assert torch.equal(state["optim"]["state"][name]["exp_avg_sq"], theirs["exp_avg_sq"][name].float())
    assert stepped["finite"]


def test_a_zero3_row_round_trips_through_a_dcp_export_bit_for_bit(real_run, tmp_path):
    """ZeRO-3 at 3 ranks → `--export --format dcp` (its chunks cut rows where the ranks' ranges do: the rest of a
    row, whole rows, the start of one) → a row of a ZeRO-3 composition of the same run, resharded to 2: the row is
    the original save's, bit for bit, every key; the run's tied embeddings' row too."""
    run, spec = real_run("hf_fp32_3_tied")
    older, newest = checkpoints_of(run, spec)[1], checkpoints_of(run, spec)[-1]
    exported = tailor("--export", older, "--to", tmp_path / "dcp", "--format", "dcp")
    assert exported.returncode == 0, exported.stderr
    recipe = write_recipe(tmp_path, newest, {ROW: tmp_path / "dcp", "embed_tokens": tmp_path / "dcp"})
    done = tailor("--apply", recipe, "--world-size", "2")
    assert done.returncode == 0, done.stderr
    got, before, base = read_full_state(tmp_path / "composed"), read_full_state(older), read_full_state(newest)
    assert got.keys() == base.keys()
    for key, by_name in got.items():
        assert by_name.keys() == base[key].keys()
        for name, tensor in by_name.items():
            taken = name.startswith((f"model.{ROW}.", "model.embed_tokens.")) or name == "lm_head.weight"  # (tied)
            want = before if taken else base
            assert torch.equal(tensor, want[key][name]), (key, name)
    assert tailor("--verify", recipe, "--world-size", "2").returncode == 0
