"""Helpers the composer's pilot and snapshot tests share: a private copy of a real run,
waiting for the scan and the statistics, for a condition, what the terminal shows, and starting a
composition from the keyboard."""

from __future__ import annotations

import shutil
from pathlib import Path

from conftest import checkpoints_of

from tailor_tui.ui.dialogs import Confirm
from tailor_tui.ui.progress_screen import ProgressScreen


def private_copy(real_run, tmp_path: Path, name: str, folder: str = "run") -> tuple[Path, list[Path]]:
    """A copy of the real run `name` at `tmp_path/folder`, so outputs and recipes land beside it
    (the same folder name everywhere keeps snapshots alike), and its checkpoints, oldest first."""
    run, spec = real_run(name)
    dst = tmp_path / folder
    shutil.copytree(run, dst)
    return dst, checkpoints_of(dst, spec)


async def scanned(pilot):
    """The run is scanned and every row's statistics are in (the heatmap is drawn)."""
    await pilot.app.workers.wait_for_complete()
    await pilot.pause()
    for _ in range(1200):
        if pilot.app.home.health_pane.status is None:
            break
        await pilot.pause(0.05)
    await pilot.pause()
    assert pilot.app.home.draft is not None


async def curve_drawn(pilot):
    """The loss curve shows what was asked for last (it draws in a thread worker)."""
    from tailor_tui.ui.loss_curve import LossCurve

    curve = pilot.app.home.query_one(LossCurve)
    await pilot.pause()
    await wait_for(pilot, lambda: curve.up_to_date)
    await pilot.pause()
    return curve


async def scan_notices(pilot) -> list:
    """The notices shown once the scan is complete (read at once: each lasts 8 s)."""
    await wait_for(pilot, lambda: pilot.app.home.scan_result is not None, tries=2400)
    await pilot.pause()
    return list(pilot.app._notifications)


async def wait_for(pilot, condition, tries: int = 600):
    for _ in range(tries):
        if condition():
            return
        await pilot.pause(0.05)
    raise AssertionError("condition not reached")


def on_screen(app, widget=None) -> list[str]:
    """What the terminal shows now, a line of text each (no styles): the whole screen, or the part
    of it inside `widget`'s content region (what of the widget is scrolled into view, or a notice over it)."""
    lines = [strip.text for strip in app.screen._compositor.render_strips()]
    if widget is None:
        return lines
    region = widget.content_region
    return [line[region.x:region.right] for line in lines[region.y:region.bottom]]


def footer_keys(app) -> set[str]:
    """The names of the keys the footer shows now (those that work where the focus is)."""
    return {b.binding.description for b in app.screen.active_bindings.values() if b.binding.show and b.enabled}


async def compose_finished(pilot, tries: int = 600) -> None:
    """The progress screen (a composition or an export) ran to the end; Esc closes it."""
    await wait_for(pilot, lambda: isinstance(pilot.app.screen, ProgressScreen) and not pilot.app.screen.running, tries)
    assert pilot.app.screen.has_class("finished")
    await pilot.press("escape")


async def start_composing(pilot) -> ProgressScreen:
    """ctrl+r, accept the plan, and return the progress screen."""
    await pilot.press("ctrl+r")
    await wait_for(pilot, lambda: isinstance(pilot.app.screen, Confirm))
    await pilot.press("enter")
    await wait_for(pilot, lambda: isinstance(pilot.app.screen, ProgressScreen))
    return pilot.app.screen
