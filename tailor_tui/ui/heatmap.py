"""How row health looks in the composer: cell colours, column headers, the details block.

Pure functions of the composition's Health (no widgets): the grid and the details panel
call them. A metric's colours are scaled per row, so one layer's outlier stands out.
"""

from __future__ import annotations

from tailor_tui.checkpoints.checkpoint import Checkpoint
from tailor_tui.health.healing import METRICS, Cell, Health, damage_text, why_unhealthy

# low → high: dark blue, teal, olive, amber, red (readable with the cells' light text)
PALETTE = ("#1f3a5f", "#1f5f5b", "#5f5f1f", "#8a5a12", "#9e2a2b")
LABEL = {"rel_change": "Δ since previous", "weight_rms": "weight RMS", "adam_v_max": "Adam v max"}
LOSS_JUMP = 1.2  # a loss this many times the previous checkpoint's is marked


def row_range(health: Health | None, row: str, metric: str) -> tuple[float, float] | None:
    """(lowest, highest) value of `metric` in `row` across checkpoints, or None."""
    if health is None:
        return None
    values = [v for c in health.row_cells(row).values() if (v := c.value(metric)) is not None]
    return (min(values), max(values)) if values else None


def background(cell: Cell | None, metric: str, scale: tuple[float, float] | None) -> str:
    """The cell's background style for `metric` ("" when there is nothing to show)."""
    if cell is None or scale is None or cell.value(metric) is None:
        return ""
    lo, hi = scale
    t = 0.5 if hi <= lo else (cell.value(metric) - lo) / (hi - lo)
    return f" on {PALETTE[min(len(PALETTE) - 1, int(t * len(PALETTE)))]}"


def header_suffix(health: Health | None, column: int) -> str:
    """` · loss 4.62` (and ▲ where it jumped from the previous checkpoint's), or ""."""
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


def cell_block(health: Health | None, row: str, column: int | None, computing: str | None) -> list[str]:
    """The cell under the cursor: the checkpoint's loss, then the row's statistics there."""
    lines = [f"health  {computing}"] if computing else []
    if health is None or column is None:
        return lines
    log = health.logs.get(column)
    if log is not None and log.loss is not None:
        grad = f" · grad {log.grad_norm:.3g}" if log.grad_norm is not None else ""
        lines.append(f"loss    {log.loss:.4g}{grad}")
    return lines + [f"{'cell' if i == 0 else '':<8}{text}" for i, text in enumerate(cell_lines(health.cell(row, column)))]


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
    return "—" if x is None else f"{x:.2%}"
