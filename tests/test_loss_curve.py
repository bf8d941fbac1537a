"""The run's loss curve beside the grid (issue: the user deciding where to roll back wants the run's
curve, not one number per checkpoint): what is read of trainer_state.json, and the composer's curve
at 200x50 (beside the grid, below the details) and 80x24 (c: in the details' place), the checkpoints
marked, the cursor's highlighted as it moves; a DeepSpeed run says it has no training log."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
from pilot_helpers import curve_drawn, private_copy, scanned

from tailor_tui.health.healing import MAX_CURVE_POINTS, TrainingCurve, training_curve
from tailor_tui.kinds.folders import FOLDER_KINDS
from tailor_tui.ui.app import make_app
from tailor_tui.ui.describe import header_suffix
from tailor_tui.ui.dialogs import HelpScreen
from tailor_tui.ui.loss_curve import LossCurve, figure, y_ticks

WIDE, NARROW = (200, 50), (80, 24)


def _checkpoint(folder: Path, step: int, history: list | None, kind: str = "hf") -> SimpleNamespace:
    folder.mkdir(parents=True)
    if history is not None:
        (folder / "trainer_state.json").write_text(json.dumps({"log_history": history}))
    return SimpleNamespace(path=folder, step=step, folder=FOLDER_KINDS[kind])


# --- what is read ------------------------------------------------------------------------------


def test_the_curve_is_the_newest_checkpoints_log_and_every_checkpoints_step(tmp_path):
    """The newest checkpoint's log holds the whole run's: eval entries, non-finite losses and
    entries without a step are left out; a step logged twice keeps its last entry (a resume)."""
    old = _checkpoint(tmp_path / "checkpoint-2", 2, [{"step": 1, "loss": 9.0}])
    history = [{"step": 1, "loss": 3.0, "grad_norm": 1.5}, {"step": 2, "loss": 2.5},
               {"step": 2, "eval_loss": 7.0}, {"step": 3, "loss": float("nan"), "grad_norm": 2.0},
               {"loss": 1.0}, {"step": 4, "loss": 2.0, "grad_norm": 1.0}, {"step": 4, "loss": 1.9, "grad_norm": 0.9},
               "not an entry"]
    new = _checkpoint(tmp_path / "checkpoint-4", 4, history)
    curve = training_curve([old, new])
    assert curve.checkpoint_steps == (2, 4) and curve.logged and curve.log_read
    assert (curve.steps, curve.losses) == ((1, 2, 4), (3.0, 2.5, 1.9))
    assert (curve.grad_steps, curve.grad_norms) == ((1, 4), (1.5, 0.9))
    assert curve.loss_at(0) is None and curve.loss_at(3) == 2.5 and curve.grad_norm_at(3) == 1.5


def test_no_training_log_for_deepspeeds_layout_and_none_yet_for_an_empty_one(tmp_path):
    ds = [_checkpoint(tmp_path / f"global_step{s}", s, None, kind="deepspeed") for s in (2, 4)]
    curve = training_curve(ds)
    assert curve == TrainingCurve((2, 4)) and not curve.logged and not curve.log_read
    empty = training_curve([_checkpoint(tmp_path / "checkpoint-2", 2, [])])
    assert not empty.logged and empty.log_read


def test_a_long_log_is_thinned_to_means_keeping_its_last_step(tmp_path):
    n = MAX_CURVE_POINTS * 5 + 3
    history = [{"step": s, "loss": float(s % 2), "grad_norm": 1.0} for s in range(1, n + 1)]
    curve = training_curve([_checkpoint(tmp_path / "checkpoint-9", n, history)])
    assert len(curve.steps) <= MAX_CURVE_POINTS and curve.points_logged == n
    assert curve.steps[-1] == n and all(0.0 < loss < 1.0 for loss in curve.losses[:-1])
    assert curve.thinned(10).steps[-1] == n and len(curve.thinned(10).steps) <= 10


def test_y_axis_labels_are_even_one_row_each_never_skipping_a_step(tmp_path):
    """Issue 60 (9): at 80x24 the loss axis's labels skipped a step (6.10, 5.85, 5.61, 5.11: Plotext's own ticks
    rounded to rows). Each label now lies on a row of its own, the same number of rows apart, the values the same
    step apart, the lowest on the bottom row; the grad norm's axis likewise."""
    history = [{"step": s, "loss": (1190 - 2 * s) / 256 + (1.5 if s == 6 else 0), "grad_norm": 0.8 + s}
               for s in range(1, 7)]
    curve = training_curve([_checkpoint(tmp_path / "checkpoint-6", 6, history)])
    for height in range(8, 26):
        lines = re.sub(r"\x1b\[[0-9;]*m", "", figure(curve, 6, 70, height, "clear")).splitlines()
        plot = [i for i, line in enumerate(lines) if line[4:5] in ("┤", "│")]
        for side in ("left", "right"):
            at = {i: (lines[i][:4] if side == "left" else lines[i].rstrip().rsplit("├", 1)[1]).strip()
                  for i in plot if ("┤" in lines[i][:5] if side == "left" else "├" in lines[i][-8:])}
            rows, values = sorted(at), [float(at[i]) for i in sorted(at)]
            unit = 10.0 ** -len(at[rows[0]].partition(".")[2])  # the labels' last decimal
            assert len(rows) >= 3 and rows[-1] == plot[-1], (height, side, rows, plot)  # the lowest: the bottom
            assert len({b - a for a, b in zip(rows, rows[1:])}) == 1, (height, side, rows)
            steps = [a - b for a, b in zip(values, values[1:])]
            assert max(steps) - min(steps) <= 1.01 * unit, (height, side, values)  # rounded, the same step


def test_y_ticks_fit_the_rows_and_say_nothing_of_a_flat_line():
    for rows in range(2, 40):
        ticks, labels = y_ticks([4.617, 6.102], rows)
        at = [round((t - 4.617) / (6.102 - 4.617) * (rows - 1), 6) for t in ticks]
        assert all(a == int(a) for a in at) and at[0] == 0 and len(ticks) <= 7 and len(set(labels)) == len(labels)
    assert y_ticks([1.0, 1.0], 5) is None and y_ticks([], 5) is None and y_ticks([1.0, 2.0], 1) is None


# --- the composer --------------------------------------------------------------------------------


@pytest.fixture
def demo(real_run, tmp_path) -> Path:
    return private_copy(real_run, tmp_path, "demo")[0]  # HF layout, checkpoints at steps 2, 4, 6


def _shown(widget) -> bool:
    return widget.display and widget.region.area > 0 and all(a.display for a in widget.ancestors if hasattr(a, "display"))


async def _moves_with_the_cursor(pilot, curve: LossCurve) -> None:
    """The cursor starts on the base (step 6, the spike's); left, left, right: steps 4, 2, 4, each highlighted."""
    assert curve.cursor_step == 6 and "● step 6: loss 6.125 · grad 12" in curve.render().plain
    for key, step, loss in (("left", 4, "4.633"), ("left", 2, "4.641"), ("right", 4, "4.633")):
        await pilot.press(key)
        await curve_drawn(pilot)
        text = curve.render().plain
        assert curve.cursor_step == step and f"● step {step}: loss {loss}" in text, text
        assert text.count("●") == 2 and "○" in text  # the title's and the curve's; the other checkpoints'


async def test_the_curve_beside_the_grid_at_200x50(demo):
    app = make_app(demo)
    async with app.run_test(size=WIDE) as pilot:
        await scanned(pilot)
        curve = await curve_drawn(pilot)
        grid, details = app.query_one("#grid"), app.query_one("#details-panel")
        assert _shown(curve) and _shown(details) and curve.region.height >= 12
        assert curve.region.x > grid.region.right - 1 and curve.region.y > details.region.y  # beside, below the details
        # issue 60 (9): the side takes what the grid's checkpoints leave free (it left ~80 columns empty), up to 3/5
        assert grid.region.width - grid.virtual_size.width <= 20 and details.region.width >= 100, (grid.region,
                                                                                                   details.region)
        assert curve.region.width >= 100
        assert curve.marks == [(2, 4.640625), (4, 4.6328125), (6, 6.125)]  # the spike at 6
        health = app.home.health_pane.health
        headers = [header_suffix(health, column) for column in range(3)]  # the demo tells its spike
        assert headers == [" · 4.64", " · 4.63", " · 6.12 ▲"], headers
        text = curve.render().plain
        assert "loss" in text and "grad norm" in text and "step" in text
        axis = next(line for line in text.splitlines() if line.strip().split() == ["2", "4", "6"])
        assert axis  # each checkpoint's step on the axis
        await _moves_with_the_cursor(pilot, curve)
        await pilot.press("c")  # hidden: the details take the column
        await pilot.pause()
        assert not _shown(curve) and details.region.height > 40
        await pilot.press("c")
        await curve_drawn(pilot)
        assert _shown(curve)


async def test_the_curve_in_the_details_place_at_80x24(demo):
    app = make_app(demo)
    async with app.run_test(size=NARROW) as pilot:
        await scanned(pilot)
        curve, details, grid = app.query_one(LossCurve), app.query_one("#details-panel"), app.query_one("#grid")
        assert not _shown(curve) and _shown(details)
        footer = {b.binding.description for b in app.screen.active_bindings.values() if b.binding.show}
        assert "Curve" in footer  # how to show it, at 80 columns
        await pilot.press("c")
        await curve_drawn(pilot)
        assert _shown(curve) and not _shown(details) and curve.region.height >= 10
        assert grid.region.height >= 9 and grid.row_count == 7  # the grid's header and every row still show
        assert curve.marks == [(2, 4.640625), (4, 4.6328125), (6, 6.125)]  # the spike at 6
        await _moves_with_the_cursor(pilot, curve)
        await pilot.press("d")  # taller
        await curve_drawn(pilot)
        assert curve.region.height > 12
        await pilot.press("d", "c")
        await pilot.pause()
        assert _shown(details) and not _shown(curve)


@pytest.mark.parametrize("size", [WIDE, NARROW], ids=["200x50", "80x24"])
async def test_a_deepspeed_run_says_it_has_no_training_log(real_run, tmp_path, size):
    run = private_copy(real_run, tmp_path, "ds_blown_up")[0]
    app = make_app(run)
    async with app.run_test(size=size) as pilot:
        await scanned(pilot)
        if size == NARROW:
            await pilot.press("c")
        curve = await curve_drawn(pilot)
        assert _shown(curve) and not curve.curve.logged and curve.marks == []
        assert "no training log" in curve.render().plain and curve.region.height <= 6  # its line, no more room


async def test_help_says_how_to_show_the_curve(demo):
    app = make_app(demo)
    async with app.run_test(size=NARROW) as pilot:
        await scanned(pilot)
        await pilot.press("question_mark")
        await pilot.pause()
        assert isinstance(app.screen, HelpScreen)
        assert "c: loss curve" in " ".join(str(w.render()) for w in app.screen.query(".help-body"))
