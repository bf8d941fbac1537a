"""Weight-file names read back as from_pretrained reads them (`checkpoints/saved_names`), with the installed
transformers' own transforms: every name save_pretrained writes for a model becomes one of its parameters.
The config is the checkpoint's, read as input: only a model class is ever made from it, and no model of
absurd depth. (Real runs that compose by these names: tests/test_architectures.py, hf_beit and hf_llava.)"""

from __future__ import annotations

import json
import os

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
