"""The details panel's text: what the user decides from first (the checkpoint, the cell's
health, the row and where it comes from), then the row across checkpoints, then the
checkpoint's files. Below the grid on a narrow terminal only the first lines show, so the
order matters. Pure: a function of the composition and the statistics, no widgets."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Callable

from tailor_tui.compose.composition import Composition
from tailor_tui.health.healing import Health
from tailor_tui.checkpoints.checkpoint import tied_members, tied_partner
from tailor_tui.units import size
from tailor_tui.ui.heatmap import cell_block, row_block


def details_lines(comp: Composition, health: Health | None, row_name: str, column: int | None, *, metric: str,
                  computing: str | None, problems: tuple = (), show: Callable[[Path], str] = str) -> list[str]:
    row = comp.base_checkpoint.row(row_name)
    lines = []
    if column is not None:
        c = comp.checkpoints[column]
        lines.append(comp.label(column) + ("  (base)" if column == comp.base else "") + f" · step {c.step}")
        reason = comp.incompatibility(column)
        if reason:
            lines.append(f"✗ cannot be combined with the base: {reason}")
        elif warning := comp.other_run(column):
            lines.append(f"! {warning}; make sure it is the same training run")
    if not row.tied:
        lines += cell_block(health, row.name, column, computing)
    source = comp.source_of(row.name)
    lines.append(f"row     {row.name}  ({row.module_path})")
    lines.append(f"source  {comp.label(source)}" + ("  (base)" if source == comp.base else ""))
    if row.tied:
        lines.append(f"tied to {tied_partner(comp.base_checkpoint, row)}: no weights of its own")
    else:
        lines += [f"tied    {alias} = {target}: it comes with row {partner}"
                  for alias, target, partner in tied_members(comp.base_checkpoint, row)]
        shapes = dict(p for g in comp.base_checkpoint.layout.groups for p in g)
        shapes.update(dict(comp.base_checkpoint.layout.frozen))
        numel = sum(math.prod(shapes[p]) for p in row.params)
        lines.append(f"params  {len(row.params)} tensors, {numel:,} elements")
        lines.append(f"state   {size(numel * 12)} of fp32 + Adam moments")
        block = row_block(health, comp.checkpoints, row.name, column, metric)
        lines += [""] + block if block else []
    if column is not None:
        c = comp.checkpoints[column]
        kind = {"hf": "HF Trainer", "accelerate": "Accelerate save_state"}.get(c.kind, "DeepSpeed save_dir")
        model = sum(c.sizes[f] for f in c.model_files)
        lines += [
            "",
            f"path    {show(c.path)}",
            f"layout  {kind}, {c.world_size} ranks, {c.dtype}",
            f"files   {size(c.total_bytes())}" + (f" ({size(model)} 16-bit model)" if model else ""),
            f"rank 0  {size(c.rank_bytes(0))}",
        ]
        if c.partial:
            lines.append(f"partial saved {len(c.saved_rows)} of {sum(not r.tied for r in c.rows)} rows")
        if c.composed:
            lines.append("composed by tailor-tui (tailor_provenance.json names its sources)")
    if problems:  # kept here, not only in a toast
        lines += ["", f"skipped while scanning ({len(problems)}):"]
        lines += [f"  {show(path)}: {why}" for path, why in problems]
    return lines
