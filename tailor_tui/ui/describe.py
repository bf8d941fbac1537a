"""What the composer shows of rows, cells and checkpoints: the heatmap's colours (a metric's
colours are scaled per row, so one layer's outlier stands out), the column headers, and the
details panel's text. The details come in the order the user decides from: the checkpoint,
the cell's health, the row and where it comes from, then the row across checkpoints, then the
checkpoint's files (below the grid on a narrow terminal only the first lines show); and the title
line fitted to the terminal's width (`fit_title`). Pure functions of the composition and its Health:
no widgets."""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path
from typing import Callable

from tailor_tui.checkpoints.checkpoint import Checkpoint, tied_members, tied_partner
from tailor_tui.checkpoints.dcp_checkpoint import DcpCheckpoint
from tailor_tui.health.healing import METRICS, Cell, Health, TrainingCurve, damage_text, percent, why_unhealthy
from tailor_tui.planning.recipe_draft import RecipeDraft
from tailor_tui.units import shown, size

# low → high: dark blue, teal, olive, amber, red (readable with the cells' light text)
PALETTE = ("#1f3a5f", "#1f5f5b", "#5f5f1f", "#8a5a12", "#9e2a2b")
LABEL = {"rel_change": "Δ since previous", "weight_rms": "weight RMS", "adam_v_max": "optimizer v max"}  # (the second moment: Adam's exp_avg_sq, …)
SHORT = {"rel_change": "Δ", "weight_rms": "rms", "adam_v_max": "v max"}  # as the cell's lines label them
LOSS_JUMP = 1.2  # a loss this many times the previous checkpoint's is marked
PROBLEMS_LISTED = 20  # folders the details panel lists of those the scan skipped


def row_range(health: Health | None, row: str, metric: str) -> tuple[float, float] | None:
    """(lowest, highest) value of `metric` in `row` across checkpoints, or None."""
    if health is None:
        return None
    values = [v for c in health.row_cells(row).values() if (v := c.value(metric)) is not None]
    return (min(values), max(values)) if values else None


def background(cell: Cell | None, metric: str, scale: tuple[float, float] | None) -> str:
    """The cell's background style for `metric` ("" when there is nothing to show)."""
    value = cell.value(metric) if cell is not None else None
    if value is None or scale is None:
        return ""
    lo, hi = scale
    t = 0.5 if hi <= lo else (value - lo) / (hi - lo)
    return f" on {PALETTE[min(len(PALETTE) - 1, int(t * len(PALETTE)))]}"


def header_suffix(health: Health | None, column: int) -> str:
    """` · 4.62`, the loss (and ▲ where it jumped from the previous checkpoint's), or "": the names
    column's header says `step · loss`."""
    if health is None:
        return ""
    log = health.logs.get(column)
    if log is None or log.loss is None:
        return ""
    text = f" · {log.loss:.3g}"
    prev = next((health.logs[i].loss for i in reversed(range(column))
                 if i in health.logs and health.logs[i].loss is not None), None)
    if log.loss != log.loss or (prev is not None and prev > 0 and log.loss > LOSS_JUMP * prev):
        text += " ▲"
    return text


def no_curve(curve: TrainingCurve) -> str:
    """What the curve's place says where there is no curve to plot."""
    if curve.log_read:
        return "no loss logged yet: the newest checkpoint's trainer_state.json holds no training loss"
    return ("no training log: these checkpoints keep no trainer_state.json (DeepSpeed's and Accelerate's "
            "saves do not; the HF Trainer's do), so there is no loss curve")


def curve_title(curve: TrainingCurve, cursor: int | None, width: int, circles: bool = True) -> str:
    """The loss curve's title: the cursor's checkpoint's step, loss and grad norm, then (where
    `width` leaves room) what the checkpoints' marks on the curve are (`circles`: drawn)."""
    loss = curve.loss_at(cursor) if cursor is not None else None
    if cursor is None or loss is None:
        head = f"loss over {curve.steps[-1]:,} steps" if curve.steps else "loss"
    else:
        grad = curve.grad_norm_at(cursor)
        head = f"● step {cursor:,}: loss {loss:.4g}" + (f" · grad {grad:.3g}" if grad is not None else "")
    key = " · ○ checkpoints" if circles else ""
    return head + key if len(head) + len(key) <= width - 2 else head


def cell_lines(cell: Cell | None) -> list[str]:
    if cell is None:
        return ["not computed yet"]
    if not cell.healthy:
        return [f"✗ {why_unhealthy(cell)}"]
    return [f"rms {_num(cell.weight_rms)} · Δ {_pct(cell.rel_change)}", f"v max {_num(cell.adam_v_max)} · finite"]


def metric_text(cell: Cell | None, metric: str) -> str:
    """A cell's value of `metric` in a few characters (or what is wrong with it)."""
    if cell is None:
        return "…"
    if not cell.healthy:
        return damage_text(cell)
    value = cell.value(metric)
    return _pct(value) if metric == "rel_change" else _num(value)


def cell_block(health: Health | None, row: str, column: int | None, computing: str | None,
               metric: str = "rel_change") -> list[str]:
    """The cell under the cursor: the checkpoint's loss, then the row's statistics there (the
    first line says which of them colours the heatmap)."""
    lines = [f"health  {computing}"] if computing else []
    if health is None or column is None:
        return lines
    log = health.logs.get(column)
    if log is not None and log.loss is not None:
        grad = f" · grad {log.grad_norm:.3g}" if log.grad_norm is not None else ""
        lines.append(f"loss    {log.loss:.4g}{grad}")
    cell = health.cell(row, column)
    colour = f"   (colour: {SHORT[metric]})" if cell is not None and cell.healthy else ""
    return lines + [f"{'cell' if i == 0 else '':<8}{text}{colour if i == 0 else ''}"
                    for i, text in enumerate(cell_lines(cell))]


def row_block(health: Health | None, checkpoints: tuple[Checkpoint, ...] | list, row: str, column: int | None,
              metric: str) -> list[str]:
    """The row across checkpoints (the 12 around the cursor) by `metric`."""
    if health is None:
        return []
    lines = [f"{LABEL[metric]} (m: next metric)"]
    shown = list(range(len(checkpoints)))
    if len(shown) > 12:  # those around the cursor
        middle = column if column is not None else len(shown) - 1
        start = max(0, min(middle - 6, len(shown) - 12))
        shown = shown[start: start + 12]
    width = max(len(checkpoints[i].name) for i in shown)
    for i in shown:
        mark = "▸" if i == column else " "
        cell = health.cell(row, i)
        text = "·" if cell is None and not checkpoints[i].holds(row) else metric_text(cell, metric)
        lines.append(f"{mark} {checkpoints[i].name:<{width}}  {text}")
    return lines


def next_metric(metric: str) -> str:
    return METRICS[(METRICS.index(metric) + 1) % len(METRICS)]


def _num(x: float | None) -> str:
    return "—" if x is None else f"{x:.3g}"


def _pct(x: float | None) -> str:
    return "—" if x is None else percent(x)  # as the health report says it


def stack_block(comp: RecipeDraft, stack: str, rows: list[str]) -> list[str]:
    """A folded stack's lines in the details panel: its rows, where they come from, their size."""
    sources = Counter(comp.source_of(r) for r in rows)
    lines = [f"stack   {stack} · {len(rows)} rows, folded (f unfolds; a pick here picks them all)"]
    lines += [f"source  {comp.label(c)}" + ("  (base)" if c == comp.base else "") + f": {n} rows"
              for c, n in sorted(sources.items())]
    shapes = _shapes(comp)
    params = [p for r in rows for p in comp.base_checkpoint.row(r).params]
    numel = sum(math.prod(shapes[p]) for p in params)
    return [*lines, f"params  {len(params)} tensors, {numel:,} elements"]


def _row_lines(comp: RecipeDraft, health: Health | None, row, column: int | None, *, metric: str,
               computing: str | None) -> list[str]:
    """The details panel's lines of the row under the cursor: its cells, source, ties and size."""
    lines = [] if row.tied else cell_block(health, row.name, column, computing, metric)
    source = comp.source_of(row.name)
    lines.append(f"row     {row.name}  ({row.module_path})")
    lines.append(f"source  {comp.label(source)}" + ("  (base)" if source == comp.base else ""))
    if row.tied:
        lines.append(f"tied to {tied_partner(comp.base_checkpoint, row)}: no weights of its own")
        return lines
    lines += [f"tied    {alias} = {target}: it comes with row {partner}"
              for alias, target, partner in tied_members(comp.base_checkpoint, row)]
    numel = sum(math.prod(_shapes(comp)[p]) for p in row.params)
    lines.append(f"params  {len(row.params)} tensors, {numel:,} elements")
    lines.append(f"state   {size(numel * 4)} fp32 masters + optimizer state")  # (the latter's size: its optimizer's)
    block = row_block(health, comp.checkpoints, row.name, column, metric)
    return lines + ([""] + block if block else [])


def _shapes(comp: RecipeDraft) -> dict:
    """Every parameter's shape in the base (trained and frozen)."""
    base: object = comp.base_checkpoint
    if isinstance(base, DcpCheckpoint):
        return base.shapes()
    shapes = dict(p for g in comp.base_checkpoint.layout.groups for p in g)
    shapes.update(dict(comp.base_checkpoint.layout.frozen))
    return shapes


def details_lines(comp: RecipeDraft, health: Health | None, row_name: str, column: int | None, *, metric: str,
                  computing: str | None, problems: tuple = (), outputs: tuple = (),
                  show: Callable[[Path], str] = str, stack: tuple[str, list[str]] | None = None) -> list[str]:
    """The details panel: the checkpoint under the cursor, then its row (or, on a folded stack's
    header, `stack`: its name and rows), then the checkpoint's files and the scan's notices."""
    row = comp.base_checkpoint.row(row_name)
    lines = []
    if column is not None:
        c = comp.checkpoints[column]
        lines.append(comp.label(column) + ("  (base)" if column == comp.base else "")
                     + (f" · step {c.step}" if c.step is not None else ""))
        reason = comp.incompatibility(column)
        if reason:
            lines.append(f"✗ cannot be combined with the base: {reason}")
        elif warning := comp.other_run(column):
            lines.append(f"! {warning}; make sure it is the same training run")
    if stack is not None:
        lines += stack_block(comp, *stack)
    else:
        lines += _row_lines(comp, health, row, column, metric=metric, computing=computing)
    column_of: object = comp.checkpoints[column] if column is not None else None
    if isinstance(column_of, DcpCheckpoint):  # (an FSDP2 run's columns: described by their own facts)
        lines += ["", f"path    {show(column_of.path)}", f"layout  {column_of.describe()}",
                  f"files   {size(column_of.total_bytes())}"]
    elif column is not None:
        c = comp.checkpoints[column]
        kind = c.folder.label
        model = sum(c.sizes[f] for f in c.model_files)
        lines += [
            "",
            f"path    {show(c.path)}",
            f"layout  {kind}, {c.world_size} ranks, {c.dtype}",
            f"files   {size(c.total_bytes())}" + (f" ({size(model)} 16-bit model)" if model else ""),
            f"rank 0  {size(c.rank_bytes(0))}",
        ]
        summary = c.saved.summary(sum(not r.tied for r in c.rows))
        if summary:
            lines.append(summary)
    if outputs:  # tailor-tui's own outputs in the run folder: shown here, never as columns
        lines += ["", f"composed by tailor-tui here, not columns ({len(outputs)}):"]
        lines += [f"  {show(o.folder)} ← {', '.join(o.sources) or '?'}" for o in outputs]
    if problems:  # kept here, not only in a toast; thousands: the first ones (--stats warns of each)
        lines += ["", f"skipped while scanning ({len(problems)}):"]
        lines += [f"  {show(path)}: {why}" for path, why in problems[:PROBLEMS_LISTED]]
        if len(problems) > PROBLEMS_LISTED:
            lines.append(f"  … and {len(problems) - PROBLEMS_LISTED:,} more (tailor-tui --stats RUN_DIR names each)")
    return lines


def fit_title(parts: list[tuple[str, str]], room: int) -> str:
    """`label + path` parts joined by ` · `, their paths shortened from the left until the line fits
    `room`: first down to `…/` and their own names (the longest first), then further if need be."""
    paths = [shown(path) for _label, path in parts]
    floors = [min(len(p), len("…/" + p.rsplit("/", 1)[-1])) for p in paths]

    def line() -> str:
        return " · ".join(shown(label) + path for (label, _), path in zip(parts, paths))

    while (over := len(line()) - room) > 0:
        above = [i for i in range(len(paths)) if len(paths[i]) > floors[i]]
        if not above:  # every path at its own name: shorten the longest name itself
            floors = [min(f, 2) for f in floors]
            above = [i for i in range(len(paths)) if len(paths[i]) > floors[i]]
            if not above:
                break
        i = max(above, key=lambda j: len(paths[j]))
        keep = max(floors[i], len(paths[i]) - over) - 1  # what is left of it after "…"
        paths[i] = "…" + paths[i][-keep:]
    return line()
