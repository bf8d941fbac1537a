"""`--export X --to DIR` where X (a checkpoint, or a recipe) is of PyTorch Distributed Checkpoints: the plain HF
model folder `from_pretrained` loads, every tensor its source's as torch's `dcp.load` gives it (cast as torch
casts), in save_pretrained's shards; NaN refused; chunks of a save at any world size put together."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import assert_one_line_error, tailor, write_recipe
from run_models import model_config
from safetensors.torch import load_file


def loaded(folder) -> dict[str, torch.Tensor]:
    entries = dcp.FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    state = {k: torch.zeros(v.size, dtype=v.properties.dtype) for k, v in entries.items()
             if hasattr(v, "size") and k.startswith("model.")}
    dcp.load(state, checkpoint_id=folder, no_dist=True)
    return {k.removeprefix("model."): v for k, v in state.items()}


def exported(folder) -> dict[str, torch.Tensor]:
    found = {}
    for f in sorted(folder.glob("*.safetensors")):
        found |= load_file(f)
    return found


@pytest.mark.parametrize(("dtype", "shard"), [(None, "5GB"), ("bf16", "20KB")])
def test_a_healed_fsdp2_run_exports_as_an_hf_model(fsdp_run, tmp_path, dtype, shard):
    import transformers

    run, spec = fsdp_run("fsdp_llama")
    model_config(spec).save_pretrained(tmp_path / "config")
    recipe = write_recipe(tmp_path, run / "step-6", {"layers.1": run / "step-4"})
    done = tailor("--export", recipe, "--to", tmp_path / "hf", "--config", tmp_path / "config",
                  "--max-shard-size", shard, *(["--dtype", dtype] if dtype else []))
    assert done.returncode == 0, done.stderr
    got, six, four = exported(tmp_path / "hf"), loaded(run / "step-6"), loaded(run / "step-4")
    want = {k: (four if ".layers.1." in k else six)[k] for k in six if k != "lm_head.weight" or not spec.tied}
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        expected = tensor.to(torch.bfloat16) if dtype else tensor
        assert got[name].dtype == expected.dtype and torch.equal(got[name], expected), name
    assert (len(list((tmp_path / "hf").glob("*.safetensors"))) > 1) == (shard == "20KB")
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert torch.equal(model.model.layers[1].mlp.down_proj.weight.detach(), want["model.layers.1.mlp.down_proj.weight"]
                       .to(model.dtype))


def test_a_dcp_export_refuses_nan_and_what_does_not_go_with_it(fsdp_run, tmp_path):
    run, _spec = fsdp_run("fsdp_llama")
    assert_one_line_error(tailor("--export", run / "step-6", "--to", tmp_path / "hf"), 8,
                          "model.model.layers.1.mlp.down_proj.weight holds 768 NaN/Inf values")
    assert not (tmp_path / "hf").exists()
    assert_one_line_error(tailor("--export", run / "step-4", "--to", tmp_path / "d", "--format", "dcp"), 2,
                          "is a PyTorch Distributed Checkpoint already")
    plain = tailor("--export", run / "step-4", "--to", tmp_path / "hf")
    assert plain.returncode == 0 and "holds the weights but no config.json" in plain.stderr
