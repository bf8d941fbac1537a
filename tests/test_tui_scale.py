"""The composer on a model of real depth (80 layers) in an 80x24 terminal, keyboard only:
what a recovery session on a login node does (issue: the composer at real model scale)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
from pilot_helpers import compose_finished, footer_keys, on_screen, private_copy, scanned, start_composing, wait_for
from zero_reader import read_full_state

from tailor_tui.ui.app import make_app
from tailor_tui.ui.dialogs import Confirm, PathPrompt

TERMINAL = (80, 24)


@pytest.fixture
def deep_run(real_run, tmp_path) -> tuple[Path, list[Path]]:
    return private_copy(real_run, tmp_path, "hf_80_layers")


def line(grid, y: int) -> str:
    return grid.render_line(y).text


async def test_pick_layers_40_to_59_review_compose_and_reopen_at_80x24(deep_run):
    run, (c2, c4) = deep_run
    app = make_app(run, workers=1)
    async with app.run_test(size=TERMINAL) as pilot:
        await scanned(pilot)
        grid = app.query_one("#grid")
        names = [r.name for r in app.home.draft.rows]
        assert len(names) == 83 and app.home.draft.base_checkpoint.path == c4
        footer = {b.binding.description for b in app.screen.active_bindings.values() if b.binding.show}
        assert {"Compose", "Save", "Help", "Quit"} <= footer
        panel = app.query_one("#details-panel")  # the details' scroll: what of them shows
        health = next(i for i, text in enumerate(app.home.details_text.splitlines()) if "Δ since previous" in text)
        short = panel.content_size.height
        assert health >= short  # below the grid at 80 columns, the row's health is out of view
        await pilot.press("d")  # d gives the details room for it
        await pilot.pause()
        assert panel.content_size.height > health
        await pilot.press("d")
        await pilot.pause()
        assert panel.content_size.height == short

        await pilot.press("slash")  # jump to layers.40 by name
        await wait_for(pilot, lambda: isinstance(app.screen, PathPrompt))
        await pilot.press(*"layers.40", "enter")
        await wait_for(pilot, lambda: len(app.screen_stack) == 1)
        assert grid.cursor_coordinate.row == names.index("layers.40")
        assert grid.scroll_y > 0  # scrolled down to it, the header and the names still in view
        assert "row" in line(grid, 0) and "checkpoint-2" in line(grid, 0) and "checkpoint-4" in line(grid, 0)

        await pilot.press("v", *["down"] * 19, "left", "space")  # one selection, one action
        picked = {f"layers.{i}": c2 for i in range(40, 60)}
        assert app.home.draft.to_recipe().layers == picked
        assert any(line(grid, y).lstrip().startswith("layers.59") for y in range(2, grid.size.height))
        await pilot.press("u")  # one undo step takes the whole block back
        assert app.home.draft.to_recipe().layers == {}
        await pilot.press("ctrl+y")
        assert app.home.draft.to_recipe().layers == picked

        await pilot.press("ctrl+r")  # the plan: totals first, then the block as one line
        await wait_for(pilot, lambda: isinstance(app.screen, Confirm))
        body = app.screen.body
        assert body.index("write:") < body.index("layers.40–59")
        assert "layers.40–59  ← checkpoint-2" in body and "(20 of 83)" in body
        assert "layers.39" not in body and "layers.60" not in body
        await pilot.press("escape")
        await start_composing(pilot)
        await compose_finished(pilot, tries=2400)
        await pilot.pause()

    out = run / "checkpoint-4-tailored"
    got, old, new = read_full_state(out), read_full_state(c2), read_full_state(c4)
    for key in ("fp32", "exp_avg", "exp_avg_sq"):
        for layer, source in ((39, new), (40, old), (59, old), (60, new)):
            name = f"model.layers.{layer}.mlp.up_proj.weight"
            assert torch.equal(got[key][name], source[key][name]), (key, name)

    app = make_app(run)  # reopened: the output is not a column, and the next one is a sibling
    async with app.run_test(size=TERMINAL) as pilot:
        await scanned(pilot)
        assert [c.path for c in app.home.draft.checkpoints] == [c2, c4]
        assert app.home.draft.output == run / "checkpoint-4-tailored-2"


async def test_the_plan_scrolls_from_the_keyboard(deep_run):
    """Every other row from the older checkpoint: 42 lines of plan, longer than the terminal;
    the keys scroll it while the focus stays on its buttons."""
    run, (c2, c4) = deep_run
    app = make_app(run)
    async with app.run_test(size=TERMINAL) as pilot:
        await scanned(pilot)
        await pilot.press("g", "left", *["space", "down", "down"] * 42)
        layers = app.home.draft.to_recipe().layers
        assert len(layers) == 42 and "layers.1" in layers and "layers.2" not in layers
        await pilot.press("ctrl+r")
        await wait_for(pilot, lambda: isinstance(app.screen, Confirm))
        assert "(42 of 83)" in app.screen.body
        scroller = app.screen.query_one(".dialog-scroll")
        assert scroller.max_scroll_y > 0 and scroller.scroll_y == 0
        await pilot.press("pagedown")
        await pilot.pause()
        assert scroller.scroll_y > 0
        await pilot.press("escape")
        await pilot.pause()
        assert app.home.draft.to_recipe().layers == layers  # declined: nothing composed, picks kept


# --- the details panel: all of it within reach from the keyboard ---------------------------------


@pytest.mark.parametrize("size", [(80, 24), (200, 50)], ids=["80x24", "200x50"])
async def test_tab_scrolls_the_details_panel_to_its_last_line(deep_run, size):
    """Details longer than their panel at any size (21 saves cut short, listed last): tab focuses the
    panel (its border lights up, the footer says Grid), the arrows, pgdn, end scroll it to its last
    line, Esc / tab / Enter come back to the grid, where the keys pick and move as ever; the screen's
    keys (d, c, a pick) work from the panel too; a move of the cursor keeps the panel where it was read
    unless the row changes (its details from the top)."""
    run, (c2, c4) = deep_run
    for step in range(8, 50, 2):  # each without a rank's optimizer file: skipped, named in the details
        broken = run / f"checkpoint-{step}"
        shutil.copytree(c2, broken, copy_function=os.link)
        next(broken.rglob("*rank_1_mp_rank_00_optim_states.pt")).unlink()
    app = make_app(run)
    async with app.run_test(size=size) as pilot:
        await scanned(pilot)
        app.clear_notifications()  # the notice of the skipped folders would cover the panel's corner
        await pilot.pause()
        grid, panel, comp = app.query_one("#grid"), app.query_one("#details-panel"), app.home.draft
        last = "names each)"  # "  … and 1 more (tailor-tui --stats RUN_DIR names each)", wrapped or not
        assert app.home.details_text.endswith(last) and "skipped while scanning (21):" in app.home.details_text
        assert app.focused is grid and panel.max_scroll_y > 0 and "Details" in footer_keys(app)
        assert on_screen(app)[-1].startswith(" tab Details ")  # the footer names it, at 80 columns too
        assert not any(last in line for line in on_screen(app))  # cut by the panel
        border = panel.parent.styles.border_top if size == (80, 24) else panel.parent.styles.border_left

        await pilot.press("tab")
        await pilot.pause()
        assert app.focused is panel and "Grid" in footer_keys(app) and "Details" not in footer_keys(app)
        assert on_screen(app)[-1].startswith(" esc Grid ")
        lit = panel.parent.styles.border_top if size == (80, 24) else panel.parent.styles.border_left
        assert lit != border  # the focus shows
        await pilot.press("down")
        await wait_for(pilot, lambda: panel.scroll_y == 1)
        await pilot.press("pagedown")
        await wait_for(pilot, lambda: panel.scroll_y > 2)
        await pilot.press("end")
        await wait_for(pilot, lambda: panel.scroll_y == panel.max_scroll_y)
        await pilot.pause()
        shown = on_screen(app, panel)
        assert last in shown[-1], shown  # the details' last line, on the screen
        assert any("checkpoint-48" in line for line in shown)  # the last folder listed
        assert not comp.to_recipe().layers  # the scroll keys picked nothing, moved no cursor
        assert grid.current() == ("embed_tokens", 1)

        await pilot.press("escape")  # back to the grid: the panel stays where it was read
        await pilot.pause()
        assert app.focused is grid and panel.scroll_y == panel.max_scroll_y
        await pilot.press("left", "space")  # the same row: a pick, the panel kept
        await pilot.pause()
        assert comp.to_recipe().layers == {"embed_tokens": c2} and panel.scroll_y == panel.max_scroll_y
        await pilot.press("down")  # another row: its details from the top
        await pilot.pause()
        assert grid.current() == ("layers.0", 0) and panel.scroll_y == 0

        await pilot.press("tab", "enter")  # Enter in the panel goes back to the grid, picking nothing
        await pilot.pause()
        assert app.focused is grid and comp.to_recipe().layers == {"embed_tokens": c2}
        await pilot.press("tab", "shift+tab")
        await pilot.pause()
        assert app.focused is grid
        await pilot.press("tab", "a")  # the screen's keys work from the panel: a picks the cursor's column
        await pilot.pause()
        assert app.focused is panel and set(comp.to_recipe().layers.values()) == {c2}
        await pilot.press("u")
        await pilot.pause()
        assert comp.to_recipe().layers == {"embed_tokens": c2}

        if size == (80, 24):  # d: taller, still focused; c: the curve in its place, the grid takes the focus
            await _taller_to_the_end(pilot, app, panel, "d", last)
            await pilot.press("d", "c")
            await pilot.pause()
            assert not panel.display and app.focused is grid and "Details" not in footer_keys(app)
            assert "tab Details" not in on_screen(app)[-1]
            await pilot.press("tab")  # nothing to go into
            await pilot.pause()
            assert app.focused is grid
            await pilot.press("c", "tab")
            await pilot.pause()
            assert app.focused is panel
        else:  # c hides the curve: the panel takes the column, focused still
            await _taller_to_the_end(pilot, app, panel, "c", last)
        await pilot.press("escape", "down", "space")  # picks work on the grid as before
        await pilot.pause()
        assert app.focused is grid and comp.to_recipe().layers == {"embed_tokens": c2, "layers.1": c2}


# --- a vision-language model: 24 vision and 28 language blocks, a header per stack ---------------


@pytest.mark.parametrize("size", [(80, 24), (200, 50)], ids=["80x24", "200x50"])
async def test_a_vision_language_models_stacks_fold_and_pick_as_blocks(real_run, tmp_path, size):
    """Each stack under its header (vision first, then language), foldable with f; a pick on a
    folded stack picks its every row as one undo step; a range pick inside the language stack;
    a jump by name into a folded stack unfolds it; the recipe names rows by their short names."""
    run, (c2, c4) = private_copy(real_run, tmp_path, "hf_llava_deep")
    app = make_app(run, workers=1)
    async with app.run_test(size=size) as pilot:
        await scanned(pilot)
        grid, comp = app.query_one("#grid"), app.home.draft
        names = [r.name for r in comp.rows]
        assert names[:3] == ["vision.embeddings", "vision.pre_layrnorm", "vision.layers.0"]
        assert "vision.layers.23" in names and "layers.27" in names and names[-1] == "lm_head"
        assert sum(n.startswith("vision.layers.") for n in names) == 24
        assert sum(n.startswith("layers.") for n in names) == 28
        assert line(grid, 2).lstrip().startswith("▾ vision · 28 rows")  # the vision stack's header first
        assert line(grid, 3).lstrip().startswith("vision.embeddings")

        await pilot.press("f")  # fold the vision stack: the language stack's header comes next
        await pilot.pause()
        assert line(grid, 2).lstrip().startswith("▸ vision · 28 rows")
        assert line(grid, 3).lstrip().startswith("▾ language · 31 rows")
        assert line(grid, 4).lstrip().startswith("embed_tokens")
        await pilot.press("left", "space")  # on the folded header: every vision row from checkpoint-2
        vision = {n: c2 for n in names if comp.base_checkpoint.row(n).group == "vision"}
        assert comp.to_recipe().layers == vision and len(vision) == 28
        assert "● 28" in line(grid, 2)
        details = app.query_one("#details").render().plain
        assert "stack   vision · 28 rows" in details and "checkpoint-2: 28 rows" in details
        await pilot.press("u")  # one undo step
        assert comp.to_recipe().layers == {}

        await pilot.press("down")  # past the open stack's header, onto its first row
        assert grid.current()[0] == "embed_tokens"
        await pilot.press("down", "v", *["down"] * 9, "space")  # layers.0–9 of the language stack
        assert comp.to_recipe().layers == {f"layers.{i}": c2 for i in range(10)}
        await pilot.press("up")  # back up: the language header is passed over to the folded vision
        await pilot.press(*["up"] * 12)
        assert grid.current()[0] == "vision.embeddings" and line(grid, 2).lstrip().startswith("▸ vision")

        await pilot.press("slash")  # a jump into the folded stack unfolds it
        await wait_for(pilot, lambda: isinstance(app.screen, PathPrompt))
        await pilot.press(*"vision.layers.20", "enter")
        await wait_for(pilot, lambda: len(app.screen_stack) == 1)
        assert grid.current()[0] == "vision.layers.20"
        assert any(line(grid, y).lstrip().startswith("vision.layers.20") for y in range(3, grid.size.height))
        await pilot.press("space")
        assert comp.to_recipe().layers == {**{f"layers.{i}": c2 for i in range(10)}, "vision.layers.20": c2}


async def _taller_to_the_end(pilot, app, panel, key: str, last: str) -> None:
    """`key` gives the focused details panel more room, keeping the focus; `end` scrolls to its `last` line."""
    before = panel.size.height
    await pilot.press(key)
    await pilot.pause()
    assert panel.size.height > before and app.focused is panel
    await pilot.press("end")
    await wait_for(pilot, lambda: panel.scroll_y == panel.max_scroll_y)
    await pilot.pause()
    assert last in on_screen(app, panel)[-1]
