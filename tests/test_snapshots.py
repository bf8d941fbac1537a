"""Snapshots of the key screens (pytest-textual-snapshot): fixed size, no blink, fixed clock.

Update after an intended change with: pytest tests/test_snapshots.py --snapshot-update
"""

from __future__ import annotations

import os
import shutil

import pytest
from pilot_helpers import curve_drawn, private_copy, scanned, wait_for

from tailor_tui.events import TaskProgressed
from tailor_tui.ui.app import make_app
from tailor_tui.ui.dialogs import Confirm
from tailor_tui.ui.progress_screen import ComposeProgressed, ProgressScreen

SIZE = (130, 30)


@pytest.fixture
def snap_compare(snap_compare):
    """Every screen as it settles: the loss curve (drawn in a thread worker) shows what it was asked for."""

    def compare(app, run_before=None, **options):
        async def settled(pilot):
            if run_before is not None:
                await run_before(pilot)
            if pilot.app.home.draft is not None:
                await curve_drawn(pilot)

        return snap_compare(app, run_before=settled, **options)

    return compare


@pytest.fixture
def run(real_run, tmp_path):
    # the demo run (pinned: the numbers on the screens are the same on every CPU), at tmp_path/run everywhere
    return private_copy(real_run, tmp_path, "demo")[0]


@pytest.mark.parametrize("size", [SIZE, (200, 50), (80, 24)], ids=["130x30", "200x50", "80x24"])
def test_grid(snap_compare, run, size):
    async def pick_two(pilot):
        await scanned(pilot)
        await pilot.press("left", "down", "space", "down", "left", "space", "down")

    assert snap_compare(make_app(run), run_before=pick_two, terminal_size=size)


@pytest.mark.parametrize("size", [(200, 50), (80, 24)], ids=["200x50", "80x24"])
def test_loss_curve(snap_compare, run, size):
    """The run's loss (and grad norm, right axis) over steps, each checkpoint's step on the axis and ○
    on the curve, the cursor's (checkpoint-4, step 4) ● with a line across: beside the grid below the
    details at 200x50; at 80x24 in the details' place (c)."""

    async def on_checkpoint_4(pilot):
        await scanned(pilot)
        await pilot.press(*(["c"] if size == (80, 24) else []), "left")

    assert snap_compare(make_app(run), run_before=on_checkpoint_4, terminal_size=size)


def test_confirmation(snap_compare, run):
    async def confirm(pilot):
        await scanned(pilot)
        await pilot.press("left", "down", "down", "space")
        await pilot.pause()  # let the grid repaint before the dialog covers it
        await pilot.press("ctrl+r")
        await wait_for(pilot, lambda: isinstance(pilot.app.screen, Confirm))
        await pilot.pause()

    assert snap_compare(make_app(run), run_before=confirm, terminal_size=SIZE)


def test_batch_job_offer_at_80x24(snap_compare, run, tmp_path, monkeypatch):
    """A large plan on a login node: the plan dialog says so and offers `s` (Batch job)."""
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "sbatch").write_text("#!/bin/sh\nexit 1\n")
    (tmp_path / "bin" / "sbatch").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)

    async def review(pilot):
        await scanned(pilot)
        await pilot.press("ctrl+r")
        await wait_for(pilot, lambda: isinstance(pilot.app.screen, Confirm))
        await pilot.pause()

    assert snap_compare(make_app(run, batch_threshold=1), run_before=review, terminal_size=(80, 24))


def test_compose_screen_mid_progress(snap_compare, run):
    times = iter([100.0, 104.0, 104.0, 104.0, 104.0, 104.0, 104.0])

    async def mid_composition(pilot):
        await scanned(pilot)
        app = pilot.app
        from tailor_tui.planning.build import build_plan

        plan = build_plan(app.home.draft.to_recipe())
        screen = ProgressScreen(plan, workers=1, clock=lambda: next(times, 104.0), autostart=False,
                             title="Composing checkpoint-6-tailored")
        await app.push_screen(screen)
        (r0, t0), (r1, t1), (m, tm) = screen.tasks
        for event in (TaskProgressed(r0, t0 // 2, t0), TaskProgressed(r1, t1 // 4, t1), TaskProgressed(m, 0, tm)):
            screen.post_message(ComposeProgressed(event))
        await pilot.pause()

    assert snap_compare(make_app(run), run_before=mid_composition, terminal_size=SIZE)


def test_compose_screen_of_512_ranks_at_80x24(snap_compare, run):
    """A 512-GPU composition: bar rows for the ranks in progress only (a fixed number of them,
    handed on as ranks finish), a line of how many are done, in progress and waiting, the overall bar."""
    times = iter([100.0])

    async def mid_composition(pilot):
        await scanned(pilot)
        app = pilot.app
        from tailor_tui.planning.build import build_plan

        plan = build_plan(app.home.draft.to_recipe(), world_size=512)
        screen = ProgressScreen(plan, workers=1, clock=lambda: next(times, 112.0), autostart=False,
                               title="Composing checkpoint-6-tailored for 512 ranks")
        await app.push_screen(screen)
        ranks = [(name, total) for name, total in screen.tasks if name.startswith("rank ")]
        assert len(ranks) == 512 and len(screen.tasks) > len(ranks)  # and the model file
        for name, total in ranks[:400]:  # done
            screen.post_message(ComposeProgressed(TaskProgressed(name, 0, total)))
            screen.post_message(ComposeProgressed(TaskProgressed(name, total, total)))
        for i, (name, total) in enumerate(ranks[400:412]):  # in progress: more than there are rows
            screen.post_message(ComposeProgressed(TaskProgressed(name, total * (i + 1) // 13, total)))
        screen.post_message(ComposeProgressed(TaskProgressed(ranks[401][0], ranks[401][1], ranks[401][1])))
        await wait_for(pilot, lambda: screen.tally.finished == 401)
        await pilot.pause()

    assert snap_compare(make_app(run), run_before=mid_composition, terminal_size=(80, 24))


def test_grid_with_partial_checkpoints(snap_compare, real_run, tmp_path):
    """Selective checkpointing (HF Trainer callback): a full checkpoint and two parity partials;
    each partial column holds only its rows, every row picked from its newest holder."""
    src, _spec = real_run("hf_selective_parity")
    run = tmp_path / "run"
    shutil.copytree(src / "run", run)
    assert snap_compare(make_app(run), run_before=scanned, terminal_size=SIZE)


@pytest.mark.parametrize("size", [SIZE, (80, 24)], ids=["130x30", "80x24"])
def test_health_heatmap(snap_compare, real_run, tmp_path, size):
    """Row health: the blown layer's cells say NaN, the others are coloured by their change
    since the previous checkpoint (scaled per row); the details show the row across checkpoints."""
    run, _ckpts = private_copy(real_run, tmp_path, "ds_blown_up")

    async def on_blown_row(pilot):
        await scanned(pilot)
        await pilot.press("down", "down", "down", "left")  # on the blown row, the checkpoint before

    assert snap_compare(make_app(run), run_before=on_blown_row, terminal_size=size)


def test_help_at_80x24(snap_compare, run):
    async def help_open(pilot):
        await scanned(pilot)
        await pilot.press("question_mark")
        await pilot.pause()

    assert snap_compare(make_app(run), run_before=help_open, terminal_size=(80, 24))


# --- a model of real depth (80 layers) at 80x24 ---------------------------------------------------


@pytest.fixture
def deep_run(real_run, tmp_path):
    return private_copy(real_run, tmp_path, "hf_80_layers")[0]


async def _layers_40_to_59_from_checkpoint_2(pilot):
    await scanned(pilot)
    await pilot.press("slash")
    await wait_for(pilot, lambda: len(pilot.app.screen_stack) == 2)
    await pilot.press(*"layers.40", "enter")
    await wait_for(pilot, lambda: len(pilot.app.screen_stack) == 1)
    await pilot.press("v", *["down"] * 19, "left", "space", "v", "up", "up")  # a new selection started


def test_deep_grid_at_80x24(snap_compare, deep_run):
    """Scrolled to layers.40–59 picked as one block: names and headers stay, a selection shows."""
    assert snap_compare(make_app(deep_run), run_before=_layers_40_to_59_from_checkpoint_2, terminal_size=(80, 24))


def test_deep_plan_at_80x24(snap_compare, deep_run):
    """The plan of that pick: output and totals first, the block as one line."""

    async def review(pilot):
        await _layers_40_to_59_from_checkpoint_2(pilot)
        await pilot.press("escape", "ctrl+r")
        await wait_for(pilot, lambda: isinstance(pilot.app.screen, Confirm))
        await pilot.pause()

    assert snap_compare(make_app(deep_run), run_before=review, terminal_size=(80, 24))


# --- a vision-language model (24 vision, 28 language blocks): a header per stack --------------------


@pytest.mark.parametrize("size", [(200, 50), (80, 24)], ids=["200x50", "80x24"])
def test_vision_language_grid(snap_compare, real_run, tmp_path, size):
    """The vision stack folded into its header (every row from checkpoint-2), the language stack
    open under its own with layers.0–3 picked from checkpoint-2."""
    run = private_copy(real_run, tmp_path, "hf_llava_deep")[0]

    async def stacks(pilot):
        await scanned(pilot)
        await pilot.press("f", "left", "space", "down", "down", "v", "down", "down", "down", "space")

    assert snap_compare(make_app(run), run_before=stacks, terminal_size=size)
