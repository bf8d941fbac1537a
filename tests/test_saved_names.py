"""Weight-file names read back as from_pretrained reads them (`checkpoints/saved_names`), with the installed
transformers' own transforms: every name save_pretrained writes for a model becomes one of its parameters.
The config is the checkpoint's, read as input: only a model class is ever made from it, and no model of
absurd depth. (Real runs that compose by these names: tests/test_architectures.py, hf_beit and hf_llava.)"""

from __future__ import annotations

import json

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
