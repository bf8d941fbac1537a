"""Row names: the block's module path with the model container prefix dropped."""

import pytest

from tailor_tui.rows import split_row


@pytest.mark.parametrize(
    "param, row, module_path",
    [
        ("model.embed_tokens.weight", "embed_tokens", "model.embed_tokens"),
        ("model.layers.0.self_attn.q_proj.weight", "layers.0", "model.layers.0"),
        ("model.layers.11.mlp.down_proj.weight", "layers.11", "model.layers.11"),
        ("model.norm.weight", "norm", "model.norm"),
        ("lm_head.weight", "lm_head", "lm_head"),
        ("transformer.wte.weight", "wte", "transformer.wte"),
        ("transformer.wpe.weight", "wpe", "transformer.wpe"),
        ("transformer.h.3.attn.c_attn.bias", "h.3", "transformer.h.3"),
        ("transformer.ln_f.weight", "ln_f", "transformer.ln_f"),
        ("gpt_neox.layers.2.attention.dense.weight", "layers.2", "gpt_neox.layers.2"),
        ("gpt_neox.embed_in.weight", "embed_in", "gpt_neox.embed_in"),
        ("embed_out.weight", "embed_out", "embed_out"),
    ],
)
def test_row_names(param, row, module_path):
    assert split_row(param) == (row, module_path)
