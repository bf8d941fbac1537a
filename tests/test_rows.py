"""Rows from the model's own structure: block lists wherever they stand, every other module by
name, PEFT's prefix read through, tied names with their partner's row. The names are those of
real transformers models built from tiny configs (no weights downloaded)."""

import pytest

from tailor_tui.checkpoints.rows import RowIndex, RowNaming, list_rows, model_rows


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


def test_row_names_of_module_paths():
    naming = RowNaming(["model.embed_tokens.weight", "model.layers.0.mlp.up.weight", "model.norm.weight",
                        "lm_head.weight"])
    assert naming.split("model.layers.0.mlp.up.weight") == ("layers.0", "model.layers.0")
    assert naming.split("model.norm.weight") == ("norm", "model.norm")
    assert naming.split("lm_head.weight") == ("lm_head", "lm_head")


def test_row_lists_in_messages_name_each_row_once():
    assert list_rows(["embeddings", "layer.0", "cls"]) == "embeddings, layer.0, cls"
    assert list_rows([f"layers.{i}" for i in range(10)]) == "layers.0, layers.1, layers.2, layers.3, …, layers.9"
