"""The composer on an FSDP2 run's PyTorch Distributed Checkpoints (torchtitan's `step-N`, the HF Trainer's FSDP
`checkpoint-N`): the grid's rows and columns, the blown-up cell and its details, heal, compose (refused with its
NaN unless asked), the output proven by `--verify` through the real CLI, export for evaluation; a world size is
not asked for."""

from __future__ import annotations

import shutil

from helpers import tailor
from pilot_helpers import compose_finished, on_screen, scanned, start_composing, wait_for
from textual.widgets import Input

from tailor_tui.ui.app import make_app
from tailor_tui.ui.dialogs import Confirm, PathPrompt
from tailor_tui.ui.progress_screen import ProgressScreen

SIZE = (120, 40)


def cell_text(app, row: str, column: int) -> str:
    return app.query_one("#grid").cell_text(row, column)


def run_copy(fsdp_run, tmp_path, name: str):
    """A copy of the FSDP2 run `name` at `tmp_path/run` (outputs land beside its saves), and the composer on it."""
    run, _spec = fsdp_run(name)
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    return copy, make_app(copy, workers=1)


async def test_a_torchtitan_run_heals_and_composes_in_the_composer(fsdp_run, tmp_path):
    copy, app = run_copy(fsdp_run, tmp_path, "fsdp_llama")
    async with app.run_test(size=SIZE) as pilot:
        await scanned(pilot)
        comp = app.home.draft
        assert [c.name for c in comp.checkpoints] == ["step-2", "step-4", "step-6"] and comp.base == 2
        assert [r.name for r in comp.rows] == ["embed_tokens", "layers.0", "layers.1", "layers.2", "norm", "lm_head"]
        assert "NaN" in cell_text(app, "layers.1", 2)
        assert all("NaN" not in cell_text(app, row, c) for row in ("layers.0", "layers.2") for c in range(3))
        app.query_one("#grid").move_cursor(row=2, column=3)
        await pilot.pause()
        details = str(app.query_one("#details").render())
        assert "✗ 3,072 non-finite value(s)" in details and "PyTorch DCP" in details, details
        # composing the blown-up row: the plan says so and the safe answer goes back
        await pilot.press("ctrl+r")
        await wait_for(pilot, lambda: isinstance(app.screen, Confirm))
        assert "layers.1 from step-6: 3,072 non-finite value(s)" in app.screen.body
        await pilot.press("enter")
        await wait_for(pilot, lambda: not isinstance(app.screen, Confirm))
        await pilot.press("w")  # no world size to choose for a DCP checkpoint
        await pilot.pause()
        assert not isinstance(app.screen, PathPrompt)
        await pilot.press("h")
        await wait_for(pilot, lambda: isinstance(app.screen, Confirm))
        assert "layers.1 ← step-4" in app.screen.body
        await pilot.press("enter")
        await wait_for(pilot, lambda: len(app.screen_stack) == 1)
        assert app.home.draft.to_recipe().layers == {"layers.1": copy / "step-4"}
        progress = await start_composing(pilot)
        assert isinstance(progress, ProgressScreen)
        await compose_finished(pilot)
        await pilot.press("ctrl+s")
        await wait_for(pilot, lambda: isinstance(app.screen, PathPrompt))
        app.screen.query_one(Input).value = str(tmp_path / "heal.yaml")
        await pilot.press("enter")
        await wait_for(pilot, lambda: (tmp_path / "heal.yaml").is_file())
    out = copy / "step-6-tailored"
    assert (out / ".metadata").is_file()
    verified = tailor("--verify", tmp_path / "heal.yaml")
    assert verified.returncode == 0 and "ok    layers.1      step-4" in verified.stdout, verified.stdout


async def test_a_trainer_fsdp_run_opens_with_its_loss_and_exports_for_evaluation(fsdp_run, tmp_path):
    copy, app = run_copy(fsdp_run, tmp_path, "fsdp_llama_hf")
    async with app.run_test(size=SIZE) as pilot:
        await scanned(pilot)
        comp = app.home.draft
        assert [c.name for c in comp.checkpoints] == ["checkpoint-2", "checkpoint-4"]
        assert "NaN" in cell_text(app, "layers.1", 1)
        curve = app.home.health_pane.curve
        assert curve is not None and len(curve.steps) == 4  # the Trainer's logged losses
        assert "HF Trainer FSDP (DCP)" in str(app.query_one("#details").render())
        await pilot.press("h")
        await wait_for(pilot, lambda: isinstance(app.screen, Confirm))
        await pilot.press("enter")
        await wait_for(pilot, lambda: len(app.screen_stack) == 1)
        await pilot.press("e")
        await wait_for(pilot, lambda: isinstance(app.screen, PathPrompt))
        app.screen.query_one(Input).value = str(tmp_path / "hf")
        await pilot.press("enter")
        await wait_for(pilot, lambda: isinstance(app.screen, PathPrompt))  # its config: none recorded; weights only
        await pilot.press("enter")
        await wait_for(pilot, lambda: isinstance(app.screen, ProgressScreen))
        assert any("weights only" in str(n.message) for n in app._notifications)
        await compose_finished(pilot)
    assert (tmp_path / "hf" / "model.safetensors").is_file()
    from safetensors.torch import load_file

    weights = load_file(tmp_path / "hf" / "model.safetensors")
    assert not any(bool(t.isnan().any()) for t in weights.values())
    assert "model.layers.1.mlp.down_proj.weight" in weights


async def test_the_dcp_grid_at_80x24(fsdp_run, tmp_path):
    """At 80×24 the grid of a DCP run shows every row and its columns. (Its text, not a snapshot: its cells are
    numbers the run's training computed, which differ between CPU models; the pinned demo run's screens are
    snapshots.)"""
    copy, app = run_copy(fsdp_run, tmp_path, "fsdp_llama")
    async with app.run_test(size=(80, 24)) as pilot:
        await scanned(pilot)
        text = "\n".join(on_screen(app))
        for name in ("embed_tokens", "layers.0", "layers.1", "layers.2", "norm", "lm_head", "step-2", "step-6"):
            assert name in text, text
