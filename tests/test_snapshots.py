"""Snapshots of the key screens (pytest-textual-snapshot): fixed size, no blink, fixed clock.

Update after an intended change with: pytest tests/test_snapshots.py --snapshot-update
"""

from __future__ import annotations

import shutil

import pytest

from tailor_tui.events import TaskProgressed
from tailor_tui.ui.app import make_app
from tailor_tui.ui.dialogs import Confirm
from tailor_tui.ui.merge_screen import MergeProgressed, MergeScreen

SIZE = (130, 30)


@pytest.fixture
def run(real_run, tmp_path):
    src, spec = real_run("hf_bf16_2")
    dst = tmp_path / "run"  # the same name everywhere, so the screens are the same
    shutil.copytree(src, dst)
    return dst


async def scanned(pilot):
    """The run is scanned and every row's statistics are in (the heatmap is drawn)."""
    await pilot.app.workers.wait_for_complete()
    await pilot.pause()
    for _ in range(1200):
        if pilot.app.health_status is None:
            break
        await pilot.pause(0.05)
    await pilot.pause()


@pytest.mark.parametrize("size", [SIZE, (200, 50), (80, 24)], ids=["130x30", "200x50", "80x24"])
def test_grid(snap_compare, run, size):
    async def pick_two(pilot):
        await scanned(pilot)
        await pilot.press("left", "down", "space", "down", "left", "space", "down")

    assert snap_compare(make_app(run), run_before=pick_two, terminal_size=size)


def test_confirmation(snap_compare, run):
    async def confirm(pilot):
        await scanned(pilot)
        await pilot.press("left", "down", "down", "space")
        await pilot.pause()  # let the grid repaint before the dialog covers it
        await pilot.press("ctrl+r")
        for _ in range(200):
            if isinstance(pilot.app.screen, Confirm):
                break
            await pilot.pause(0.05)
        await pilot.pause()

    assert snap_compare(make_app(run), run_before=confirm, terminal_size=SIZE)


def test_merge_screen_mid_progress(snap_compare, run):
    times = iter([100.0, 104.0, 104.0, 104.0, 104.0, 104.0, 104.0])

    async def mid_merge(pilot):
        await scanned(pilot)
        app = pilot.app
        from tailor_tui.plan import build_plan

        plan = build_plan(app.composition.to_recipe())
        screen = MergeScreen(plan, workers=1, clock=lambda: next(times, 104.0), autostart=False,
                             title="Composing checkpoint-6-tailored")
        await app.push_screen(screen)
        (r0, t0), (r1, t1), (m, tm) = screen.tasks
        for event in (TaskProgressed(r0, t0 // 2, t0), TaskProgressed(r1, t1 // 4, t1), TaskProgressed(m, 0, tm)):
            screen.post_message(MergeProgressed(event))
        await pilot.pause()

    assert snap_compare(make_app(run), run_before=mid_merge, terminal_size=SIZE)


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
    src, _spec = real_run("ds_blown_up")
    run = tmp_path / "run"
    shutil.copytree(src, run)

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
