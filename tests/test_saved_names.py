"""Weight-file names read back as from_pretrained reads them (`checkpoints/saved_names`), with the installed
transformers' own transforms: every name save_pretrained writes for a model becomes one of its parameters.
The config is the checkpoint's, read as input: only a model class is ever made from it, and no model of
absurd depth. (Real runs that compose by these names: tests/test_architectures.py, hf_beit and hf_llava.)"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Callable

import pytest
import torch
import transformers as tf

from tailor_tui.checkpoints.saved_names import loading_names


def _llava():
    vision = tf.CLIPVisionConfig(hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
                                 image_size=16, patch_size=4)
    text = tf.LlamaConfig(vocab_size=101, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2)
    config = tf.LlavaConfig(vision_config=vision, text_config=text, image_token_index=100)
    config.architectures = ["LlavaForConditionalGeneration"]
    return config, tf.LlavaForConditionalGeneration


@pytest.mark.parametrize("make", [_llava], ids=["llava"])
def test_every_saved_name_is_read_back_to_a_parameter(tmp_path, make):
    from transformers.core_model_loading import revert_weight_conversion

    config, cls = make()
    (tmp_path / "config.json").write_text(config.to_json_string())
    with torch.device("meta"):
        model = cls(config)
    params = {n for n, _ in model.named_parameters()}
    saved = list(revert_weight_conversion(model, {n: torch.empty(0) for n in params}))
    assert set(saved) != params  # transformers 5 saves this model under other names than its parameters'
    rename = loading_names(tmp_path)
    assert rename is not None and {rename(name) for name in saved} == params


def test_a_config_names_only_a_model_class_and_a_sane_depth(tmp_path, monkeypatch):
    called = []
    monkeypatch.setattr(tf, "set_seed", lambda *a, **k: called.append(a))  # a function of transformers'
    config = {"model_type": "llama", "architectures": ["set_seed"], "num_hidden_layers": 2}
    (tmp_path / "config.json").write_text(json.dumps(config))
    loading_names(tmp_path)
    assert called == []

    made = []
    monkeypatch.setattr(tf.LlamaForCausalLM, "__init__", lambda self, *a, **k: made.append(a))
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 10**9}
    (tmp_path / "config.json").write_text(json.dumps(config))
    loading_names(tmp_path)
    assert made == []
    config["num_hidden_layers"] = 2
    (tmp_path / "config.json").write_text(json.dumps(config))
    loading_names(tmp_path)
    assert made  # a sane one is made (on the meta device)


def test_names_found_are_cached_for_the_next_command(tmp_path, monkeypatch):
    """What loading_names found for a weight file's names is cached (the model made to find it costs
    torch's and transformers' imports); a cached entry that does not answer for the names asked is
    found again."""
    from tailor_tui.checkpoints import saved_names

    monkeypatch.setenv("TAILOR_TUI_CACHE", str(tmp_path / "cache"))
    config, _cls = _llava()
    (tmp_path / "config.json").write_text(config.to_json_string())
    saved = ["language_model.model.layers.0.mlp.up_proj.weight", "vision_tower.vision_model.post_layernorm.bias"]
    rename = loading_names(tmp_path)
    assert rename is not None
    want = {name: rename(name) for name in saved}
    assert saved_names.loaded_names(tmp_path, saved) == want and any(k != v for k, v in want.items())
    (entry,) = (tmp_path / "cache" / "names").rglob("*.json")

    def never(config):
        raise AssertionError("made the model again")

    monkeypatch.setattr(saved_names, "_renamer", never)
    assert saved_names.loaded_names(tmp_path, reversed(saved)) == want  # from the cache
    entry.write_text(json.dumps({"renamed": {saved[0]: "x"}}))  # an entry for other names (or tampered)
    with pytest.raises(AssertionError, match="made the model again"):
        saved_names.loaded_names(tmp_path, saved)


def test_a_command_reading_a_llava_checkpoint_again_imports_neither_torch_nor_transformers(real_run, tmp_path):
    """A Llava's weight files are saved under transformers' names; the first --apply finds what they load
    as (torch and transformers imported: seconds), the next finds it in the cache."""
    import subprocess
    import sys

    from conftest import checkpoints_of
    from helpers import write_recipe

    run, spec = real_run("hf_llava")
    oldest, base = checkpoints_of(run, spec)
    recipe = write_recipe(tmp_path, base, {"model.language_model.layers.1": oldest})
    imported = []
    env = dict(os.environ, TAILOR_TUI_CACHE=str(tmp_path / "cache"))  # empty: the first --apply finds the names
    for _ in range(2):
        done = subprocess.run([sys.executable, "-X", "importtime", "-m", "tailor_tui", "--apply", recipe, "--force"],
                              capture_output=True, text=True, timeout=300, env=env)
        assert done.returncode == 0, done.stderr[-3000:]
        imported.append({line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines()
                         if line.startswith("import time:")})
    assert "transformers" in imported[0]
    assert "transformers" not in imported[1] and "torch" not in imported[1]


def test_no_config_transformers_ships_is_too_large_to_make():
    """The bound read off a config before anything is made (saved_names._oversized: a count-named
    integer, a list, nesting) passes every default config of the installed transformers: none is left
    to the table for it (the largest count among them: Doge's 16,384 experts)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from tailor_tui.checkpoints import saved_names

    refused, read = [], 0
    for model_type in list(CONFIG_MAPPING.keys()):
        try:
            config = CONFIG_MAPPING[model_type]()
        except Exception:  # noqa: BLE001 - a config that cannot be made without arguments
            continue
        read += 1
        if saved_names._oversized(json.loads(config.to_json_string(use_diff=False))):
            refused.append(model_type)
    assert read > 500 and not refused, refused


HUGE = 1_000_000
NEOX = "GPTNeoXForCausalLM"  # the run's own class: transformers' table reads its embed_out as lm_head


def _own(config: dict, key: str, value) -> dict:
    return {**config, key: value}


def _other(model_type: str, arch: str, **asked) -> Callable[[dict], dict]:
    """A config of another model of transformers' asking for HUGE in its own words, naming the run's
    class after its own: once no model is made, the table of the run's class reads the names."""
    return lambda _config: {"model_type": model_type, "architectures": [arch, NEOX], **asked}


# Each spelling transformers' configs give a model's depth (or its experts): a GPT-NeoX run's
# config.json asking for a million of them
DEEP = {
    "num_hidden_layers": lambda config: _own(config, "num_hidden_layers", HUGE),
    "n_layer": _other("gpt2", "GPT2LMHeadModel", n_layer=HUGE),
    "num_layers": _other("t5", "T5ForConditionalGeneration", num_layers=HUGE),
    "encoder_layers": _other("bart", "BartForConditionalGeneration", encoder_layers=HUGE),
    "depths": _other("swin", "SwinForImageClassification", depths=[2, 2, HUGE, 2]),
    "inner_group_num": _other("albert", "AlbertForMaskedLM", inner_group_num=HUGE),
    "vision_config.depth": _other("qwen2_vl", "Qwen2VLForConditionalGeneration", vision_config={"depth": HUGE}),
    "text_config.num_hidden_layers": _other("llava", "LlavaForConditionalGeneration",
                                            text_config={"model_type": "llama", "num_hidden_layers": HUGE}),
    "n_routed_experts": _other("deepseek_v3", "DeepseekV3ForCausalLM", n_routed_experts=HUGE, num_hidden_layers=2),
    # no number at all: a Nemotron-H's layers are its pattern's characters (the bound on parts made)
    "hybrid_override_pattern": _other("nemotron_h", "NemotronHForCausalLM", hybrid_override_pattern="M" * HUGE),
}


def _neox_with(real_run, tmp_path: Path, config: Callable[[dict], dict]) -> Path:
    """A copy of the GPT-NeoX run (its lm_head saved as embed_out: which row that is, is read from
    config.json) whose newest checkpoint's config.json is `config` of its own; a recipe taking
    lm_head from the oldest."""
    from conftest import checkpoints_of
    from helpers import write_recipe

    run, spec = real_run("hf_gpt_neox")
    oldest, base = (tmp_path / "run" / c.name for c in checkpoints_of(run, spec))
    shutil.copytree(run, tmp_path / "run")
    (base / "config.json").write_text(json.dumps(config(json.loads((base / "config.json").read_text()))))
    return write_recipe(tmp_path, base, {"lm_head": oldest})


@pytest.mark.parametrize("spelling", list(DEEP))
def test_a_config_asking_for_a_million_layers_in_any_words_plans_in_bounded_time_and_memory(real_run, tmp_path,
                                                                                             spelling):
    """Issue 58: a config.json whose n_layer asked for a million layers hung the plan (a GPT-2 made
    layer by layer on the meta device, past 800 MB and a minute): only keys holding 'layers' were
    bounded. Now no model is made of it, whatever the words (saved_names: any count of the config,
    then the parts a model registers), and the plan is made as it is without the model: here by the
    table of the run's class, which reads embed_out as lm_head."""
    from helpers import tailor_peak

    recipe = _neox_with(real_run, tmp_path, DEEP[spelling])
    started = time.monotonic()
    planned, peak = tailor_peak("--apply", recipe, "--dry-run", timeout=60,
                                env={"TAILOR_TUI_CACHE": str(tmp_path / "cache")})
    took = time.monotonic() - started
    assert planned.returncode == 0 and "Traceback" not in planned.stderr, planned.stderr
    assert "lm_head  ← " in planned.stdout and "composed per row: 4 rank files, model.safetensors" in planned.stdout
    assert "dry run: nothing written" in planned.stdout
    # torch and transformers imported cost ~300 MiB and seconds here, as for any config naming a model
    assert peak < 512 << 20 and took < 45, (peak >> 20, took)


def test_a_config_too_large_to_make_and_no_table_refuses_the_unread_name_in_one_line(real_run, tmp_path):
    """Where no model is made and the table says nothing of the name either (GPT-2's), the weight
    file's embed_out is no row's: refused by name, in one line, as with no config at all."""
    from helpers import assert_one_line_error, tailor

    recipe = _neox_with(real_run, tmp_path, lambda _config: {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"],
                                                             "n_layer": HUGE})
    refused = tailor("--apply", recipe, "--dry-run", timeout=60, env={"TAILOR_TUI_CACHE": str(tmp_path / "cache")})
    assert_one_line_error(refused, 5, "model.safetensors", "embed_out.weight", "no row")
