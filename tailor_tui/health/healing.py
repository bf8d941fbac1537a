"""The health of every row in every checkpoint, and the rule that heals a composition.

Plain data and rules, shared by `--stats`, `--heal`, the `--apply` guard and the composer:
a cell (row × checkpoint) is healthy when its optimizer state holds no NaN/Inf and every
record it lies in passes its CRC-32 check. `stats_run` computes the cells.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Sequence

from tailor_tui.checkpoints.checkpoint import Checkpoint
from tailor_tui.checkpoints.lineage import RESTART, log_entries, logged_at, logged_number

METRICS = ("rel_change", "weight_rms", "adam_v_max")  # what the composer's heatmap can show
MAX_CURVE_POINTS = 2000  # a training curve's points: a longer log is thinned to about this many (a plot's width)
CURVE_LOGS_TRIED = 3  # checkpoints whose trainer_state.json a curve is looked for in, newest first


@dataclass(frozen=True)
class Cell:
    """One row's statistics in one checkpoint (see docs/health.md)."""

    nonfinite: int  # NaN/±Inf elements in fp32 masters, exp_avg, exp_avg_sq, frozen fragments
    weight_rms: float | None  # sqrt(mean(θ²)) of the fp32 masters; None if any value is non-finite
    adam_v_max: float | None  # max of exp_avg_sq
    rel_change: float | None  # ||θ − θ_prev|| / ||θ_prev|| against the nearest earlier checkpoint
    crc_ok: bool = True  # every record the row's slices lie in passed its CRC-32 check
    error: str | None = None  # the checkpoint's files of this row could not be read at all

    @property
    def healthy(self) -> bool:
        return self.nonfinite == 0 and self.crc_ok and self.error is None

    def value(self, metric: str) -> float | None:
        return getattr(self, metric)

    def to_json(self) -> list:
        """A readable cell's values (a cell with an error is never cached)."""
        return [self.nonfinite, self.weight_rms, self.adam_v_max, self.rel_change, self.crc_ok]

    @classmethod
    def from_json(cls, values: list) -> "Cell":
        """The cell `to_json` wrote; ValueError or TypeError for anything else (a cache entry is an input)."""
        nonfinite, weight_rms, adam_v_max, rel_change, crc_ok = values
        if not (type(nonfinite) is int and nonfinite >= 0 and type(crc_ok) is bool
                and all(v is None or type(v) in (int, float) for v in (weight_rms, adam_v_max, rel_change))):
            raise ValueError("not a cell")
        return cls(nonfinite, _number(weight_rms), _number(adam_v_max), _number(rel_change), crc_ok)


@dataclass(frozen=True)
class TrainingLog:
    """What the trainer logged at a checkpoint's step (HF layout; None where nothing was)."""

    loss: float | None = None
    grad_norm: float | None = None
    note: str | None = None  # what of its trainer_state.json was ignored (a number past 64 bits, the file)


@dataclass(frozen=True)
class TrainingCurve:
    """The run's training loss over steps (and the grad norm where it was logged), as the newest
    checkpoint's trainer_state.json holds it (its log_history holds the whole run's), and each
    checkpoint's step: what the composer plots. No steps: no training log (DeepSpeed's layout)."""

    checkpoint_steps: tuple[int, ...]
    steps: tuple[int, ...] = ()
    losses: tuple[float, ...] = ()
    grad_steps: tuple[int, ...] = ()
    grad_norms: tuple[float, ...] = ()
    points_logged: int = 0  # losses in the log (more than `steps` where a long log was thinned)
    log_read: bool = False  # a checkpoint's trainer_state.json was read (it may log no loss yet)

    @property
    def logged(self) -> bool:
        return bool(self.steps)

    def loss_at(self, step: int) -> float | None:
        """The loss logged at `step`, or last before it (None before the first)."""
        i = bisect_right(self.steps, step)
        return self.losses[i - 1] if i else None

    def grad_norm_at(self, step: int) -> float | None:
        i = bisect_right(self.grad_steps, step)
        return self.grad_norms[i - 1] if i else None

    def thinned(self, most: int) -> TrainingCurve:
        """The curve in at most `most` points of each line: each the mean of a run of consecutive
        points, at the run's last step (a long, noisy log reads as its trend)."""
        if len(self.steps) <= most and len(self.grad_steps) <= most:
            return self
        steps, losses = _means(self.steps, self.losses, most)
        grad_steps, grad_norms = _means(self.grad_steps, self.grad_norms, most)
        return replace(self, steps=steps, losses=losses, grad_steps=grad_steps, grad_norms=grad_norms)


def _means(steps: tuple[int, ...], values: tuple[float, ...], most: int) -> tuple[tuple[int, ...], tuple[float, ...]]:
    n = len(steps)
    if n <= most:
        return steps, values
    k = -(-n // max(1, most))
    runs = range(0, n, k)
    return (tuple(steps[min(i + k, n) - 1] for i in runs),
            tuple(math.fsum(values[i:i + k]) / len(values[i:i + k]) for i in runs))


@dataclass
class Health:
    """Cells of a scanned run: {(row, checkpoint index): Cell}, filled in as they are computed."""

    checkpoints: tuple[Checkpoint, ...]
    cells: dict[tuple[str, int], Cell] = field(default_factory=dict)
    logs: dict[int, TrainingLog] = field(default_factory=dict)
    by_row: dict[str, dict[int, Cell]] = field(default_factory=dict, repr=False)  # row -> {column: Cell}

    def __post_init__(self) -> None:
        for (row, column), cell in self.cells.items():
            self.by_row.setdefault(row, {})[column] = cell

    def add(self, column: int, cells: dict[str, Cell]) -> None:
        """Checkpoint `column`'s cells, {row: Cell}."""
        for row, cell in cells.items():
            self.cells[row, column] = cell
            self.by_row.setdefault(row, {})[column] = cell

    def cell(self, row: str, column: int) -> Cell | None:
        return self.cells.get((row, column))

    def row_cells(self, row: str) -> dict[int, Cell]:
        return self.by_row.get(row, {})

    def rows(self) -> list[str]:
        """Every row with weights of its own, in the newest checkpoint's order."""
        names: list[str] = []
        for ckpt in reversed(self.checkpoints):
            names += [r.name for r in ckpt.rows if not r.tied and r.name not in names]
        return names

    def to_json(self) -> dict:
        """The `--stats --json` document."""
        return {
            "checkpoints": [{"name": c.name, "path": str(c.path), "step": c.step,
                             "loss": self.logs.get(i, TrainingLog()).loss,
                             "grad_norm": self.logs.get(i, TrainingLog()).grad_norm}
                            for i, c in enumerate(self.checkpoints)],
            "rows": self.rows(),
            "cells": [{"row": row, "checkpoint": str(self.checkpoints[i].path), "nonfinite": c.nonfinite,
                       "weight_rms": c.weight_rms, "adam_v_max": c.adam_v_max, "rel_change": c.rel_change,
                       "crc_ok": c.crc_ok, **({"error": c.error} if c.error else {})}
                      for (row, i), c in sorted(self.cells.items(), key=lambda item: (item[0][1], item[0][0]))],
        }


@dataclass(frozen=True)
class Healing:
    """What healing picks: {row: checkpoint index}, why, and the rows nothing can heal."""

    picks: dict[str, int]
    reasons: dict[str, str]  # row -> why its newest checkpoint is passed over
    hopeless: tuple[str, ...]  # rows with no healthy checkpoint at all


def heal(health: Health, rows: list[str], usable=lambda column: True) -> Healing:
    """The one healing rule (the composer's `h`, `--heal`): every row from the newest `usable`
    checkpoint whose cell for it is healthy (finite, passing its CRC checks). Outliers in
    rel_change are not skipped: a big move is not damage."""
    picks, reasons, hopeless = {}, {}, []
    for row in rows:
        cells = health.row_cells(row)
        holders = [i for i in sorted(cells, reverse=True) if usable(i)]
        choice = next((i for i in holders if cells[i].healthy), None)
        if choice is None:
            hopeless.append(row)
            continue
        picks[row] = choice
        passed = holders[: holders.index(choice)]
        if passed:
            reasons[row] = "; ".join(f"{health.checkpoints[i].name}: {why_unhealthy(cells[i])}"
                                     for i in passed)
    return Healing(picks, reasons, tuple(hopeless))


def damage(cell: Cell | None) -> str | None:
    """What is wrong with a cell in one mark, worst first: `ERR` (unreadable), `CRC` (a record
    fails its CRC-32 check), `NaN` (non-finite values); None for a healthy or unknown cell.
    The grid, its details and the --stats table all mark cells with it."""
    if cell is None or cell.healthy:
        return None
    if cell.error:
        return "ERR"
    return "CRC" if not cell.crc_ok else "NaN"


def damage_text(cell: Cell) -> str:
    """`✗ NaN×5,120` (`✗ NaN×1.23e+09` past a million), `✗ CRC`, `✗ ERR`: the count only where
    every value was read and checked."""
    n = cell.nonfinite
    count = (f"×{n:,}" if n < 1_000_000 else f"×{n:.2e}") if n and cell.crc_ok and not cell.error else ""
    return f"✗ {damage(cell)}{count}"


def numbers(cell: Cell) -> str:
    """`0.0213 Δ0.41%`: a cell's weight RMS and relative change, as `--stats` prints them and the
    composer's widest cells show them; what is wrong with it (`damage_text`) where it is not healthy."""
    if not cell.healthy:
        return damage_text(cell)
    rms = "—" if cell.weight_rms is None else f"{cell.weight_rms:.3g}"
    change = "" if cell.rel_change is None else f" Δ{percent(cell.rel_change)}"
    return rms + change


def percent(x: float) -> str:
    """A relative change in a few characters: `0.41%`, `12%`, `15.3×`."""
    return f"{x:.2%}" if x < 0.1 else f"{x:.0%}" if x < 10 else f"{x:.3g}×"


def why_unhealthy(cell: Cell) -> str:
    if cell.error:
        return f"unreadable ({cell.error})"
    if not cell.crc_ok:
        return "a record fails its CRC-32 check"
    if cell.nonfinite:
        return f"{cell.nonfinite:,} non-finite value(s)"
    return "healthy"


def training_log(ckpt: Checkpoint) -> TrainingLog:
    """The loss and grad norm logged at (or last before) `ckpt`'s step, from an HF checkpoint's
    trainer_state.json, and what of it was ignored; nothing for the DeepSpeed layout or a file
    that cannot be read (`lineage.logged_at`: read once for the run's lineage and this)."""
    logged = logged_at(ckpt)
    return TrainingLog(logged.loss, logged.grad_norm, logged.note)


def training_curve(checkpoints: Sequence[Checkpoint]) -> TrainingCurve:
    """The run's curve from the newest checkpoint with a training log (HF layout: its
    trainer_state.json, read bounded; the next newest where one cannot be read, a few at most):
    every finite loss logged by step (a step logged twice: its last entry, as after a resume), the
    grad norm beside it where logged, thinned to MAX_CURVE_POINTS (means of runs of steps). Nothing
    for DeepSpeed's or Accelerate's layout."""
    marks = tuple(c.step for c in checkpoints if c.step is not None)  # (a DCP folder not named by its step)
    points: dict[int, tuple[float, float | None]] = {}
    read = False
    newest = sorted((c for c in checkpoints if c.folder.training_log), key=lambda c: c.step, reverse=True)
    for ckpt in newest[:CURVE_LOGS_TRIED]:
        found = _curve_points(Path(ckpt.path))
        read = read or found is not None
        points = found or {}
        if points:
            break
    logged = sorted(points.items())
    grads = [(s, g) for s, (_loss, g) in logged if g is not None]
    return TrainingCurve(marks, tuple(s for s, _ in logged), tuple(v for _, (v, _g) in logged),
                         tuple(s for s, _ in grads), tuple(g for _, g in grads), len(logged),
                         read).thinned(MAX_CURVE_POINTS)


def _curve_points(folder: Path) -> dict[int, tuple[float, float | None]] | None:
    """{step: (loss, grad norm)} of every finite loss the log of `folder` holds; None where it
    cannot be read (or there is none)."""
    points: dict[int, tuple[float, float | None]] = {}
    try:
        for entry in log_entries(folder):
            if entry is RESTART:  # the log history given twice: the last counts
                points = {}
            elif isinstance(entry, dict) and type(step := entry.get("step")) is int \
                    and (loss := logged_number(entry.get("loss"))) is not None and math.isfinite(loss):
                grad = logged_number(entry.get("grad_norm"))
                points[step] = (loss, grad if grad is not None and math.isfinite(grad) else None)
    except (OSError, ValueError):
        return None
    return points


def _number(value) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def rms(sumsq: float, count: int) -> float | None:
    return math.sqrt(sumsq / count) if count else None
