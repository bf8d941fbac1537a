"""Vision-language models end to end beyond plain composition, on real runs of the HF Trainer with
DeepSpeed ZeRO-3 (2 ranks, fp32, tiny configs): Llavas (a CLIP vision tower, the multimodal projector,
a Llama) and BEiT (a vision encoder).

- `--export` of a composition (rows from two checkpoints, in the vision tower and in the language model)
  is a folder that transformers' own `from_pretrained` loads (BEiT, Llava, LLaVA-NeXT, Qwen2-VL,
  Qwen2.5-VL, Mllama) with no missing, unexpected or mismatched key, every parameter of the loaded
  model the fp32 master of the checkpoint its row was picked from;
- a Llava whose whole vision tower is frozen (no optimizer state: its values live in model_states'
  fragments and in the model file): a vision row and a language row from another checkpoint compose
  bit-exact (fp32 masters and Adam moments where they exist, frozen values as picked), `--verify`
  passes, the model file loads as picked, and the Trainer resumes the output;
- a PEFT Llava whose LoRA adapts both stacks and the projector: each row's adapter tensors, masters and
  moments come from its pick, `--verify` passes, and PeftModel.from_pretrained loads the adapter;
- a vision block that blows up just before the last save (a trainable one: NaN masters, +Inf exp_avg_sq;
  a frozen one: NaN values): `--stats` flags that vision row alone, `--heal` takes it alone from the last
  good checkpoint and every other row from the newest, and `--apply` of that recipe is finite throughout.

Recipes name rows by their short names (`vision.layers.1`, `layers.0`: a multimodal model's rows come per
stack), a PEFT model's as the plain model's; each is checked to be the row of the module this test means
(`helpers.row_at`). Which checkpoint a parameter should come from is this test's own rule: the pick of the
module it lies in.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil

import pytest
import torch
import transformers
import yaml
from conftest import checkpoints_of
from helpers import assert_optim_states_equal, row_at, stats_json, tailor, write_recipe
from safetensors import safe_open
from zero_reader import read_full_state

from tailor_tui.checkpoints.checkpoint import open_checkpoint
from tailor_tui.checkpoints.rows import PEFT_PREFIX
from tailor_tui.runs.demo_run import resume_and_step
from tailor_tui.runs.models import base_model

VISION_BLOCK = "model.vision_tower.encoder.layers.1"
LANGUAGE_BLOCK = "model.language_model.layers.0"
PROJECTOR = "model.multi_modal_projector"
BLOWN = f"{VISION_BLOCK}.mlp.fc1.weight"  # the parameter the blown-up runs poison at their last save
# the row a recipe names for each module (BEiT's and Llava's)
ROWS = {VISION_BLOCK: "vision.layers.1", LANGUAGE_BLOCK: "layers.0", PROJECTOR: "multi_modal_projector",
        "lm_head": "lm_head", "beit.layers.1": "layers.1", "classifier": "classifier",
        "model.image_newline": "image_newline", "model.visual.blocks.0": "vision.blocks.0",
        "model.visual.blocks.1": "vision.blocks.1", "model.visual.merger": "vision.merger",
        "model.language_model.layers.1": "layers.1", "model.language_model.layers.2": "layers.2",
        "model.vision_model.transformer.layers.1": "vision.transformer.layers.1",
        "model.vision_model.global_transformer.layers.0": "vision.global_transformer.layers.0"}


def recipe_of(folder, base, picks: dict):
    """A recipe picking, for each module of `picks`, its row by its short name (checked to be that
    module's row in `base`) from the checkpoint given."""
    for module in picks:
        assert row_at(base, module).name == ROWS[module], module
    return write_recipe(folder, base, {ROWS[module]: source for module, source in picks.items()})


def source_of(name: str, picks: dict, base):
    """The checkpoint parameter (or adapter tensor) `name` comes from: the pick of the module it lies
    in, else the base (PEFT's prefix left aside)."""
    name = name.removeprefix(PEFT_PREFIX)
    for module, source in picks.items():
        if name == module or name.startswith(module + "."):  # a module's, or a parameter picked itself
            return source
    return base


def file_tensors(path) -> dict[str, torch.Tensor]:
    with safe_open(path, "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def assert_picks_observable(states: dict, picks: dict, old, base, key: str = "fp32") -> None:
    """Guards the comparisons: every picked module holds a value that differs between the checkpoints."""
    for module in picks:
        names = [n for n in states[base][key] if (bare := n.removeprefix(PEFT_PREFIX)) == module
                 or bare.startswith(module + ".")]
        assert names, module
        assert any(not torch.equal(states[old][key][n], states[base][key][n]) for n in names), module


# --- export ----------------------------------------------------------------------------------------

EXPORTS = {
    "hf_beit": ("BeitForImageClassification", ["beit.layers.1", "classifier"]),
    "hf_llava": ("LlavaForConditionalGeneration", [VISION_BLOCK, PROJECTOR, LANGUAGE_BLOCK, "lm_head"]),
    "hf_llava_next": ("LlavaNextForConditionalGeneration",
                      ["model.image_newline", VISION_BLOCK, PROJECTOR, LANGUAGE_BLOCK, "lm_head"]),
    "hf_qwen2_vl": ("Qwen2VLForConditionalGeneration",
                    ["model.visual.blocks.1", "model.visual.merger", "model.language_model.layers.1", "lm_head"]),
    "hf_qwen2_5_vl": ("Qwen2_5_VLForConditionalGeneration",
                      ["model.visual.blocks.0", "model.visual.merger", "model.language_model.layers.2", "lm_head"]),
    # both vision block lists, the cross-attention layer (layers.1) and the projector
    "hf_mllama": ("MllamaForConditionalGeneration",
                  ["model.vision_model.transformer.layers.1", "model.vision_model.global_transformer.layers.0",
                   "model.language_model.layers.1", PROJECTOR, "lm_head"]),
}


@pytest.mark.parametrize("name", list(EXPORTS))
def test_export_loads_with_from_pretrained_each_parameter_its_rows_pick(real_run, tmp_path, name):
    run, spec = real_run(name)
    old, base = checkpoints_of(run, spec)
    cls_name, modules = EXPORTS[name]
    picks = {module: old for module in modules}
    recipe = recipe_of(tmp_path, base, picks)
    done = tailor("--export", recipe, "--to", tmp_path / "model", "--dtype", "fp32")  # hf_beit trained in bf16
    assert done.returncode == 0, done.stderr
    model, info = getattr(transformers, cls_name).from_pretrained(tmp_path / "model", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    states = {c: read_full_state(c) for c in (old, base)}
    assert_picks_observable(states, picks, old, base)
    params = dict(model.named_parameters())
    assert params.keys() == states[base]["fp32"].keys()
    used = set()
    for param, value in params.items():
        source = source_of(param, picks, base)
        used.add(source)
        assert value.dtype == torch.float32 and torch.equal(value, states[source]["fp32"][param]), param
    assert used == {old, base}
    exported = file_tensors(tmp_path / "model" / "model.safetensors")  # what the folder holds: the model's own
    assert exported.keys() == model.state_dict().keys()


# --- a frozen vision tower ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def frozen_composed(real_run, tmp_path_factory):
    """hf_llava_frozen_vision composed: a (frozen) vision block and a language block from step 2, the rest
    from step 4 (whose vision block is NaN: the frozen values of the two checkpoints differ there)."""
    run, spec = real_run("hf_llava_frozen_vision")
    old, base = checkpoints_of(run, spec)
    tmp = tmp_path_factory.mktemp("frozen")
    picks = {VISION_BLOCK: old, LANGUAGE_BLOCK: old}
    recipe = recipe_of(tmp, base, picks)
    applied = tailor("--apply", recipe)
    assert applied.returncode == 0, applied.stderr
    return spec, old, base, picks, recipe, tmp / "composed"


def test_a_frozen_vision_tower_composes_bit_exact_and_verifies(frozen_composed):
    spec, old, base, picks, recipe, out = frozen_composed
    states = {c: read_full_state(c) for c in (old, base)}
    vision = [n for n in states[base]["fp32"] if n.startswith("model.vision_tower.")]
    assert vision and not any(n in states[base]["exp_avg"] for n in vision)  # frozen: no optimizer state
    assert torch.isnan(states[base]["fp32"][BLOWN]).all() and torch.isfinite(states[old]["fp32"][BLOWN]).all()
    assert_picks_observable(states, picks, old, base)
    got = read_full_state(out)
    for key in ("fp32", "exp_avg", "exp_avg_sq"):  # fp32 holds the frozen values (model_states' fragments)
        assert got[key].keys() == states[base][key].keys(), key
        for name, value in got[key].items():
            assert torch.equal(value, states[source_of(name, picks, base)][key][name]), (key, name)
    verified = tailor("--verify", recipe)
    assert verified.returncode == 0, verified.stdout + verified.stderr


def test_a_frozen_vision_towers_model_file_loads_as_picked(frozen_composed):
    """The composed model file (transformers 5's saved names) loads with from_pretrained, every
    parameter, frozen or not, its pick's."""
    spec, old, base, picks, recipe, out = frozen_composed
    model, info = transformers.LlavaForConditionalGeneration.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    states = {c: read_full_state(c)["fp32"] for c in (old, base)}
    for name, value in model.named_parameters():
        assert torch.equal(value, states[source_of(name, picks, base)][name]), name
    assert torch.isfinite(model.get_parameter(BLOWN)).all()


def test_a_frozen_vision_tower_output_resumes_in_the_trainer(frozen_composed, tmp_path):
    spec, old, base, picks, recipe, out = frozen_composed
    losses = resume_and_step(out, spec, tmp_path / "resume")
    assert losses and all(math.isfinite(x) for x in losses)
    resaved = tmp_path / "resume" / "resaved"
    assert_optim_states_equal(out, resaved)
    got, loaded = read_full_state(out)["fp32"], read_full_state(resaved)["fp32"]  # frozen values as loaded
    assert got.keys() == loaded.keys() and all(torch.equal(got[n], loaded[n]) for n in got)


def test_a_frozen_vision_tower_is_repartitioned_for_another_world_size(frozen_composed, tmp_path):
    """--world-size 3 re-partitions every source, the frozen fragments in model_states among them: the
    output verifies, holds every value of its pick, and the Trainer resumes it on 3 ranks."""
    spec, old, base, picks, recipe, out = frozen_composed
    resharded = tmp_path / "three"
    applied = tailor("--apply", recipe, "--world-size", "3", "--output", resharded)
    assert applied.returncode == 0, applied.stderr
    verified = tailor("--verify", recipe, "--world-size", "3", "--output", resharded)
    assert verified.returncode == 0, verified.stdout + verified.stderr
    got, want = read_full_state(resharded), read_full_state(out)
    for key in ("fp32", "exp_avg", "exp_avg_sq"):
        assert got[key].keys() == want[key].keys() and all(torch.equal(got[key][n], want[key][n]) for n in want[key])
    three = dataclasses.replace(spec, world_size=3)
    losses = resume_and_step(resharded, three, tmp_path / "resume")
    assert losses and all(math.isfinite(x) for x in losses)
    loaded = read_full_state(tmp_path / "resume" / "resaved")["fp32"]
    assert all(torch.equal(loaded[n], got["fp32"][n]) for n in got["fp32"])


def test_a_frozen_vision_tower_exports_as_picked(frozen_composed, tmp_path):
    """Frozen rows are exported from model_states' fragments of their pick (they have no fp32 master)."""
    spec, old, base, picks, recipe, out = frozen_composed
    done = tailor("--export", recipe, "--to", tmp_path / "model")
    assert done.returncode == 0, done.stderr
    model, info = transformers.LlavaForConditionalGeneration.from_pretrained(tmp_path / "model",
                                                                            output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    states = {c: read_full_state(c)["fp32"] for c in (old, base)}
    params = dict(model.named_parameters())
    assert params.keys() == states[base].keys()
    for name, value in params.items():
        assert torch.equal(value, states[source_of(name, picks, base)][name]), name


# --- a LoRA adapter on both stacks ---------------------------------------------------------------------


def test_a_lora_on_both_stacks_composes_per_row_and_loads_as_an_adapter(real_run, tmp_path):
    from peft import PeftModel

    run, spec = real_run("hf_llava_lora")
    old, base = checkpoints_of(run, spec)
    modules = (VISION_BLOCK, PROJECTOR, LANGUAGE_BLOCK)
    picks = {module: old for module in modules}
    recipe = recipe_of(tmp_path, base, picks)
    applied = tailor("--apply", recipe)
    assert applied.returncode == 0, applied.stderr
    verified = tailor("--verify", recipe)
    assert verified.returncode == 0, verified.stdout + verified.stderr
    out = tmp_path / "composed"

    states = {c: read_full_state(c) for c in (old, base)}
    assert_picks_observable(states, picks, old, base)
    got = read_full_state(out)
    for key in ("fp32", "exp_avg", "exp_avg_sq"):
        assert got[key].keys() == states[base][key].keys(), key
        for name, value in got[key].items():
            assert torch.equal(value, states[source_of(name, picks, base)][key][name]), (key, name)

    adapter = "adapter_model.safetensors"
    mine, theirs = file_tensors(out / adapter), {c: file_tensors(c / adapter) for c in (old, base)}
    assert list(mine) == list(theirs[base])
    for stack in ("vision_tower", "multi_modal_projector", "language_model"):  # LoRA in both stacks and between
        assert any(f".{stack}." in n and "lora_A" in n for n in mine), stack
    used = set()
    for name, value in mine.items():
        source = source_of(name, picks, base)
        used.add(source)
        assert value.dtype == theirs[source][name].dtype and torch.equal(value, theirs[source][name]), name
    assert used == {old, base}

    model = PeftModel.from_pretrained(base_model(spec), str(out))
    loaded = {k.replace(".default.", "."): v for k, v in model.state_dict().items() if "lora_" in k}
    lora = {n: v for n, v in mine.items() if "lora_" in n}
    assert loaded.keys() == lora.keys()
    assert all(torch.equal(loaded[n], lora[n]) for n in lora)

    losses = resume_and_step(out, spec, tmp_path / "resume")  # the Trainer resumes the adapter's run
    assert losses and all(math.isfinite(x) for x in losses)
    assert_optim_states_equal(out, tmp_path / "resume" / "resaved")


# --- a selective save ------------------------------------------------------------------------------------


def test_a_selectively_saved_llava_composes_newest_per_row_and_loads(real_run, tmp_path):
    """A partial save (the HF callback) holds no model file: the output's is made from each row's fp32
    master slices, named as transformers 5 saves a Llava (`language_model.model.layers.N`, not the
    parameter's `model.language_model.layers.N`). Rows the partial save holds come from it, the others
    from the full checkpoint; from_pretrained loads the output's model file, every parameter the one the
    run's own full reference save of that step holds."""
    run, spec = real_run("hf_llava_selective")
    full, partial = run / "run" / "checkpoint-2", run / "run" / "partial-step4"
    saved = set(json.loads((partial / "tailor_partial.json").read_text())["rows"])
    rows = open_checkpoint(full).rows
    assert saved and {r.name for r in rows} > saved
    recipe = write_recipe(tmp_path, partial, {r.name: full for r in rows if r.name not in saved})
    applied = tailor("--apply", recipe)
    assert applied.returncode == 0, applied.stderr
    verified = tailor("--verify", recipe)
    assert verified.returncode == 0, verified.stdout + verified.stderr
    reference = {step: read_full_state(run / "reference" / f"checkpoint-{step}")["fp32"] for step in (2, 4)}
    step_of = {r.module_path: 4 if r.name in saved else 2 for r in rows}
    model, info = transformers.LlavaForConditionalGeneration.from_pretrained(tmp_path / "composed",
                                                                            output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    params = dict(model.named_parameters())
    assert params.keys() == reference[4].keys()
    for name, value in params.items():
        assert torch.equal(value, reference[source_of(name, step_of, 4)][name]), name


def test_a_partial_save_recording_the_row_names_of_an_earlier_tailor_tui_holds_its_rows(real_run, tmp_path):
    """A partial save of a tailor-tui from before a multimodal model's rows came per stack recorded its rows
    by the names given then (`vision_tower.encoder.layers.1`, `language_model.layers.0`): they are its rows
    still, so --heal takes them from it (newer) and only the others from the full checkpoint."""
    run, spec = real_run("hf_llava_selective")
    copy = tmp_path / "run"
    shutil.copytree(run / "run", copy)
    manifest = copy / "partial-step4" / "tailor_partial.json"
    record = json.loads(manifest.read_text())
    rows = open_checkpoint(copy / "checkpoint-2").rows
    saved = set(record["rows"])
    before = {r.name: r.module_path.removeprefix("model.") for r in rows}  # the names rows had then
    assert {before[r] for r in saved} != saved  # (some names did change)
    record["rows"] = [before[r] for r in record["rows"]]
    manifest.write_text(json.dumps(record, indent=2))
    assert open_checkpoint(copy / "partial-step4").saved_rows == saved
    recipe = tmp_path / "healed.yaml"
    healed = tailor("--heal", copy, "--recipe", recipe)
    assert healed.returncode == 0, healed.stderr
    written = yaml.safe_load(recipe.read_text())
    assert (recipe.parent / written["base"]).resolve() == (copy / "partial-step4").resolve()
    assert set(written["layers"]) == {r.name for r in rows} - saved


# --- healing a vision row ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["hf_llava_vision_blown_up", "hf_llava_frozen_vision"])
def test_heal_takes_the_blown_vision_row_alone_from_the_last_good_checkpoint(real_run, tmp_path, name):
    run, spec = real_run(name)
    old, base = checkpoints_of(run, spec)
    blown = ROWS[VISION_BLOCK]
    assert row_at(base, VISION_BLOCK).name == blown
    doc = stats_json(run)
    flagged = {(c["row"], c["checkpoint"]) for c in doc["cells"] if c["nonfinite"]}
    assert flagged == {(blown, str(base))}
    assert {c["row"] for c in doc["cells"]} > {blown, ROWS[LANGUAGE_BLOCK]}

    recipe = tmp_path / "healed.yaml"
    healed = tailor("--heal", run, "--recipe", recipe)
    assert healed.returncode == 0, healed.stderr
    assert blown in healed.stdout
    written = yaml.safe_load(recipe.read_text())
    assert (recipe.parent / written["base"]).resolve() == base.resolve()
    assert {row: (recipe.parent / p).resolve() for row, p in written["layers"].items()} == {blown: old.resolve()}

    applied = tailor("--apply", recipe, "--output", tmp_path / "healed")
    assert applied.returncode == 0, applied.stderr
    out = tmp_path / "healed"
    got = read_full_state(out)
    states = {c: read_full_state(c) for c in (old, base)}
    picks = {VISION_BLOCK: old}
    for key in ("fp32", "exp_avg", "exp_avg_sq"):
        for param, value in got[key].items():
            assert torch.isfinite(value).all(), (key, param)
            assert torch.equal(value, states[source_of(param, picks, base)][key][param]), (key, param)
    for param, value in file_tensors(out / "model.safetensors").items():
        assert torch.isfinite(value).all(), param
    provenance = json.loads((out / "tailor_provenance.json").read_text())
    assert blown in json.dumps(provenance)
    verified = tailor("--verify", recipe, "--output", out)
    assert verified.returncode == 0, verified.stdout + verified.stderr
