"""Vision-language models end to end beyond plain composition, on real runs of the HF Trainer with
DeepSpeed ZeRO-3 (2 ranks, tiny configs): Llavas (a CLIP vision tower, the multimodal projector, a Llama),
LLaVA-NeXT, Qwen2-VL, Qwen2.5-VL, Mllama and BEiT (a vision encoder).

- `--export` of a composition (rows from two checkpoints, in the vision tower and in the language model)
  is a folder that transformers' own `from_pretrained` loads (BEiT, Llava, LLaVA-NeXT, Qwen2-VL,
  Qwen2.5-VL, Mllama) with no missing, unexpected or mismatched key, every parameter of the loaded
  model the fp32 master of the checkpoint its row was picked from;
- one set of tests over the runs of VARIANTS, each composed once: a Llava, a LLaVA-NeXT, a Qwen2-VL, a
  Qwen2.5-VL and an Mllama whose whole vision tower is frozen (no optimizer state: its values live in
  model_states' fragments and in the model file), a PEFT LoRA of each adapting both stacks and the
  projector, and a Llava saved as pytorch_model.bin. Rows of the vision tower, the projector and the
  language model (and LLaVA-NeXT's image_newline) from another checkpoint compose bit-exact on every rank
  (fp32 masters and Adam moments where they exist, frozen values as picked), `--verify` passes, the model
  file (a LoRA's adapter) holds each tensor of its pick and loads with from_pretrained
  (PeftModel.from_pretrained), a whole model exports, and the Trainer resumes the output; the frozen Llava
  is also re-partitioned for 3 ranks;
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
from helpers import (
    ComposedCase,
    assert_optim_states_equal,
    row_at,
    stats_json,
    tailor,
    tensors,
    weight_files,
    write_recipe,
)
from run_models import base_model
from runs import resume_and_step
from zero_reader import read_full_state

from tailor_tui.checkpoints.checkpoint import open_checkpoint
from tailor_tui.checkpoints.rows import PEFT_PREFIX

VISION_BLOCK = "model.vision_tower.encoder.layers.1"
LANGUAGE_BLOCK = "model.language_model.layers.0"
PROJECTOR = "model.multi_modal_projector"
# the row a recipe names for each module (of each model here)
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
    exported = tensors(tmp_path / "model" / "model.safetensors")  # what the folder holds: the model's own
    assert exported.keys() == model.state_dict().keys()


# --- a frozen vision tower, a LoRA adapter, a .bin model file -----------------------------------------

# Runs beyond plain composition, each with the modules its recipe picks from the older checkpoint (the
# rest from the newest). A whole vision tower frozen (RunSpec.frozen): no optimizer state, its values in
# model_states' fragments and in the model file; one of its blocks turned NaN just before the last save
# (RunSpec.blow_up), the only frozen values the two checkpoints differ in: that block and a language layer
# are picked. A PEFT LoRA adapting both stacks and the projector (models.LORA_VISION): a block of each stack
# and the projector are picked. A Llava saved as transformers 4.x did (pytorch_model.bin, legacy names).
FROZEN = {"hf_llava_frozen_vision": (VISION_BLOCK, LANGUAGE_BLOCK),
          "hf_llava_next_frozen_vision": (VISION_BLOCK, "model.image_newline", LANGUAGE_BLOCK),
          "hf_qwen2_vl_frozen_vision": ("model.visual.blocks.1", "model.language_model.layers.1"),
          "hf_qwen2_5_vl_frozen_vision": ("model.visual.blocks.1", "model.language_model.layers.1"),
          "hf_mllama_frozen_vision": ("model.vision_model.transformer.layers.1", "model.language_model.layers.1")}
LORA = {"hf_llava_lora": (VISION_BLOCK, PROJECTOR, LANGUAGE_BLOCK),
        "hf_llava_next_lora": (VISION_BLOCK, PROJECTOR, LANGUAGE_BLOCK),
        "hf_qwen2_vl_lora": ("model.visual.blocks.1", "model.visual.merger", "model.language_model.layers.1"),
        "hf_qwen2_5_vl_lora": ("model.visual.blocks.1", "model.visual.merger", "model.language_model.layers.1"),
        "hf_mllama_lora": ("model.vision_model.transformer.layers.1", "model.vision_model.global_transformer.layers.0",
                           PROJECTOR, "model.language_model.layers.1")}
VARIANTS = {**FROZEN, **LORA, "hf_llava_bin": (VISION_BLOCK, PROJECTOR, LANGUAGE_BLOCK, "lm_head")}
WHOLE = [name for name in VARIANTS if name not in LORA]  # a whole model's file: loaded by its class, exported


@pytest.fixture(scope="module")
def compositions(real_run, tmp_path_factory):
    """compositions(name) -> the run of VARIANTS that `name` names, composed on first use (once, whatever
    order the tests come in): its modules from step 2, the rest from step 4 (`picks`: module -> checkpoint)."""
    made: dict[str, ComposedCase] = {}

    def get(name: str) -> ComposedCase:
        if name not in made:
            run, spec = real_run(name)
            old, base = checkpoints_of(run, spec)
            tmp = tmp_path_factory.mktemp(name)
            picks = {module: old for module in VARIANTS[name]}
            recipe = recipe_of(tmp, base, picks)
            applied = tailor("--apply", recipe)
            assert applied.returncode == 0, applied.stderr
            made[name] = ComposedCase(spec, [old, base], tmp / "composed", run=run, picks=picks, recipe=recipe,
                                      name=name)
        return made[name]

    return get


@pytest.fixture
def variant(request, compositions) -> ComposedCase:
    return compositions(request.param)


def each(names):
    """The test, for each run `names` lists (`variant`: its composition)."""
    return pytest.mark.parametrize("variant", list(names), indirect=True)


@each(VARIANTS)
def test_composes_bit_exact_per_row_and_verifies(variant):
    """Every parameter's fp32 master (a frozen one's values: model_states' fragments), exp_avg and
    exp_avg_sq is its pick's, and `--verify` passes."""
    spec, (old, base), picks = variant.spec, variant.ckpts, variant.picks
    states = {c: read_full_state(c) for c in (old, base)}
    for tower in spec.frozen:  # frozen: no optimizer state
        frozen = [n for n in states[base]["fp32"] if n.startswith(tower + ".")]
        assert frozen and not any(n in states[base]["exp_avg"] for n in frozen), tower
    for blown in spec.blow_up:
        assert torch.isnan(states[base]["fp32"][blown]).all() and torch.isfinite(states[old]["fp32"][blown]).all()
    assert_picks_observable(states, picks, old, base)
    got = read_full_state(variant.out)
    used = set()
    for key in ("fp32", "exp_avg", "exp_avg_sq"):
        assert got[key].keys() == states[base][key].keys(), key
        for name, value in got[key].items():
            source = source_of(name, picks, base)
            used.add(source)
            assert torch.equal(value, states[source][key][name]), (key, name)
    assert used == {old, base}
    verified = tailor("--verify", variant.recipe)
    assert verified.returncode == 0, verified.stdout + verified.stderr


@each(WHOLE)
def test_a_whole_models_file_loads_each_parameter_as_picked(variant):
    """The composed model file (model.safetensors or pytorch_model.bin, under transformers' saved names)
    holds the base's tensors (names, dtypes, shapes); from_pretrained loads it with no missing or
    unexpected key, every parameter, frozen or not, as its pick's own file loads and its pick's fp32
    master."""
    spec, (old, base), picks, out = variant.spec, variant.ckpts, variant.picks, variant.out
    files = weight_files(base)
    assert files and weight_files(out) == files
    for file in files:
        mine, theirs = tensors(out / file), tensors(base / file)
        assert [(n, v.dtype, v.shape) for n, v in mine.items()] == [(n, v.dtype, v.shape) for n, v in theirs.items()]
    cls = type(base_model(spec))
    model, info = cls.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    loaded = {c: dict(cls.from_pretrained(c).named_parameters()) for c in (old, base)}
    masters = {c: read_full_state(c)["fp32"] for c in (old, base)}
    for name, value in model.named_parameters():
        source = source_of(name, picks, base)
        assert torch.equal(value, loaded[source][name]) and torch.equal(value, masters[source][name]), name
    assert all(torch.isfinite(model.get_parameter(blown)).all() for blown in spec.blow_up)


@each(LORA)
def test_a_lora_adapter_holds_each_tensor_as_picked_and_loads(variant):
    """adapter_model.safetensors holds each adapter tensor of its pick (LoRA's in each picked module: the
    vision tower, the projector and the language model), and PeftModel.from_pretrained loads it."""
    from peft import PeftModel

    spec, (old, base), picks, out = variant.spec, variant.ckpts, variant.picks, variant.out
    adapter = "adapter_model.safetensors"
    mine, theirs = tensors(out / adapter), {c: tensors(c / adapter) for c in (old, base)}
    assert list(mine) == list(theirs[base])
    for module in picks:
        assert any(n.removeprefix(PEFT_PREFIX).startswith(module + ".") and "lora_A" in n for n in mine), module
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


@each(VARIANTS)
def test_the_output_resumes_in_the_trainer(variant, tmp_path):
    """The HF Trainer resumes the output (a PEFT run's: its adapter) and loads every rank's masters and
    moments, and every frozen value, as composed."""
    losses = resume_and_step(variant.out, variant.spec, tmp_path / "resume")
    assert losses and all(math.isfinite(x) for x in losses)
    resaved = tmp_path / "resume" / "resaved"
    assert_optim_states_equal(variant.out, resaved)
    got, loaded = read_full_state(variant.out)["fp32"], read_full_state(resaved)["fp32"]  # frozen values as loaded
    if variant.spec.peft:  # the Trainer saves a PEFT model without its frozen base (exclude_frozen_parameters)
        loaded = {n: v for n, v in loaded.items() if n in got}
    assert got.keys() == loaded.keys() and all(torch.equal(got[n], loaded[n]) for n in got)


@each(["hf_llava_frozen_vision"])  # the re-partitioning of frozen fragments is the same for every model
def test_a_frozen_vision_tower_is_repartitioned_for_another_world_size(variant, tmp_path):
    """--world-size 3 re-partitions every source, the frozen fragments in model_states among them: the
    output verifies, holds every value of its pick, and the Trainer resumes it on 3 ranks."""
    spec, recipe, out = variant.spec, variant.recipe, variant.out
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


@each(WHOLE)
def test_export_loads_with_from_pretrained_as_picked(variant, tmp_path):
    """`--export` writes each parameter from its pick's fp32 master (a frozen row's from its pick's
    model_states fragments: it has none): from_pretrained loads it with no missing, unexpected or
    mismatched key, each parameter its pick's."""
    spec, (old, base), picks = variant.spec, variant.ckpts, variant.picks
    done = tailor("--export", variant.recipe, "--to", tmp_path / "model")
    assert done.returncode == 0, done.stderr
    model, info = type(base_model(spec)).from_pretrained(tmp_path / "model", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    states = {c: read_full_state(c)["fp32"] for c in (old, base)}
    params = dict(model.named_parameters())
    assert params.keys() == states[base].keys()
    for name, value in params.items():
        assert torch.equal(value, states[source_of(name, picks, base)][name]), name


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
    assert open_checkpoint(copy / "partial-step4").saved.rows == saved
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
    for param, value in tensors(out / "model.safetensors").items():
        assert torch.isfinite(value).all(), param
    provenance = json.loads((out / "tailor_provenance.json").read_text())
    assert blown in json.dumps(provenance)
    verified = tailor("--verify", recipe, "--output", out)
    assert verified.returncode == 0, verified.stdout + verified.stderr
