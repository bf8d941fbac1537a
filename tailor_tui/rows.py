"""Rows: the top-level blocks of a model that a recipe picks a source for.

A row's name is the module path of the block with the model container prefix
dropped: `model.layers.3.mlp.up_proj.weight` is in row `layers.3`,
`lm_head.weight` in `lm_head`, `transformer.h.0.attn.c_attn.weight` in `h.0`.
"""

from __future__ import annotations

from dataclasses import dataclass

CONTAINERS = ("model", "transformer", "gpt_neox", "backbone", "decoder")


def split_row(param_name: str) -> tuple[str, str]:
    """Return (row name, full module path of the row) for a parameter or buffer name."""
    parts = param_name.split(".")
    prefix: list[str] = []
    if len(parts) > 2 and parts[0] in CONTAINERS:
        prefix, parts = parts[:1], parts[1:]
    # A ModuleList entry (`layers.3`) is a row of its own; anything else is its first part.
    take = 2 if len(parts) > 2 and parts[1].isdigit() else 1
    row = ".".join(parts[:take])
    return row, ".".join(prefix + parts[:take])


def row_of(param_name: str) -> str:
    return split_row(param_name)[0]


@dataclass(frozen=True)
class Row:
    """A top-level block of the model and the parameters and buffers it owns."""

    name: str  # `layers.3`
    module_path: str  # `model.layers.3`
    params: tuple[str, ...]  # trainable and frozen parameter names
    buffers: tuple[str, ...]

    @property
    def tied(self) -> bool:
        """True when the row has no storage of its own (e.g. lm_head tied to embeddings)."""
        return not self.params and not self.buffers
