"""The interactive composer, driven with the keyboard through Textual's pilot."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from conftest import checkpoints_of, tree_digest
from helpers import tailor, write_recipe
from pilot_helpers import compose_finished, private_copy, scanned, start_composing, wait_for
from textual.widgets import Input
from zero_reader import read_full_state

from tailor_tui.planning.recipe_file import load_recipe
from tailor_tui.ui.app import make_app
from tailor_tui.ui.dialogs import Confirm, ErrorDialog, HelpScreen, PathPrompt
from tailor_tui.ui.progress_screen import ProgressScreen

SIZE = (130, 32)


@pytest.fixture
def run_copy(real_run, tmp_path) -> tuple[Path, list[Path]]:
    """A private copy of the HF run, so outputs and recipes land beside it."""
    return private_copy(real_run, tmp_path, "hf_bf16_2")


async def test_grid_shows_rows_by_checkpoints_with_the_newest_as_base(run_copy):
    run, ckpts = run_copy
    app = make_app(run)
    async with app.run_test(size=SIZE) as pilot:
        await scanned(pilot)
        grid = app.query_one("#grid")
        assert grid.row_count == 7 and len(app.home.draft.checkpoints) == 3
        assert app.home.draft.base_checkpoint.path == ckpts[-1]
        assert grid.cursor_coordinate.column == 3  # starts on the base column
        details = str(app.query_one("#details").render())
        assert "checkpoint-6" in details and "2 ranks, bf16" in details


async def test_picks_change_the_recipe_and_undo_restores(run_copy):
    run, (c2, c4, c6) = run_copy
    app = make_app(run)
    async with app.run_test(size=SIZE) as pilot:
        await scanned(pilot)
        await pilot.press("left", "down", "space")  # layers.0 from checkpoint-4
        await pilot.press("down", "left", "enter")  # layers.1 from checkpoint-2 (Enter picks too)
        recipe = app.home.draft.to_recipe()
        assert recipe.base == c6
        assert recipe.layers == {"layers.0": c4, "layers.1": c2}
        await pilot.press("a")  # every row from checkpoint-2
        assert set(app.home.draft.to_recipe().layers.values()) == {c2}
        await pilot.press("u")
        assert app.home.draft.to_recipe().layers == {"layers.0": c4, "layers.1": c2}
        await pilot.press("b")  # checkpoint-2 becomes the base: its own picks disappear
        assert app.home.draft.to_recipe().base == c2
        assert app.home.draft.to_recipe().layers == {"layers.0": c4}


async def test_clicking_a_cell_picks_it(run_copy):
    run, (c2, c4, c6) = run_copy
    app = make_app(run)
    async with app.run_test(size=SIZE) as pilot:
        await scanned(pilot)
        grid = app.query_one("#grid")
        x = grid.column_x(0) + 1  # checkpoint-2
        y = 2 + 4  # below the two header lines: layers.3 (the cursor is elsewhere: on embed_tokens)
        await pilot.click("#grid", offset=(x, y))
        await pilot.pause()
        assert app.home.draft.to_recipe().layers == {"layers.3": c2}


async def test_save_and_load_round_trip(run_copy, tmp_path):
    run, (c2, c4, c6) = run_copy
    recipe_path = tmp_path / "fix.yaml"
    app = make_app(run, recipe=recipe_path)  # does not exist yet: ctrl+s saves there
    async with app.run_test(size=SIZE) as pilot:
        await scanned(pilot)
        await pilot.press("left", "down", "down", "space", "ctrl+s")
        await pilot.pause()
    saved = load_recipe(recipe_path)
    assert saved.base.resolve() == c6.resolve() and saved.layers == {"layers.1": c4}

    app = make_app(run, recipe=recipe_path)  # exists: its picks are loaded
    async with app.run_test(size=SIZE) as pilot:
        await scanned(pilot)
        assert app.home.draft.to_recipe().layers == {"layers.1": c4}
        assert app.home.draft.saved
        await pilot.press("a")  # change, then load it again with ctrl+o
        await pilot.press("ctrl+o")
        assert isinstance(app.screen, Confirm)  # the unsaved picks would be replaced: asked first
        await pilot.press("enter")
        await wait_for(pilot, lambda: isinstance(app.screen, PathPrompt))
        await pilot.press("enter")  # the prompt is pre-filled with the recipe's path
        await pilot.pause()
        assert app.home.draft.to_recipe().layers == {"layers.1": c4}


async def test_ctrl_s_keeps_what_a_person_wrote_in_the_recipe(run_copy, tmp_path):
    """A hand-written recipe loaded into the composer: ctrl+s with nothing changed leaves its bytes as
    they are (its comments, blank lines, a row named by its module path, a path with a trailing slash);
    a new pick is one line more, beside the rows the person wrote."""
    run, (c2, c4, c6) = run_copy
    rel = {c: os.path.relpath(c, tmp_path) for c in (c2, c4, c6)}
    hand = (f"# my notes on this merge\n\nversion: 1\nbase: {rel[c6]}   # newest\noutput: mine  # where it goes\n\n"
            f"layers:\n  # from step 4\n  model.layers.1: {rel[c4]}/   # a hand pick\n# the end\n")
    path = tmp_path / "mine.yaml"
    path.write_text(hand)
    app = make_app(run, recipe=path)
    async with app.run_test(size=SIZE) as pilot:
        await scanned(pilot)
        assert app.home.draft.to_recipe().layers == {"layers.1": c4}
        await pilot.press("ctrl+s")
        await pilot.pause()
        assert path.read_text() == hand
        await pilot.press("left", "down", "space", "ctrl+s")  # layers.0 from checkpoint-4
        await pilot.pause()
    assert path.read_text() == hand.replace("layers:\n", f"layers:\n  layers.0: {rel[c4]}\n")
    assert load_recipe(path).layers == {"layers.0": tmp_path / rel[c4], "model.layers.1": tmp_path / rel[c4]}


async def test_save_asks_for_a_path_when_there_is_none(run_copy, tmp_path):
    run, _ = run_copy
    app = make_app(run)
    async with app.run_test(size=SIZE) as pilot:
        await scanned(pilot)
        await pilot.press("ctrl+s")
        assert isinstance(app.screen, PathPrompt)
        prompt = app.screen.query_one("#path")
        prompt.value = str(tmp_path / "asked.yaml")
        await pilot.press("enter")
        await pilot.pause()
    assert load_recipe(tmp_path / "asked.yaml").layers == {}


async def test_composing_from_the_ui_writes_the_picked_rows(run_copy):
    run, (c2, c4, c6) = run_copy
    before = tree_digest(*[c for c in (c2, c4, c6)])
    app = make_app(run, workers=1)
    async with app.run_test(size=SIZE) as pilot:
        await scanned(pilot)
        await pilot.press("left", "left", "space")  # embed_tokens from checkpoint-2
        await pilot.press("right", "down", "down", "space")  # layers.1 from checkpoint-4
        await pilot.press("ctrl+r")
        await wait_for(pilot, lambda: isinstance(app.screen, Confirm))
        assert "layers.1" in app.screen.body and "checkpoint-4" in app.screen.body
        await pilot.press("escape")  # back to the grid; then compose for real
        await start_composing(pilot)
        await compose_finished(pilot)
        await pilot.pause()
    out = run / "checkpoint-6-tailored"
    got, sources = read_full_state(out), {c: read_full_state(c) for c in (c2, c4, c6)}
    for key in ("fp32", "exp_avg"):
        assert torch.equal(got[key]["model.embed_tokens.weight"], sources[c2][key]["model.embed_tokens.weight"])
        name = "model.layers.1.mlp.up_proj.weight"
        assert torch.equal(got[key][name], sources[c4][key][name])
        name = "model.layers.2.mlp.up_proj.weight"
        assert torch.equal(got[key][name], sources[c6][key][name])
    assert tree_digest(c2, c4, c6) == before


async def test_cancel_leaves_nothing_at_the_output(run_copy, slow_tasks):
    run, ckpts = run_copy
    app = make_app(run, workers=2)
    async with app.run_test(size=SIZE) as pilot:
        await scanned(pilot)
        slow_tasks(0.4)  # tiny checkpoints: the composition slowed to hit it mid-way
        await start_composing(pilot)
        await pilot.press("escape")
        await wait_for(pilot, lambda: not app.screen.running)
        assert app.screen.has_class("failed")
        assert "Cancelled" in str(app.screen.query_one("#compose-status").render())
    assert not (run / "checkpoint-6-tailored").exists()
    assert not [p for p in run.iterdir() if p.name.startswith(".")]


async def test_compose_errors_are_shown_in_a_dialog(run_copy):
    run, _ = run_copy
    app = make_app(run)
    async with app.run_test(size=SIZE) as pilot:
        await scanned(pilot)
        (run / "elsewhere").mkdir()  # another program's folder, named as the output
        (run / "elsewhere" / "keep").write_text("x")
        await pilot.press("o")
        await wait_for(pilot, lambda: isinstance(app.screen, PathPrompt))
        app.screen.query_one(Input).value = str(run / "elsewhere")
        await pilot.press("enter")
        await pilot.press("ctrl+r")
        await wait_for(pilot, lambda: isinstance(app.screen, ErrorDialog))
        assert "already exists" in app.screen.message
        await pilot.press("escape")
        assert len(app.screen_stack) == 1


async def test_an_output_nobody_named_is_never_an_existing_path(run_copy):
    """The default output (`BASE-tailored`) that exists by the time the plan is made (another program's folder,
    or this session's earlier composition) moves on to `-2`: a plan, never "Replace"; one the user named stays."""
    run, _ = run_copy
    app = make_app(run)
    async with app.run_test(size=SIZE) as pilot:
        await scanned(pilot)
        (run / "checkpoint-6-tailored").mkdir()  # made after the session chose the name
        (run / "checkpoint-6-tailored" / "keep").write_text("x")
        await pilot.press("ctrl+r")
        await wait_for(pilot, lambda: isinstance(app.screen, Confirm))
        assert "output: checkpoint-6-tailored-2" in app.screen.body
        await pilot.press("escape")
        assert app.home.draft.output == run / "checkpoint-6-tailored-2" and not app.home.draft.unsaved_changes()


async def test_quit_asks_first_when_picks_are_unsaved(run_copy):
    run, _ = run_copy
    app = make_app(run)
    async with app.run_test(size=SIZE) as pilot:
        await scanned(pilot)
        await pilot.press("left", "space", "q")
        assert isinstance(app.screen, Confirm)
        await pilot.press("n")
        assert app.is_running and len(app.screen_stack) == 1
        await pilot.press("q", "y")
        await pilot.pause()
    assert app.return_code == 0


async def test_incompatible_checkpoints_are_disabled_with_the_reason(real_run, tmp_path):
    run2, spec2 = real_run("hf_bf16_2")
    run3, spec3 = real_run("ds_bf16_3_subgroups")
    shutil.copytree(run2, tmp_path / "mixed" / "a")
    shutil.copytree(run3 / "global_step2", tmp_path / "mixed" / "b" / "global_step2")
    app = make_app(tmp_path / "mixed")
    async with app.run_test(size=SIZE) as pilot:
        await scanned(pilot)
        comp = app.home.draft
        assert [c.name for c in comp.checkpoints] == ["checkpoint-2", "global_step2", "checkpoint-4", "checkpoint-6"]
        assert "world size 3, the base has 2" in comp.incompatibility(1)
        app.query_one("#grid").move_cursor(row=1, column=2)
        await pilot.pause()
        assert "cannot be combined" in str(app.query_one("#details").render())
        await pilot.press("space")
        assert comp.to_recipe().layers == {}


async def test_checkpoints_sharing_a_folder_name_are_told_apart(real_run, tmp_path):
    """A restored copy of a checkpoint of the same run, in another folder (their training logs agree)."""
    run, _ = real_run("hf_bf16_2")
    for side in ("a", "b"):
        shutil.copytree(run / "checkpoint-2", tmp_path / "two" / side / "checkpoint-2")
    app = make_app(tmp_path / "two")
    async with app.run_test(size=SIZE) as pilot:
        await scanned(pilot)
        grid = app.query_one("#grid")
        assert [grid.header_text(c).splitlines()[0] for c in range(2)] == ["a/checkpoint-2", "b/checkpoint-2"]
        grid.move_cursor(row=1, column=1)
        await pilot.pause()
        assert str(app.query_one("#details").render()).startswith("a/checkpoint-2")


async def test_every_action_is_in_the_command_palette(run_copy):
    run, _ = run_copy
    app = make_app(run)
    async with app.run_test(size=SIZE) as pilot:
        await scanned(pilot)
        titles = {c.title for c in app.get_system_commands(app.screen)}
        for binding in [*app.BINDINGS, *app.home.BINDINGS]:
            assert binding.description and binding.description in titles


async def test_quit_during_a_composition_cancels_it(run_copy, slow_tasks):
    run, _ = run_copy
    app = make_app(run, workers=2)
    async with app.run_test(size=SIZE) as pilot:
        await scanned(pilot)
        slow_tasks(0.4)
        screen = await start_composing(pilot)
        await pilot.press("q")
        assert isinstance(app.screen, Confirm) and "composition is running" in app.screen.body
        await pilot.press("y")
        assert screen.cancel.is_set()
        await wait_for(pilot, lambda: app.return_code is not None)  # exits by itself, after cleanup
        assert screen.finished.is_set() and app.return_code == 0
    assert not (run / "checkpoint-6-tailored").exists()
    assert not [p for p in run.iterdir() if p.name.startswith(".")]


async def test_partial_checkpoints_show_only_their_rows_and_default_to_the_newest_holder(real_run):
    run, _spec = real_run("ds_selective_parity")
    app = make_app(run / "run")
    async with app.run_test(size=SIZE) as pilot:
        await scanned(pilot)
        comp = app.home.draft
        full, p4, p6 = comp.checkpoints
        grid = app.query_one("#grid")
        lacking = next(r.name for r in comp.rows if not r.tied and not p6.holds(r.name))
        assert comp.source_of(lacking) == 1  # newest checkpoint that saved it
        row_index = [r.name for r in comp.rows].index(lacking)
        assert grid.cell_text(lacking, 2) == "–"  # the partial base did not save it
        assert "picked" in grid.cell_text(lacking, 1)
        grid.move_cursor(row=row_index, column=3)
        await pilot.press("space")  # picking a row a partial checkpoint lacks is refused
        await pilot.pause()
        assert comp.source_of(lacking) == 1
        assert "partial" in str(app.query_one("#details").render())


async def test_details_point_out_a_checkpoint_from_another_run_folder(run_copy, tmp_path):
    run, (c2, c4, c6) = run_copy
    shutil.copytree(c4, tmp_path / "run" / "restored" / "checkpoint-5")  # the same step, copied elsewhere
    app = make_app(run)
    async with app.run_test(size=SIZE) as pilot:
        await scanned(pilot)
        names = [c.path.parent.name for c in app.home.draft.checkpoints]
        assert names == ["run", "run", "restored", "run"]
        await pilot.press("left")  # from the base (checkpoint-6) to the copied checkpoint
        details = str(app.query_one("#details").render())
        assert "checkpoint-5" in details and "another run folder" in details
        await pilot.press("left")
        assert "another run folder" not in str(app.query_one("#details").render())


async def test_a_full_hf_base_combines_with_partial_columns(real_run):
    run, _spec = real_run("hf_selective_parity")  # full checkpoint-2, parity partials at steps 4 and 6
    app = make_app(run / "run")
    async with app.run_test(size=SIZE) as pilot:
        await scanned(pilot)
        comp = app.home.draft
        grid = app.query_one("#grid")
        grid.move_cursor(row=0, column=1)
        await pilot.press("b")  # the full checkpoint-2 as the base: it has model.safetensors, they do not
        await pilot.pause()
        assert comp.base_checkpoint.name == "checkpoint-2"
        assert comp.incompatibility(1) is None and comp.incompatibility(2) is None
        held = next(r.name for r in comp.rows if not r.tied and comp.checkpoints[1].holds(r.name))
        grid.move_cursor(row=[r.name for r in comp.rows].index(held), column=2)
        await pilot.press("space")
        await pilot.pause()
        assert comp.source_of(held) == 1
        assert "cannot be combined" not in str(app.query_one("#details").render())


# --- row health ----------------------------------------------------------------------------------


@pytest.fixture
def blown_copy(real_run, tmp_path) -> tuple[Path, list[Path]]:
    """A private copy of the run whose layers.2 blew up just before the step-6 save."""
    return private_copy(real_run, tmp_path, "ds_blown_up", "blown")


def cell_text(app, row: str, column: int) -> str:
    grid = app.query_one("#grid")
    return grid.cell_text(row, column)


async def test_health_marks_the_blown_cell_and_heal_takes_the_previous_checkpoint(blown_copy):
    run, ckpts = blown_copy
    app = make_app(run)
    async with app.run_test(size=SIZE) as pilot:
        await scanned(pilot)
        assert "NaN" in cell_text(app, "layers.2", 2)  # the base's own cell
        assert all("NaN" not in cell_text(app, row, c) for row in ("layers.1", "layers.3") for c in range(3))
        grid = app.query_one("#grid")
        grid.move_cursor(row=3, column=3)
        await pilot.pause()
        assert "✗ 5,120 non-finite value(s)" in str(app.query_one("#details").render())
        await pilot.press("h")
        await wait_for(pilot, lambda: isinstance(app.screen, Confirm))
        assert "layers.2 ← global_step4" in app.screen.body
        await pilot.press("enter")
        await wait_for(pilot, lambda: len(app.screen_stack) == 1)
        assert app.home.draft.to_recipe().layers == {"layers.2": ckpts[1]}
        await pilot.press("u")  # one undo step takes the whole heal back
        assert app.home.draft.to_recipe().layers == {}
        await pilot.press("m")
        assert app.home.health_pane.metric == "weight_rms"


async def test_composing_an_unhealthy_row_goes_back_unless_asked_to_compose_anyway(blown_copy):
    run, ckpts = blown_copy
    app = make_app(run, workers=1)
    async with app.run_test(size=SIZE) as pilot:
        await scanned(pilot)
        await pilot.press("ctrl+r")
        await wait_for(pilot, lambda: isinstance(app.screen, Confirm))
        body = app.screen.body
        assert "layers.2 from global_step6: 5,120 non-finite value(s)" in body and "--allow-nonfinite" in body
        await pilot.press("enter")  # the safe choice is the default: back to the grid
        await wait_for(pilot, lambda: not isinstance(app.screen, Confirm))
        assert not (run / "global_step6-tailored").exists()
        await pilot.press("ctrl+r")
        await wait_for(pilot, lambda: isinstance(app.screen, Confirm))
        await pilot.press("exclamation_mark")  # "Compose anyway", asked for explicitly
        await wait_for(pilot, lambda: isinstance(app.screen, ProgressScreen) and not app.screen.running)
        assert (run / "global_step6-tailored" / "latest").is_file()


async def test_exporting_an_unhealthy_row_goes_back_unless_asked_to_export_anyway(blown_copy, tmp_path):
    """e keeps the rule --export keeps: an export that would hold the blown row's NaN/Inf is shown first, going
    back is the default, and only ! exports it (as --allow-nonfinite)."""
    run, _ckpts = blown_copy
    app = make_app(run, workers=1)

    async def export_to(folder: Path) -> None:
        await pilot.press("e")
        await wait_for(pilot, lambda: isinstance(app.screen, PathPrompt))
        app.screen.query_one(Input).value = str(folder)
        await pilot.press("enter")
        await wait_for(pilot, lambda: isinstance(app.screen, PathPrompt) and "config.json" in app.screen.title_text)
        await pilot.press("enter")  # no config: the weights only
        await wait_for(pilot, lambda: isinstance(app.screen, Confirm))

    async with app.run_test(size=SIZE) as pilot:
        await scanned(pilot)
        await export_to(tmp_path / "hf")
        body = app.screen.body
        assert "layers.2 from global_step6: 5,120 non-finite value(s)" in body and "--allow-nonfinite" in body
        await pilot.press("enter")  # the safe choice is the default: back to the grid
        await wait_for(pilot, lambda: not isinstance(app.screen, Confirm))
        assert not (tmp_path / "hf").exists()
        await export_to(tmp_path / "hf")
        await pilot.press("exclamation_mark")  # "Export anyway", asked for explicitly
        await compose_finished(pilot)
    assert (tmp_path / "hf" / "model.safetensors").is_file()


async def test_a_row_failing_its_crc_is_never_offered_to_compose_anyway(blown_copy):
    """A pick whose source fails its CRC-32 check can never compose (--apply refuses it whatever the
    flags): the composer says so and offers no "compose anyway", which it does for NaN rows only."""
    from tailor_tui.health.healing import damage

    run, (_c2, c4, _c6) = blown_copy
    target = next(c4.glob("*rank_1_*optim_states.pt"))
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0x01  # the middle of an optim file: its flat tensors' data
    target.write_bytes(bytes(data))
    app = make_app(run, workers=1)
    async with app.run_test(size=SIZE) as pilot:
        await scanned(pilot)
        comp, health = app.home.draft, app.home.health_pane.health
        rows = [r.name for r in comp.rows]
        crc = next(row for row in rows if damage(health.cell(row, 1)) == "CRC")
        app.query_one("#grid").move_cursor(row=rows.index(crc), column=2)
        await pilot.press("space", "ctrl+r")
        await wait_for(pilot, lambda: isinstance(app.screen, (ErrorDialog, Confirm)))
        assert isinstance(app.screen, ErrorDialog)
        text = str(app.screen.query_one(".dialog-body").render())
        assert f"{crc} from global_step4" in text and "CRC" in text and "anyway" not in text
        await pilot.press("exclamation_mark", "escape")
        await wait_for(pilot, lambda: len(app.screen_stack) == 1)
        assert not (run / "global_step6-tailored").exists()


# --- what things are ----------------------------------------------------------------------------


async def test_a_composed_folder_is_never_a_column_and_is_named_in_the_details(run_copy):
    run, ckpts = run_copy
    from tailor_tui.compose.compose_run import run_compose
    from tailor_tui.planning.build import build_plan
    from tailor_tui.planning.recipe import Recipe

    run_compose(build_plan(Recipe(base=ckpts[-1], output=run / "checkpoint-6-tailored",
                                layers={"layers.0": ckpts[0]})), workers=1)
    app = make_app(run)
    async with app.run_test(size=SIZE) as pilot:
        await scanned(pilot)
        assert [c.path for c in app.home.draft.checkpoints] == list(ckpts)  # training checkpoints only
        assert app.home.draft.base_checkpoint.path == ckpts[-1]
        assert app.home.draft.output == run / "checkpoint-6-tailored-2"  # a new sibling, never over it
        details = str(app.query_one("#details").render())
        assert "composed by tailor-tui here, not columns (1):" in details
        assert "checkpoint-6-tailored ← checkpoint-6, checkpoint-2" in details


async def test_two_runs_in_one_folder_are_never_one_grid(real_run, tmp_path):
    for side, name in (("first", "hf_bf16_2"), ("second", "hf_bf16_2_seed1")):
        shutil.copytree(real_run(name)[0], tmp_path / "runs" / side)
    app = make_app(tmp_path / "runs")
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: isinstance(app.screen, ErrorDialog))
        assert "holds checkpoints of 2 training runs" in app.screen.message
        assert app.home.draft is None


async def test_the_cursor_never_lands_on_the_names_column(run_copy):
    run, ckpts = run_copy
    app = make_app(run)
    async with app.run_test(size=SIZE) as pilot:
        await scanned(pilot)
        grid = app.query_one("#grid")
        await pilot.press(*["left"] * 5)
        assert grid.current()[1] == 0  # the first checkpoint's column, not the row names
        await pilot.click("#grid", offset=(2, 5))  # a row's name: that row, the same column
        await pilot.pause()
        assert grid.current() == (app.home.draft.rows[3].name, 0)


async def test_skipped_checkpoints_stay_listed_and_an_empty_folder_says_what_was_looked_for(run_copy, tmp_path):
    run, ckpts = run_copy
    broken = run / "checkpoint-8"
    shutil.copytree(ckpts[0], broken)
    next(broken.rglob("*rank_1_mp_rank_00_optim_states.pt")).unlink()
    app = make_app(run)
    async with app.run_test(size=SIZE) as pilot:
        await scanned(pilot)
        details = str(app.query_one("#details").render())
        assert "skipped while scanning (1):" in details and "checkpoint-8" in details
    empty = tmp_path / "empty"
    empty.mkdir()
    app = make_app(empty)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.home.health_pane.status is None)  # the scan found nothing
        label = str(app.query_one("#scan-label").render())
        assert "looked for HF checkpoint-N folders" in label
        assert not app.query_one("#scan-bar").display


async def test_help_explains_every_mark_and_the_footer_keeps_the_essentials_at_80x24(run_copy):
    run, _ckpts = run_copy
    app = make_app(run)
    async with app.run_test(size=(80, 24)) as pilot:
        await scanned(pilot)
        footer = {b.binding.description for b in app.screen.active_bindings.values() if b.binding.show}
        assert {"Compose", "Save", "Help", "Quit"} <= footer
        await pilot.press("question_mark")
        await wait_for(pilot, lambda: isinstance(app.screen, HelpScreen))
        await pilot.press("escape")
        await wait_for(pilot, lambda: not isinstance(app.screen, HelpScreen))
        await pilot.press("f1")
        await wait_for(pilot, lambda: isinstance(app.screen, HelpScreen))
        commands = list(app.get_system_commands(app.screen))
        assert [c.title for c in commands].count("Quit") == 1
        assert any("heal" in c.help.lower() for c in commands)


@pytest.mark.parametrize("size", [(80, 24), (200, 50)], ids=["80x24", "200x50"])
async def test_help_lists_every_binding_and_scrolls_to_the_last(run_copy, size):
    """The help's keys come from the one table of actions: every key bound on the app, the
    composer's screen and the grid is in it; at 80×24 and 200×50 the keyboard scrolls it to its last
    line, none cut or wrapped, and how to close it is always in view."""
    from textual.binding import Binding
    from textual.containers import VerticalScroll

    from tailor_tui.ui.actions import ACTIONS, key_text
    from tailor_tui.ui.dialogs import HELP, PlanDialog

    run, _ckpts = run_copy
    app = make_app(run)
    async with app.run_test(size=size) as pilot:
        await scanned(pilot)
        bound = [*app.BINDINGS, *app.home.BINDINGS, *app.home.query_one("#grid").BINDINGS]
        listed = {a.action for a in ACTIONS if a.help} | {a.action for a in ACTIONS}
        assert {b.action for b in bound} <= listed
        for action in ACTIONS:
            if action.help:
                assert f"{action.key_text}: " in HELP.replace("\n           ", " "), action
        await pilot.press("question_mark")
        await wait_for(pilot, lambda: isinstance(app.screen, HelpScreen))
        title = str(app.home.query_one("#title").render())
        assert title.startswith("tailor-tui · unsaved recipe · base ")  # the recipe first, whole at 80 columns
        scroll = app.screen.query_one(VerticalScroll)
        text = app.screen.text
        assert text.startswith(HELP)
        for screen in (PlanDialog, Confirm, ProgressScreen):  # every key the screens over the grid show, from
            for b in screen.BINDINGS:  # their own bindings (issue 60: the plan's ! was missing)
                assert not (isinstance(b, Binding) and b.show) or f"{key_text(b.key)}: " in text, (screen, b)
        assert "!: compose anyway" in text
        lines = text.splitlines()
        assert scroll.virtual_size.height == len(lines)  # every line, none cut, none wrapped in two
        assert scroll.virtual_size.width <= scroll.size.width
        assert scroll.max_scroll_y > 0 or size != (80, 24)  # 80×24 does not hold it all
        assert "Esc closes" in str(app.screen.query_one(".dialog-title").render())
        await pilot.press("end")
        await wait_for(pilot, lambda: scroll.scroll_y == scroll.max_scroll_y)
        assert app.screen.query_one(".dialog-title").region.height == 1  # still in view, above the scroll
        await pilot.press("home", "pagedown")
        await wait_for(pilot, lambda: scroll.scroll_y > 0 or scroll.max_scroll_y == 0)



# --- never losing a recipe -----------------------------------------------------------------------


async def test_a_recipe_that_failed_to_load_is_never_silently_replaced(run_copy, tmp_path, real_run):
    run, (c2, c4, c6) = run_copy
    other, other_spec = real_run("hf_fp32_3_tied")  # another run: its checkpoints are not scanned here
    fix = tmp_path / "fix.yaml"
    fix.write_text(f"version: 1\nbase: {checkpoints_of(other, other_spec)[-1]}\nlayers:\n  layers.0: {c2}\n")
    before = fix.read_text()
    app = make_app(run, recipe=fix)
    async with app.run_test(size=SIZE) as pilot:
        await scanned(pilot)
        await wait_for(pilot, lambda: isinstance(app.screen, ErrorDialog))
        await pilot.press("escape")
        assert app.home.draft.recipe_path is None
        assert "fix.yaml" not in str(app.query_one("#title").render())
        await pilot.press("ctrl+s")  # not a silent save: Save as, pre-filled with fix.yaml
        await wait_for(pilot, lambda: isinstance(app.screen, PathPrompt))
        await pilot.press("enter")
        await wait_for(pilot, lambda: isinstance(app.screen, Confirm))  # it exists and was not loaded
        await pilot.press("escape")
        await pilot.pause()
    assert fix.read_text() == before


async def test_undo_back_to_the_saved_state_is_saved_and_redo_returns(run_copy, tmp_path):
    run, (c2, c4, c6) = run_copy
    recipe = tmp_path / "r.yaml"
    app = make_app(run, recipe=recipe)
    async with app.run_test(size=SIZE) as pilot:
        await scanned(pilot)
        await pilot.press("left", "down", "space", "ctrl+s")
        await pilot.pause()
        assert app.home.draft.saved and recipe.read_text().startswith("# tailor-tui recipe")
        await pilot.press("down", "space")
        assert not app.home.draft.saved and "*" in str(app.query_one("#title").render())
        await pilot.press("u")
        assert app.home.draft.saved and "*" not in str(app.query_one("#title").render())
        await pilot.press("ctrl+y")
        assert app.home.draft.to_recipe().layers == {"layers.0": c4, "layers.1": c4}
        assert not app.home.draft.saved


# --- editing many rows ---------------------------------------------------------------------------


async def test_a_block_of_rows_is_picked_in_one_action_and_one_undo(run_copy):
    run, (c2, c4, c6) = run_copy
    app = make_app(run)
    async with app.run_test(size=SIZE) as pilot:
        await scanned(pilot)
        await pilot.press("slash")
        await wait_for(pilot, lambda: isinstance(app.screen, PathPrompt))
        await pilot.press(*"layers.1", "enter")
        await wait_for(pilot, lambda: len(app.screen_stack) == 1)
        assert app.query_one("#grid").cursor_coordinate.row == 2
        await pilot.press("v", "down", "down", "left", "left", "space")  # layers.1 – layers.3 from checkpoint-2
        assert app.home.draft.to_recipe().layers == {"layers.1": c2, "layers.2": c2, "layers.3": c2}
        await pilot.press("u")
        assert app.home.draft.to_recipe().layers == {}
        await pilot.press("G")
        assert app.query_one("#grid").cursor_coordinate.row == len(app.home.draft.rows) - 1
        await pilot.press("shift+up", "shift+up", "escape", "space")  # dropped: only the cursor's cell
        assert set(app.home.draft.to_recipe().layers) == {"layers.3"}  # (lm_head, tied, is last)
        await pilot.press("g")
        assert app.query_one("#grid").cursor_coordinate.row == 0


async def name_output(pilot, app, path: Path) -> None:
    """Name the output (o), as a user does."""
    await pilot.press("o")
    await wait_for(pilot, lambda: isinstance(app.screen, PathPrompt))
    app.screen.query_one(Input).value = str(path)
    await pilot.press("enter")
    await wait_for(pilot, lambda: len(app.screen_stack) == 1)


async def test_an_earlier_output_is_offered_for_replacement_not_force(run_copy):
    run, (c2, c4, c6) = run_copy
    app = make_app(run, workers=1)
    async with app.run_test(size=SIZE) as pilot:
        await scanned(pilot)
        await start_composing(pilot)
        await wait_for(pilot, lambda: not app.screen.running)
        first = (run / "checkpoint-6-tailored" / "tailor_provenance.json").read_text()
        await pilot.press("escape")
        await wait_for(pilot, lambda: len(app.screen_stack) == 1)
        await name_output(pilot, app, run / "checkpoint-6-tailored")  # named: offered to replace, not moved on
        await pilot.press("left", "down", "space", "ctrl+r")  # another composition, same output
        await wait_for(pilot, lambda: isinstance(app.screen, Confirm))
        assert app.screen.title_text.startswith("Replace checkpoint-6-tailored")
        await pilot.press("enter")
        await wait_for(pilot, lambda: isinstance(app.screen, Confirm) and app.screen.title_text.startswith("Compose"))
        await pilot.press("enter")
        await wait_for(pilot, lambda: isinstance(app.screen, ProgressScreen) and not app.screen.running)
        assert app.screen.has_class("finished")
    assert (run / "checkpoint-6-tailored" / "tailor_provenance.json").read_text() != first


async def test_an_earlier_output_training_resumed_into_is_not_offered_for_replacement(run_copy):
    """The composer asks `replaceable` as --force does: an output of an older tailor-tui (its record
    lists no files) that a checkpoint was saved into is refused in a dialog, never offered to replace."""
    run, (c2, c4, c6) = run_copy
    out = run / "checkpoint-6-tailored"
    app = make_app(run, workers=1)
    async with app.run_test(size=SIZE) as pilot:
        await scanned(pilot)
        await start_composing(pilot)
        await wait_for(pilot, lambda: not app.screen.running)
        await pilot.press("escape")
        await wait_for(pilot, lambda: len(app.screen_stack) == 1)
        record = json.loads((out / "tailor_provenance.json").read_text())
        del record["files"]
        (out / "tailor_provenance.json").write_text(json.dumps(record))
        shutil.copytree(c6, out / "checkpoint-8")  # training resumed into it
        before = tree_digest(out)
        await name_output(pilot, app, out)  # named: not moved on to the next default
        await pilot.press("left", "down", "space", "ctrl+r")
        await wait_for(pilot, lambda: isinstance(app.screen, (ErrorDialog, Confirm)))
        assert isinstance(app.screen, ErrorDialog) and "already exists" in app.screen.message
        assert "without the list of files tailor-tui wrote" in app.screen.message  # why, not "pass --force"
        assert "pass --force" not in app.screen.message
        await pilot.press("escape")
    assert tree_digest(out) == before


async def test_the_world_size_set_from_the_plan_dialog_reshards(real_run, tmp_path):
    """w in the plan dialog: the plan is shown again for 2 ranks, a checkpoint of another world
    size becomes combinable, the composition writes 2 ranks, the recipe keeps it; back at the base's
    world size, the pick from the other world size is dropped."""
    run4, spec4 = real_run("ds_bf16_4_subgroups")
    run3, spec3 = real_run("ds_bf16_3_subgroups")
    shutil.copytree(run4, tmp_path / "mixed" / "a", ignore=shutil.ignore_patterns("global_step4"))  # (b saved 4)
    shutil.copytree(run3 / "global_step4", tmp_path / "mixed" / "b" / "global_step4")
    app = make_app(tmp_path / "mixed", workers=1)
    async with app.run_test(size=SIZE) as pilot:
        await scanned(pilot)
        comp = app.home.draft
        other = [c.path for c in comp.checkpoints].index(tmp_path / "mixed" / "b" / "global_step4")
        assert "world size 3, the base has 4" in comp.incompatibility(other)
        await pilot.press("ctrl+r")
        await wait_for(pilot, lambda: isinstance(app.screen, Confirm))
        await pilot.press("w")
        await wait_for(pilot, lambda: isinstance(app.screen, PathPrompt))
        await pilot.press("2", "enter")
        await wait_for(pilot, lambda: isinstance(app.screen, Confirm))
        assert "reshard: 4 → 2 ranks" in app.screen.body
        assert "4 → 2 ranks" in app.home.title_text
        await pilot.press("escape")
        assert comp.incompatibility(other) is None
        app.query_one("#grid").move_cursor(row=2, column=1 + other)  # layers.1, the 3-rank checkpoint
        await pilot.press("space")
        assert comp.to_recipe().layers == {"layers.1": tmp_path / "mixed" / "b" / "global_step4"}
        assert comp.to_recipe().world_size == 2
        await start_composing(pilot)
        await compose_finished(pilot)
        await pilot.press("w")
        await wait_for(pilot, lambda: isinstance(app.screen, PathPrompt))
        await pilot.press("end", "backspace", "enter")  # empty: the base's world size again
        await pilot.pause()
        assert comp.world_size is None and comp.to_recipe().layers == {}
    out = comp.output
    assert len(list((out / "global_step6").glob("*optim_states.pt"))) == 2
    got = read_full_state(out)
    want = read_full_state(tmp_path / "mixed" / "b" / "global_step4")
    name = "model.layers.1.self_attn.q_proj.weight"
    assert torch.equal(got["fp32"][name], want["fp32"][name])


async def test_a_large_plan_on_a_login_node_offers_a_batch_job(real_run, tmp_path, monkeypatch):
    """Where sbatch is at hand and no Slurm job is (a login node), a plan past the threshold
    offers `s`: the recipe is saved (asking where) and an sbatch script that runs it with srun
    is written beside it; nothing is composed here. Inside a job (SLURM_JOB_ID) nothing is offered."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text("#!/bin/sh\nexit 1\n")  # only found on PATH, never run
    (bin_dir / "sbatch").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    run, _checkpoints = private_copy(real_run, tmp_path, "hf_bf16_2")
    app = make_app(run, workers=1, batch_threshold=1)
    async with app.run_test(size=(80, 24)) as pilot:
        await scanned(pilot)
        await pilot.press("ctrl+r")
        await wait_for(pilot, lambda: isinstance(app.screen, Confirm))
        assert "login node, s writes an sbatch script" in app.screen.body
        await pilot.press("s")
        await wait_for(pilot, lambda: isinstance(app.screen, PathPrompt))
        recipe = tmp_path / "big.yaml"
        app.screen.query_one(Input).value = str(recipe)
        await pilot.press("enter")
        await wait_for(pilot, lambda: (tmp_path / "big.sbatch").is_file())
        assert not any(isinstance(screen, ProgressScreen) for screen in app.screen_stack)  # nothing composes
        monkeypatch.setenv("SLURM_JOB_ID", "1")
        await pilot.press("ctrl+r")
        await wait_for(pilot, lambda: isinstance(app.screen, Confirm))
        assert "sbatch" not in app.screen.body and not app.screen.query("#sbatch")
        await pilot.press("escape")
    script = (tmp_path / "big.sbatch").read_text()
    assert script.startswith("#!/bin/bash\n# written by tailor-tui") and "#SBATCH --nodes=1" in script
    assert f"--apply {recipe.resolve()} --workers 4" in script and "\nsrun " in script
    assert os.access(tmp_path / "big.sbatch", os.X_OK) and recipe.is_file()
    assert not (run / "checkpoint-6-tailored").exists()


async def test_export_for_evaluation_from_the_composer(real_run, tmp_path):
    """e asks for a folder, then exports the picks there on the progress screen: a folder
    from_pretrained loads, each row from its picked checkpoint."""
    from transformers import AutoModelForCausalLM

    run, (c2, _c4, c6) = private_copy(real_run, tmp_path, "hf_bf16_2")
    app = make_app(run, workers=1)
    async with app.run_test(size=SIZE) as pilot:
        await scanned(pilot)
        app.query_one("#grid").move_cursor(row=2, column=1)  # layers.1 from checkpoint-2
        await pilot.press("space")
        await pilot.press("e")
        await wait_for(pilot, lambda: isinstance(app.screen, PathPrompt))
        assert app.screen.query_one(Input).value.endswith("checkpoint-6-tailored-hf")
        app.screen.query_one(Input).value = str(tmp_path / "hf")
        await pilot.press("enter")
        await compose_finished(pilot)
    model, info = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    name = "model.layers.1.self_attn.q_proj.weight"
    want = read_full_state(c2)["fp32"][name].to(torch.bfloat16)
    assert torch.equal(model.state_dict()[name], want)
    assert not torch.equal(want, read_full_state(c6)["fp32"][name].to(torch.bfloat16))


async def test_export_of_a_deepspeed_layout_run_asks_for_its_config(real_run, tmp_path):
    """A DeepSpeed-layout run records no config.json: e asks for it after the folder; a path
    without one is said at once (nothing written), the right one makes a loadable folder."""
    from conftest import RUNS
    from run_models import model_config
    from transformers import AutoModelForCausalLM

    run, (_c2, _c4, _c6) = private_copy(real_run, tmp_path, "ds_bf16_3_subgroups")
    model_config(RUNS["ds_bf16_3_subgroups"]).save_pretrained(tmp_path / "cfg")
    app = make_app(run, workers=1)

    async def export_to(folder: Path, config: Path) -> None:
        await pilot.press("e")
        await wait_for(pilot, lambda: isinstance(app.screen, PathPrompt))
        app.screen.query_one(Input).value = str(folder)
        await pilot.press("enter")
        await wait_for(pilot, lambda: isinstance(app.screen, PathPrompt) and "config.json" in app.screen.title_text)
        app.screen.query_one(Input).value = str(config)
        await pilot.press("enter")

    async with app.run_test(size=SIZE) as pilot:
        await scanned(pilot)
        await export_to(tmp_path / "hf", tmp_path / "nowhere")
        await wait_for(pilot, lambda: isinstance(app.screen, ErrorDialog))
        assert "no config.json there" in app.screen.message and app.screen.title_text == "Cannot export"
        await pilot.press("escape")
        assert not (tmp_path / "hf").exists()
        await export_to(tmp_path / "hf", tmp_path / "cfg")
        await compose_finished(pilot)
    _model, info = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]


def test_the_title_keeps_every_part_at_80_columns_shortening_paths_from_the_left():
    """Long recipe and output paths are shortened from the left, so that the output is named at 80
    columns (it used to end at `output` and nothing after it)."""
    from tailor_tui.ui.describe import fit_title

    recipe = "experiments/2026-11/llama-8b-pubmed/recipes/new.yaml"
    output = "/scratch/team/llama-8b-pubmed/run-3/checkpoint-6-tailored"
    parts = [("tailor-tui", ""), ("* ", recipe), ("base checkpoint-6", ""), ("output ", output)]
    title = fit_title(parts, 78)
    assert len(title) <= 78 and title.startswith("tailor-tui · * …") and "base checkpoint-6" in title
    assert title.endswith("checkpoint-6-tailored") and "output …" in title
    assert "new.yaml" in title
    assert fit_title(parts, 400) == f"tailor-tui · * {recipe} · base checkpoint-6 · output {output}"


async def _error_after_prompt(pilot, key: str, path: Path) -> str:
    """`key`, `path` typed into the prompt it opens: the error dialog's text (closed again)."""
    app = pilot.app
    await pilot.press(key)
    await wait_for(pilot, lambda: isinstance(app.screen, PathPrompt))
    app.screen.query_one(Input).value = str(path)
    await pilot.press("enter")
    await wait_for(pilot, lambda: isinstance(app.screen, ErrorDialog))
    text = str(app.screen.query_one(".dialog-body").render())
    await pilot.press("escape")
    return text


async def test_a_world_size_typed_in_no_plain_whole_number_is_refused(run_copy):
    """`w`: what int() refuses (`²`), reads as another number (`٣`, another script's 3) or cannot read
    (5,000 digits), and what YAML would read otherwise (`010`), each an error dialog; nothing changes."""
    run, _ckpts = run_copy
    app = make_app(run)
    async with app.run_test(size=SIZE) as pilot:
        await scanned(pilot)
        for typed in ("\u00b2", "\u0663", "9" * 5000, "010", "0"):
            text = await _error_after_prompt(pilot, "w", typed)
            assert "a whole number of at least 1" in text and "plain decimal digits" in text, text
        assert app.home.draft.world_size is None


async def test_every_message_says_what_happened(run_copy, tmp_path):
    """ctrl+o of a recipe with a misspelt row says which row was meant, as --apply does; a quit with
    only the world size changed says that, not that the picks are unsaved; a folder typed as where to
    save is named as a folder; an export's bars carry each rank's whole name; a cancelled replacement
    of an earlier output says that output is as it was."""
    run, (_c2, c4, c6) = run_copy
    typo = tmp_path / "typo.yaml"
    typo.write_text(f"version: 1\nbase: {c6}\nlayers:\n  layres.1: {c4}\n")
    app = make_app(run, workers=1)
    async with app.run_test(size=(80, 24)) as pilot:
        await scanned(pilot)
        assert "did you mean 'layers.1'?" in await _error_after_prompt(pilot, "ctrl+o", typo)
        app.home.draft.world_size = 1  # as `w` sets it
        await pilot.press("q")
        await wait_for(pilot, lambda: isinstance(app.screen, Confirm))
        assert "the world size changed" in app.screen.body and "picks" not in app.screen.body
        await pilot.press("escape")
        app.home.draft.world_size = None
        assert "is a folder" in await _error_after_prompt(pilot, "S", tmp_path)

    from tailor_tui.export.export_plan import plan_export
    from tailor_tui.planning.build import build_plan
    from tailor_tui.planning.recipe import Recipe

    plan = build_plan(Recipe(base=c6, output=tmp_path / "hf", layers={"layers.1": c4}))
    export = plan_export(plan, None, 5 << 30)
    screen = ProgressScreen(plan, 1, autostart=False, export=export)
    app = make_app(run, workers=1)
    async with app.run_test(size=(80, 24)) as pilot:
        await scanned(pilot)
        app.push_screen(screen)
        await pilot.pause()
        labels = [str(label.render()) for label in screen.query(".bar-label")]
        assert all(label.size.width >= len(str(label.render())) for label in screen.query(".bar-label"))
        assert "checkpoint-6 (base) rank 1" in labels and "checkpoint-4 rank 0" in labels  # not cut to `checkpoint-6`
        screen.plan.output.mkdir()  # an earlier output at the path, which the cancelled run was to replace
        from tailor_tui.ui.messages import ComposeFailed

        screen.post_message(ComposeFailed("cancelled", cancelled=True))
        await pilot.pause()
        status = str(screen.query_one("#compose-status").render())
        assert "hf is the earlier output, as it was" in status and "nothing was left" not in status


@pytest.mark.parametrize("size", [(80, 24), (200, 50)])
async def test_a_folder_of_outputs_only_says_so_whole_and_offers_only_help_and_quit(run_copy, tmp_path, size):
    """Issue 60 (10): a folder holding only what tailor-tui composed: the line saying so wraps (it was cut at 80
    columns), and with nothing to pick the footer offers no Pick, Heal, Compose or Save: help and quit."""
    run, (c2, c4, c6) = run_copy
    outputs = tmp_path / "outputs"
    outputs.mkdir()
    recipe = write_recipe(tmp_path, c6, {"layers.1": c4}, output="outputs/fixed")
    assert tailor("--apply", recipe).returncode == 0
    app = make_app(outputs)
    async with app.run_test(size=size) as pilot:
        await wait_for(pilot, lambda: "open the run those came from" in str(app.query_one("#scan-label").render()))
        label = app.query_one("#scan-label")
        assert label.region.right <= size[0] and label.region.height >= (2 if size[0] == 80 else 1)
        shown = {b.binding.description for b in app.screen.active_bindings.values() if b.binding.show}
        assert shown == {"Help", "Quit"}, shown
        await pilot.press("h", "ctrl+r", "ctrl+s")  # nothing happens: no dialog, no error
        await pilot.pause()
        assert len(app.screen_stack) == 1
