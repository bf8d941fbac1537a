"""`--export`: a composition as a plain HF model folder, for evaluation before resuming.

On real runs, every exported tensor equals DeepSpeed's own zero_to_fp32 of the checkpoint its
row is taken from (bit for bit in fp32; in bf16/fp16 torch's own cast of it), the folder loads
with `AutoModelForCausalLM.from_pretrained` with no missing or unexpected keys, a tied lm_head
stays tied, and the logits equal those of the model loaded from zero_to_fp32's weights.
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import RUNS, checkpoints_of
from helpers import assert_one_line_error, flip_byte, hidden, tailor, write_recipe
from pilot_helpers import private_copy
from run_models import model_config
from safetensors import safe_open
from zero_reader import read_full_state

from tailor_tui.checkpoints.checkpoint import open_checkpoint
from tailor_tui.kinds.zero import tensor_bytes

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def expected_weights(picks: dict, base, rows_of) -> dict[str, torch.Tensor]:
    """Each parameter's fp32 weights from zero_to_fp32 of its row's chosen checkpoint."""
    states = {}
    want = {}
    for name, row in rows_of.items():
        source = picks.get(row, base)
        if source not in states:
            states[source] = read_full_state(source)["fp32"]
        want[name] = states[source][name]
    return want


def exported(folder) -> dict[str, torch.Tensor]:
    index = folder / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() \
        else ["model.safetensors"]
    tensors = {}
    for name in files:
        with safe_open(folder / name, framework="pt") as f:
            tensors |= {key: f.get_tensor(key) for key in f.keys()}
    return tensors


def _rows_of(ckpt_path) -> dict[str, str]:
    ckpt = open_checkpoint(ckpt_path)
    return {p: row.name for row in ckpt.rows for p in row.params}


def _logits(model) -> torch.Tensor:
    ids = torch.arange(12).reshape(2, 6) % model.config.vocab_size
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_tied_fp32_hf_export_equals_zero_to_fp32_and_loads(real_run, tmp_path):
    from transformers import AutoModelForCausalLM

    run, spec = real_run("hf_fp32_3_tied")  # tied embeddings, a frozen parameter, 3 ranks
    c2, c4, c6 = checkpoints_of(run, spec)
    picks = {"layers.1": c2, "layers.2": c4, "embed_tokens": c4}  # layers.2 holds the frozen parameter
    recipe = write_recipe(tmp_path, c6, picks)
    done = tailor("--export", recipe, "--to", tmp_path / "model")
    assert done.returncode == 0, done.stderr
    out = tmp_path / "model"
    got, want = exported(out), expected_weights(picks, c6, _rows_of(c6))
    assert sorted(got) == sorted(want) and "lm_head.weight" not in got  # tied: stored once
    for name, tensor in want.items():
        assert got[name].dtype == torch.float32 and torch.equal(got[name], tensor), name
    assert json.loads((out / "config.json").read_text())["dtype"] == "float32"
    assert (out / "generation_config.json").is_file() and (out / "tailor_provenance.json").is_file()
    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    reference = AutoModelForCausalLM.from_config(model.config)
    reference.load_state_dict(want, strict=False)
    reference.tie_weights()
    assert torch.equal(_logits(model), _logits(reference))


@pytest.mark.parametrize("dtype", [None, "fp32", "fp16"])
def test_bf16_export_casts_as_torch_and_shards(real_run, tmp_path, dtype):
    from transformers import AutoModelForCausalLM

    run, spec = real_run("hf_bf16_2")
    c2, c4, c6 = checkpoints_of(run, spec)
    picks = {"layers.0": c2, "lm_head": c4}
    recipe = write_recipe(tmp_path, c6, picks)
    out = tmp_path / "model"
    args = ["--export", recipe, "--to", out, "--max-shard-size", "20KB"] + (["--dtype", dtype] if dtype else [])
    done = tailor(*args)
    assert done.returncode == 0, done.stderr
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = set(index["weight_map"].values())
    assert len(files) > 2 and all(_tensor_bytes(out / f) <= 20_000 or _single(out / f) for f in files)
    target = DTYPES[dtype or "bf16"]
    got, want = exported(out), expected_weights(picks, c6, _rows_of(c6))
    assert sorted(got) == sorted(want) and index["metadata"]["total_size"] == sum(
        t.numel() * t.element_size() for t in got.values())
    for name, tensor in want.items():
        assert got[name].dtype == target and torch.equal(got[name], tensor.to(target)), name
    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert model.dtype == target


def _tensor_bytes(path) -> int:
    """The bytes of a shard's tensors (what max_shard_size bounds, as in save_pretrained)."""
    with safe_open(path, framework="pt") as f:
        return sum(_numel(f, k) for k in f.keys())


def _numel(f, key) -> int:
    tensor = f.get_tensor(key)
    return tensor.numel() * tensor.element_size()


def _single(path) -> bool:
    """A shard over the limit holds one tensor larger than the limit (as save_pretrained)."""
    with safe_open(path, framework="pt") as f:
        return len(list(f.keys())) == 1


def test_deepspeed_layout_export_takes_its_config(real_run, tmp_path):
    from transformers import AutoModelForCausalLM

    run, spec = real_run("ds_bf16_3_subgroups")  # sub-groups, a frozen parameter
    c2, _c4, c6 = checkpoints_of(run, spec)
    recipe = write_recipe(tmp_path, c6, {"layers.3": c2})
    bare = tailor("--export", recipe, "--to", tmp_path / "weights")
    assert bare.returncode == 0, bare.stderr
    assert "no config.json" in bare.stderr and "--config PATH" in bare.stderr
    assert not (tmp_path / "weights" / "config.json").exists()
    model_config(RUNS["ds_bf16_3_subgroups"]).save_pretrained(tmp_path / "cfg")
    done = tailor("--export", recipe, "--to", tmp_path / "model", "--config", tmp_path / "cfg")
    assert done.returncode == 0, done.stderr
    model, info = AutoModelForCausalLM.from_pretrained(tmp_path / "model", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    want = expected_weights({"layers.3": c2}, c6, _rows_of(c6))
    got = exported(tmp_path / "model")
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor.to(torch.bfloat16)), name


def test_export_errors_are_one_line_and_write_nothing(real_run, tmp_path):
    _run, (c2, _c4, c6) = private_copy(real_run, tmp_path, "hf_bf16_2")
    recipe = write_recipe(tmp_path, c6, {"layers.1": c2})
    assert_one_line_error(tailor("--export", recipe), 2, "--export needs --to DIR")
    assert_one_line_error(tailor("--export", recipe, "--to", tmp_path / "m", "--max-shard-size", "lots"), 2,
                          "--max-shard-size 'lots'")
    assert_one_line_error(tailor("--export", recipe, "--to", tmp_path / "m", "--config", tmp_path / "none"), 2,
                          "no config.json there")
    target = next(c2.rglob("*rank_1_*optim_states.pt"))
    sizes = tuple(open_checkpoint(c2).layout.group_sizes())
    fp32 = tensor_bytes(target, sizes)[0, "fp32"].record.name  # the master weights an export reads
    record = flip_byte(target, fp32, where=0.5)
    assert_one_line_error(tailor("--export", recipe, "--to", tmp_path / "m"), 4, f"record {record} fails its CRC-32")
    assert not (tmp_path / "m").exists() and not [p for p in hidden(tmp_path) if "tailor" in p.name]
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("mine")
    assert_one_line_error(tailor("--export", write_recipe(tmp_path, c6, {}), "--to", tmp_path / "taken"), 6)
    assert (tmp_path / "taken" / "notes.txt").read_text() == "mine"


def test_partial_checkpoints_export_their_saved_rows(real_run, tmp_path):
    """A base that is a partial save and rows from another partial save (selective saving, a
    frozen parameter, sub-groups): each tensor equals the full reference save of its row's step."""
    from tailor_tui.checkpoints.scan import scan

    run, _spec = real_run("ds_selective_parity")
    runs, ref = run / "run", run / "reference"
    p4, p6 = (c for c in scan(runs).checkpoints if c.saved.kind == "partial")
    rows = {row: runs / "partial-step4" for row in p4.saved.rows if not p6.holds(row)}
    recipe = write_recipe(tmp_path, runs / "partial-step6", rows)
    done = tailor("--export", recipe, "--to", tmp_path / "model", "--dtype", "fp32")
    assert done.returncode == 0, done.stderr
    got = exported(tmp_path / "model")
    steps = {name: "global_step6" if p6.holds(row) else "global_step4" if row in rows else "global_step2"
             for name, row in _rows_of(runs / "partial-step6").items()}
    assert set(steps.values()) >= {"global_step4", "global_step6"}
    references = {step: read_full_state(ref / step)["fp32"] for step in set(steps.values())}
    for name, step in steps.items():
        assert torch.equal(got[name], references[step][name]), (name, step)


def test_persistent_buffers_are_exported_as_save_pretrained_writes_them(real_run, tmp_path):
    """A model with a persistent buffer: the export holds exactly the tensors the Trainer's own
    save_pretrained wrote (the buffer as stored, fp32 beside bf16 weights), and the model that
    registers it loads the export strictly."""
    from run_models import build_model

    run, spec = real_run("hf_buffer")
    c2, _c4, c6 = checkpoints_of(run, spec)
    picks = {"norm": c2, "layers.1": c2}
    recipe = write_recipe(tmp_path, c6, picks)
    done = tailor("--export", recipe, "--to", tmp_path / "model")
    assert done.returncode == 0, done.stderr
    got = exported(tmp_path / "model")
    with safe_open(c2 / "model.safetensors", framework="pt") as f:
        saved = {key: f.get_tensor(key) for key in f.keys()}
    assert sorted(got) == sorted(saved) and "model.norm.tailor_scale" in got
    assert {k: t.dtype for k, t in got.items()} == {k: t.dtype for k, t in saved.items()}
    assert torch.equal(got["model.norm.tailor_scale"], saved["model.norm.tailor_scale"])
    want = expected_weights(picks, c6, _rows_of(c6))
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor.to(torch.bfloat16)), name
    model = build_model(spec)
    model.load_state_dict(got, strict=True)
    assert torch.equal(model.model.norm.tailor_scale, saved["model.norm.tailor_scale"])


# --- sharding: huggingface_hub's rule (what save_pretrained shards by) ---------------------------------

def _state_dicts() -> dict[str, dict[str, torch.Tensor]]:
    """Real state dicts, in their own order (not their names'): a tiny Llama (with an
    embedding larger than most limits below), a Sequential of mixed dtypes (fp32, bf16, fp16, an
    int64 scalar buffer: BatchNorm's num_batches_tracked) and one with a tensor larger than
    every other put together."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False))
    mixed = torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.BatchNorm1d(10), torch.nn.Linear(10, 4),
                                torch.nn.LayerNorm(4), torch.nn.Embedding(7, 4))
    mixed[2].to(torch.bfloat16)
    mixed[4].to(torch.float16)
    big = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Embedding(200, 8), torch.nn.Linear(5, 2),
                              torch.nn.Linear(2, 2))
    return {"llama": llama.state_dict(), "mixed": mixed.state_dict(), "big": big.state_dict()}


def _limits(state: dict[str, torch.Tensor]) -> list[int]:
    """Max shard sizes that split a state dict at every point: each tensor's size and each running
    total, one byte either side of it, one byte, and room for everything."""
    sizes = [t.numel() * t.element_size() for t in state.values()]
    totals = [sum(sizes[:i + 1]) for i in range(len(sizes))]
    return sorted({max(1, n + d) for n in (*sizes, *totals) for d in (-1, 0, 1)} | {1, 5 * 10**9})


@pytest.mark.parametrize("which", ["llama", "mixed", "big"])
def test_lay_out_shards_as_huggingface_hub_does(which):
    """The same state dict, given in its own order, at every split point: the same files (names
    and order), each holding the same tensors, the same weight_map and total_size as
    huggingface_hub's split_torch_state_dict_into_shards (its rule for tensors sharing storage
    does not arise: an export's tensors share none)."""
    from huggingface_hub import split_torch_state_dict_into_shards

    from tailor_tui.formats.dtypes import SAFETENSORS_NAME
    from tailor_tui.formats.safetensors_out import lay_out

    state = _state_dicts()[which]
    tensors = [(name, tuple(t.shape), SAFETENSORS_NAME[str(t.dtype).removeprefix("torch.")])
               for name, t in state.items()]
    assert [name for name, *_ in tensors] != sorted(state)  # their order, not their names'
    seen = set()
    for limit in _limits(state):
        hub = split_torch_state_dict_into_shards(state, max_shard_size=limit)
        files, placed, index = lay_out(tensors, limit)
        assert [f.name for f in files] == list(hub.filename_to_tensors), limit
        assert {f.name: [n for n in state if placed[n].file == f.name] for f in files} == hub.filename_to_tensors
        if hub.is_sharded:
            assert index == {"metadata": hub.metadata, "weight_map": hub.tensor_to_filename}, limit
        else:
            assert index is None and hub.metadata["total_size"] == sum(p.nbytes for p in placed.values())
        for f in files:  # each file's tensors fill it, after its header
            ends = [placed[n].offset + placed[n].nbytes for n in placed if placed[n].file == f.name]
            assert f.size == max(ends, default=len(f.header)), (limit, f.name)
        seen.add(len(files))
    assert len(seen) > 3  # the limits split it in many ways


@pytest.mark.parametrize("run_name,limit", [("hf_bf16_2", 5000), ("hf_buffer", 3000), ("hf_fp32_3_tied", 10_000)])
def test_export_shards_as_save_pretrained(real_run, tmp_path, run_name, limit):
    """The export's files, weight_map and total_size are those of the model's own save_pretrained
    at the same max_shard_size, for the model holding the exported tensors (a persistent buffer,
    tied embeddings and a frozen parameter among them): the export takes the tensors in the
    state dict's order, as the base's model_states records it."""
    from run_models import build_model

    run, spec = real_run(run_name)
    c2, _c4, c6 = checkpoints_of(run, spec)
    recipe = write_recipe(tmp_path, c6, {"layers.1": c2})
    out = tmp_path / "model"
    done = tailor("--export", recipe, "--to", out, "--max-shard-size", str(limit))
    assert done.returncode == 0, done.stderr
    got = exported(out)
    model = build_model(spec)
    missing, unexpected = model.load_state_dict(got, strict=False, assign=True)  # keeps each tensor's dtype
    assert not unexpected and set(missing) <= {"lm_head.weight"} and bool(missing) == spec.tied
    model.tie_weights()
    model.save_pretrained(tmp_path / "reference", max_shard_size=limit)
    ours = json.loads((out / "model.safetensors.index.json").read_text())
    theirs = json.loads((tmp_path / "reference" / "model.safetensors.index.json").read_text())
    assert len(set(ours["weight_map"].values())) > 2
    assert ours["weight_map"] == theirs["weight_map"]
    assert ours["metadata"]["total_size"] == theirs["metadata"]["total_size"]
    assert sorted(p.name for p in out.glob("model*.safetensors")) == sorted(
        p.name for p in (tmp_path / "reference").glob("model*.safetensors"))
