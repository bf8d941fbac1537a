"""Rows from the model's own structure: block lists wherever they stand, every other module by
name, PEFT's prefix read through, tied names with their partner's row, a multimodal model's stacks.
The names are those of real transformers models built from tiny configs (no weights downloaded;
the multimodal ones on the meta device)."""

import pytest

from tailor_tui.checkpoints.rows import RowIndex, RowNaming, find_row, list_rows, model_rows

LM = dict(vocab_size=101, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
          num_key_value_heads=2)
VIT = dict(hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4, image_size=16,
           patch_size=4)
MROPE = dict(**LM, rope_scaling={"type": "mrope", "mrope_section": [1, 1, 0]})


def _multimodal(arch: str):
    """A multimodal model of transformers, on the meta device (only its names are read)."""
    import torch
    import transformers as t

    make = {
        "llava": lambda: t.LlavaForConditionalGeneration(t.LlavaConfig(
            vision_config=t.CLIPVisionConfig(**VIT), text_config=t.LlamaConfig(**LM), image_token_index=100)),
        "llava_next": lambda: t.LlavaNextForConditionalGeneration(t.LlavaNextConfig(
            vision_config=t.CLIPVisionConfig(**VIT), text_config=t.LlamaConfig(**LM), image_token_index=100,
            image_grid_pinpoints=[[16, 16]])),
        "qwen2_vl": lambda: t.Qwen2VLForConditionalGeneration(t.Qwen2VLConfig(
            vision_config=dict(depth=2, embed_dim=16, hidden_size=16, num_heads=4, mlp_ratio=2, patch_size=4,
                               spatial_merge_size=2, temporal_patch_size=2), text_config=MROPE)),
        "qwen2_5_vl": lambda: t.Qwen2_5_VLForConditionalGeneration(t.Qwen2_5_VLConfig(
            vision_config=dict(depth=2, hidden_size=16, intermediate_size=24, out_hidden_size=16, num_heads=4,
                               patch_size=4, spatial_merge_size=2, temporal_patch_size=2, fullatt_block_indexes=[1]),
            text_config=MROPE)),
        "mllama": lambda: t.MllamaForConditionalGeneration(t.MllamaConfig(
            vision_config=dict(hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_global_layers=1,
                               attention_heads=4, image_size=16, patch_size=4, max_num_tiles=4,
                               vision_output_dim=32, intermediate_layers_indices=[0]),
            text_config=dict(vocab_size=101, hidden_size=16, intermediate_size=24, num_hidden_layers=3,
                             num_attention_heads=4, num_key_value_heads=2, cross_attention_layers=[1],
                             pad_token_id=0, bos_token_id=1, eos_token_id=2))),
        "blip2": lambda: t.Blip2ForConditionalGeneration(t.Blip2Config(
            vision_config=VIT, qformer_config=dict(hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                                                   num_attention_heads=4, encoder_hidden_size=16, vocab_size=101),
            text_config=t.OPTConfig(vocab_size=101, hidden_size=16, ffn_dim=24, num_hidden_layers=2,
                                    num_attention_heads=4, word_embed_proj_dim=16), num_query_tokens=4)),
        "qwen2_audio": lambda: t.Qwen2AudioForConditionalGeneration(t.Qwen2AudioConfig(
            audio_config=dict(d_model=16, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=24,
                              num_mel_bins=8, max_source_positions=16), text_config=t.Qwen2Config(**LM))),
        "idefics3": lambda: t.Idefics3ForConditionalGeneration(t.Idefics3Config(
            vision_config=VIT, text_config=t.LlamaConfig(**LM), scale_factor=2)),
    }[arch]
    with torch.device("meta"):
        return make()


def _model(arch: str):
    import transformers as t

    small = dict(vocab_size=101, num_attention_heads=4)
    return {
        "llama": lambda: t.LlamaForCausalLM(t.LlamaConfig(**small, hidden_size=16, intermediate_size=24,
                                                          num_hidden_layers=2, num_key_value_heads=2)),
        "gpt2": lambda: t.GPT2LMHeadModel(t.GPT2Config(vocab_size=101, n_embd=16, n_layer=2, n_head=4,
                                                       n_positions=32, bos_token_id=0, eos_token_id=0)),
        "opt": lambda: t.OPTForCausalLM(t.OPTConfig(**small, hidden_size=16, ffn_dim=24, num_hidden_layers=2,
                                                    max_position_embeddings=32, word_embed_proj_dim=16)),
        "bert": lambda: t.BertForMaskedLM(t.BertConfig(**small, hidden_size=16, intermediate_size=24,
                                                       num_hidden_layers=2, max_position_embeddings=32)),
        "bert-cls": lambda: t.BertForSequenceClassification(t.BertConfig(
            **small, hidden_size=16, intermediate_size=24, num_hidden_layers=2, max_position_embeddings=32)),
        "t5": lambda: t.T5ForConditionalGeneration(t.T5Config(
            vocab_size=101, d_model=16, d_kv=4, d_ff=24, num_layers=2, num_decoder_layers=1, num_heads=4,
            tie_word_embeddings=False)),
        "gpt_neox": lambda: t.GPTNeoXForCausalLM(t.GPTNeoXConfig(
            **small, hidden_size=16, intermediate_size=24, num_hidden_layers=2, max_position_embeddings=32,
            tie_word_embeddings=False)),
        "beit": lambda: t.BeitForImageClassification(t.BeitConfig(
            image_size=16, patch_size=4, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
            num_attention_heads=4, layer_scale_init_value=0.1, num_labels=3)),
        "mixtral": lambda: t.MixtralForCausalLM(t.MixtralConfig(
            **small, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_key_value_heads=2,
            num_local_experts=2)),
    }[arch]()


def rows_of(model, prefix: str = ""):
    """The model's rows as a checkpoint records them: parameters, persistent buffers, and the
    state dict's other names tied to a parameter (as DeepSpeed's shared_params)."""
    named = dict(model.named_parameters())
    state = model.state_dict(keep_vars=True)
    first = {}
    for n, t in state.items():
        if n in named:
            first.setdefault(id(t), n)
    aliases = {prefix + n: prefix + first[id(t)] for n, t in state.items() if n not in named and id(t) in first}
    buffers = [prefix + n for n, _ in model.named_buffers() if n in state]
    return model_rows([prefix + n for n in named], buffers, aliases, [prefix + n for n in state])


def shown(rows):
    return [r.name + (" (tied)" if r.tied else "") for r in rows]


@pytest.mark.parametrize("arch, expected", [
    ("llama", ["embed_tokens", "layers.0", "layers.1", "norm", "lm_head"]),
    ("gpt2", ["wte", "wpe", "h.0", "h.1", "ln_f", "lm_head (tied)"]),
    ("opt", ["embed_tokens", "embed_positions", "final_layer_norm", "layers.0", "layers.1", "lm_head (tied)"]),
    ("bert", ["embeddings", "layer.0", "layer.1", "cls"]),
    ("bert-cls", ["embeddings", "layer.0", "layer.1", "pooler", "classifier"]),
    ("t5", ["shared", "encoder.embed_tokens (tied)", "encoder.block.0", "encoder.block.1",
            "encoder.final_layer_norm", "decoder.embed_tokens (tied)", "decoder.block.0",
            "decoder.final_layer_norm", "lm_head (tied)"]),
    ("gpt_neox", ["embed_in", "layers.0", "layers.1", "final_layer_norm", "lm_head"]),
    ("mixtral", ["embed_tokens", "layers.0", "layers.1", "norm", "lm_head"]),
    ("beit", ["embeddings", "layers.0", "layers.1", "pooler", "classifier"]),  # no row `layers` of the scales
])
def test_rows_of_real_architectures(arch, expected):
    assert shown(rows_of(_model(arch))) == expected


VISION = ["vision.embeddings", "vision.pre_layrnorm", "vision.layers.0", "vision.layers.1", "vision.post_layernorm"]
LANGUAGE = ["embed_tokens", "layers.0", "layers.1", "norm", "lm_head"]


@pytest.mark.parametrize("arch, vision, language", [
    ("llava", [*VISION, "multi_modal_projector"], LANGUAGE),
    ("llava_next", ["image_newline", *VISION, "multi_modal_projector"], LANGUAGE),
    ("qwen2_vl", ["vision.patch_embed", "vision.blocks.0", "vision.blocks.1", "vision.merger"], LANGUAGE),
    ("qwen2_5_vl", ["vision.patch_embed", "vision.blocks.0", "vision.blocks.1", "vision.merger"], LANGUAGE),
    # the vision encoder's two block lists; the cross-attention layer (layers.1) is a row of its index
    ("mllama", ["vision.class_embedding", "vision.patch_embedding", "vision.gated_positional_embedding",
                "vision.pre_tile_positional_embedding", "vision.post_tile_positional_embedding",
                "vision.layernorm_pre", "vision.layernorm_post", "vision.transformer.layers.0",
                "vision.transformer.layers.1", "vision.global_transformer.layers.0"],
     ["embed_tokens", "layers.0", "layers.1", "layers.2", "norm", "multi_modal_projector", "lm_head"]),
    ("idefics3", ["vision.embeddings", "vision.layers.0", "vision.layers.1", "vision.post_layernorm",
                  "connector"], LANGUAGE),
])
def test_a_multimodal_models_rows_are_its_stacks(arch, vision, language):
    """Each stack's rows in the state dict's order, grouped: the vision encoder's prefixed `vision.`,
    the language model's named as a plain language model's; the projector with the rows before it."""
    rows = rows_of(_multimodal(arch))
    assert [r.name for r in rows] == [*vision, *language]
    assert [r.group for r in rows] == ["vision"] * len(vision) + ["language"] * len(language)


def test_other_stacks_follow_the_same_rule():
    """Speech and text (Qwen2-Audio): `audio.`; a Q-Former beside a language model (BLIP-2): each
    stack of no modality named by its module."""
    audio = rows_of(_multimodal("qwen2_audio"))
    assert [r.name for r in audio] == ["audio.conv1", "audio.conv2", "audio.embed_positions", "audio.layers.0",
                                       "audio.layers.1", "audio.layer_norm", "multi_modal_projector", *LANGUAGE]
    assert {r.group for r in audio} == {"audio", "language"}
    blip = rows_of(_multimodal("blip2"))
    assert [r.name for r in blip if r.group == "qformer"] == [
        "qformer.layernorm", "qformer.layer.0", "qformer.layer.1", "language_projection"]
    assert "language_model.layers.1" in [r.name for r in blip if r.group == "language_model"]


def test_a_row_is_found_by_its_name_module_path_or_an_unambiguous_end_of_it():
    rows = rows_of(_multimodal("llava"))
    for key in ("vision.layers.1", "model.vision_tower.encoder.layers.1", "vision_tower.encoder.layers.1",
                "encoder.layers.1"):
        assert find_row(rows, key).name == "vision.layers.1", key
    assert find_row(rows, "layers.1").name == "layers.1"  # a name before any end of a path
    assert find_row(rows, "language_model.layers.1").name == "layers.1"
    assert find_row(rows, "model.layers.1") is None  # no module path ends so
    assert find_row(rows, "post_layernorm").name == "vision.post_layernorm"
    t5 = rows_of(_model("t5"))
    assert find_row(t5, "block.0") is None  # encoder's or decoder's: ambiguous


def test_names_that_would_clash_per_stack_keep_their_module_paths():
    """A stack's rows named less their own container must not meet: else no stacks at all."""
    names = ["model.vision_tower.encoder.layers.0.w.weight", "model.vision_tower.encoder.norm.weight",
             "model.vision_tower.norm.weight",  # `vision.norm` too, less its stack's container
             "model.language_model.layers.0.w.weight"]
    rows = model_rows(names)
    assert [r.name for r in rows] == ["vision_tower.encoder.layers.0", "vision_tower.encoder.norm",
                                      "vision_tower.norm", "language_model.layers.0"]
    assert {r.group for r in rows} == {""}
    beside = model_rows([*names[:1], *names[3:], "model.norm.weight", "model.language_model.norm.weight"])
    assert [r.name for r in beside] == ["vision_tower.encoder.layers.0", "language_model.layers.0", "norm",
                                        "language_model.norm"]


def test_module_paths_and_ownership():
    rows = {r.name: r for r in rows_of(_model("t5"))}
    assert rows["decoder.block.0"].module_path == "decoder.block.0"
    assert all(p.startswith("encoder.block.1.") for p in rows["encoder.block.1"].params)
    assert rows["encoder.block.0"].params != rows["decoder.block.0"].params
    bert = {r.name: r for r in rows_of(_model("bert"))}
    assert bert["embeddings"].module_path == "bert.embeddings"
    assert bert["layer.1"].module_path == "bert.encoder.layer.1"
    # cls's decoder weight is the word embeddings': it stays with them
    index = RowIndex(bert.values())
    assert index.row_of("cls.predictions.decoder.weight") == "embeddings"
    assert index.row_of("cls.predictions.transform.dense.weight") == "cls"


def test_a_blocks_own_parameters_are_its_rows():
    """A parameter a block holds itself (a layer-scale factor, BEiT's lambda_1 and lambda_2 of each
    block; `layers.N.scale` beside `layers.N.mlp.w.weight`) is in that block's row: no row gathers one
    parameter from each block."""
    beit = {r.name: r for r in rows_of(_model("beit"))}
    assert {p.rsplit(".", 1)[-1] for p in beit["layers.1"].params} >= {"lambda_1", "lambda_2"}
    assert all(".layers.1." in p for p in beit["layers.1"].params)
    names = ["model.embed_tokens.weight", *(f"model.layers.{i}.{n}" for i in range(3) for n in ("mlp.w.weight", "scale")),
             "model.norm.weight", "lm_head.weight"]
    rows = model_rows(names)
    assert [r.name for r in rows] == ["embed_tokens", "layers.0", "layers.1", "layers.2", "norm", "lm_head"]
    assert rows[2].params == ("model.layers.1.mlp.w.weight", "model.layers.1.scale")


def test_peft_names_are_read_through_the_prefix():
    """A LoRA-wrapped Llama's names (as PEFT gives them): rows named as the plain model's; LoRA
    and modules_to_save parameters in the row of the module they adapt."""
    p = "base_model.model."
    names = [f"{p}model.embed_tokens.weight",
             f"{p}model.layers.0.self_attn.q_proj.base_layer.weight",
             f"{p}model.layers.0.self_attn.q_proj.lora_A.default.weight",
             f"{p}model.layers.0.self_attn.q_proj.lora_B.default.weight",
             f"{p}model.layers.1.mlp.down_proj.weight",
             f"{p}model.norm.weight",
             f"{p}lm_head.original_module.weight", f"{p}lm_head.modules_to_save.default.weight"]
    rows = model_rows(names)
    assert [r.name for r in rows] == ["embed_tokens", "layers.0", "layers.1", "norm", "lm_head"]
    assert rows[1].module_path == f"{p}model.layers.0" and len(rows[1].params) == 3
    index = RowIndex(rows)  # the adapter file's names (PEFT drops `.default`)
    assert index.row_of(f"{p}model.layers.0.self_attn.q_proj.lora_A.weight") == "layers.0"
    assert index.row_of(f"{p}lm_head.weight") == "lm_head"
    assert index.row_of("embed_out.weight") is None


@pytest.mark.parametrize("arch", ["qwen2_vl", "mllama"])
def test_a_lora_wrapped_multimodal_models_rows_are_the_plain_models(arch):
    """LoRA (real PEFT) on both stacks and the projector, Qwen2-VL's a numbered Sequential
    (`visual.merger.mlp.0`), Mllama's a bare Linear (`multi_modal_projector`): the rows are the plain
    model's, named as its, whether all of its names are read or the trainable ones alone (what the
    Trainer saves of a PEFT model)."""
    import torch
    from peft import LoraConfig, get_peft_model

    model = _multimodal(arch)
    plain = [r.name for r in rows_of(model)]
    lora = LoraConfig(r=2, target_modules=r".*\.(qkv|fc1|q_proj|v_proj|merger\.mlp\.0|multi_modal_projector)",
                      modules_to_save=["lm_head"])
    with torch.device("meta"):
        peft = get_peft_model(model, lora)
    rows = rows_of(peft)
    assert [r.name for r in rows] == plain
    assert all(r.module_path.startswith("base_model.model.") for r in rows)
    trainable = model_rows([n for n, p in peft.named_parameters() if p.requires_grad])
    projector = {"qwen2_vl": "vision.merger", "mllama": "multi_modal_projector"}[arch]
    assert projector in [r.name for r in trainable] and {r.name for r in trainable} < set(plain)


def test_row_names_of_module_paths():
    naming = RowNaming(["model.embed_tokens.weight", "model.layers.0.mlp.up.weight", "model.norm.weight",
                        "lm_head.weight"])
    assert naming.split("model.layers.0.mlp.up.weight") == ("layers.0", "model.layers.0")
    assert naming.split("model.norm.weight") == ("norm", "model.norm")
    assert naming.split("lm_head.weight") == ("lm_head", "lm_head")


def test_row_lists_in_messages_name_each_row_once():
    assert list_rows(["embeddings", "layer.0", "cls"]) == "embeddings, layer.0, cls"
    assert list_rows([f"layers.{i}" for i in range(10)]) == "layers.0–9"  # every row named: a suggestion is in it
    assert list_rows(["embed_tokens", *(f"layers.{i}" for i in range(4)), "norm", "lm_head"]) == \
        "embed_tokens, layers.0–3, norm, lm_head"
    assert list_rows([f"x{i}" for i in range(12)]) == "x0, x1, x2, x3, x4, x5, x6, x7, …, x11"
