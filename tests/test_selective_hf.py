"""Selective checkpointing through the HF Trainer callback, composed back and resumed.

A real HF Trainer run (DeepSpeed ZeRO-3, 3 ranks, bf16, tied embeddings, a frozen
parameter) with `SelectiveCheckpointCallback(trainer, Parity())` saves a full
`checkpoint-2` and parity partials at steps 4 and 6; the same run writes full reference
saves (DeepSpeed checkpoint and the Trainer's 16-bit model file) at every save step.
Composed newest-per-row, the output must be a standard HF checkpoint: each row's state
and 16-bit weights those of the step it was saved at, the model file laid out exactly as
the Trainer lays it out, and the real HF Trainer must resume from it.
"""

from __future__ import annotations

import json
import math
import shutil
import struct

import pytest
import torch
from conftest import tree_digest
from helpers import (
    assert_one_line_error,
    assert_optim_states_equal,
    compose_newest_per_row,
    expect_rows_from,
    tailor,
    write_recipe,
)
from runs import resume_and_step
from safetensors import safe_open

from tailor_tui.checkpoints.checkpoint import PARTIAL_MODEL_FILES, tied_partner
from tailor_tui.checkpoints.rows import RowNaming
from tailor_tui.checkpoints.scan import scan
from tailor_tui.compose.compose_run import run_compose
from tailor_tui.planning.build import build_plan
from tailor_tui.planning.recipe import Recipe

RUN = "hf_selective_parity"


@pytest.fixture(scope="module")
def selective(real_run):
    run, spec = real_run(RUN)
    return run / "run", run / "reference", spec


def header(path) -> bytes:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return f.read(n)


def expect_model_file_from(out, sources: dict[str, object]) -> None:
    """`out`'s model.safetensors is laid out as the Trainer writes it and holds each tensor
    of the reference checkpoint its row was taken from (`sources`: row -> folder)."""
    any_ref = next(iter(sources.values()))
    assert header(out / "model.safetensors") == header(any_ref / "model.safetensors")
    with safe_open(out / "model.safetensors", "pt") as mine:
        naming = RowNaming(mine.keys())
        for name in mine.keys():
            with safe_open(sources[naming.row_of(name)] / "model.safetensors", "pt") as ref:
                assert torch.equal(mine.get_tensor(name), ref.get_tensor(name)), name


def sources_of_rows(ckpt, partial, held: object, other: object) -> dict:
    """row -> `held` for the rows partial checkpoint `partial` saved, else `other`; a tied
    row (lm_head) follows the row it shares its weight with."""
    picked = {r.name: held if r.name in partial.saved.rows else other for r in ckpt.rows if not r.tied}
    return picked | {r.name: picked[tied_partner(ckpt, r)] for r in ckpt.rows if r.tied}


def test_callback_saves_full_then_partial_hf_folders(selective):
    runs, _ref, _spec = selective
    from transformers.trainer_utils import get_last_checkpoint

    result = scan(runs)
    assert not result.problems
    assert [(c.name, c.kind, c.saved.kind) for c in result.checkpoints] == [
        ("checkpoint-2", "hf", "full"), ("partial-step4", "hf", "partial"), ("partial-step6", "hf", "partial")]
    assert get_last_checkpoint(str(runs)).endswith("checkpoint-2")  # the Trainer never takes a partial
    for part, step in ((runs / "partial-step4", 4), (runs / "partial-step6", 6)):
        assert not (part / "latest").exists()  # nothing resumes from it by mistake
        assert json.loads((part / "trainer_state.json").read_text())["global_step"] == step
        for f in ("scheduler.pt", "training_args.bin", "config.json", "zero_to_fp32.py",
                  *(f"rng_state_{r}.pth" for r in range(3))):
            assert (part / f).is_file(), f
        layout = json.loads((part / PARTIAL_MODEL_FILES).read_text())
        assert layout["files"]["model.safetensors"].encode() == header(runs / "checkpoint-2" / "model.safetensors")
        assert not (part / "model.safetensors").exists()  # 16-bit weights would need a gather


def test_newest_per_row_composes_a_standard_hf_checkpoint_that_resumes(selective, tmp_path):
    runs, ref, spec = selective
    before = tree_digest(runs)
    (full, _p4, p6), out = compose_newest_per_row(runs, tmp_path)
    step_of = sources_of_rows(full, p6, ref / "checkpoint-6", ref / "checkpoint-4")
    expect_rows_from(out, step_of)
    expect_model_file_from(out, step_of)
    # the HF files are the partial base's (step 6), and the output is a plain HF checkpoint
    assert (out / "latest").read_text().strip() == "global_step6"
    for f in ("trainer_state.json", "scheduler.pt", "rng_state_2.pth", "config.json", "zero_to_fp32.py"):
        assert (out / f).read_bytes() == (runs / "partial-step6" / f).read_bytes(), f
    assert not (out / "tailor_partial.json").exists() and not (out / PARTIAL_MODEL_FILES).exists()
    assert tree_digest(runs) == before

    losses = resume_and_step(out, spec, tmp_path / "resume")  # the real HF Trainer
    assert losses and all(math.isfinite(x) for x in losses)
    assert_optim_states_equal(out, tmp_path / "resume" / "resaved")


def test_full_hf_base_takes_16bit_weights_of_partial_rows_from_their_masters(selective, tmp_path):
    runs, ref, _spec = selective
    p4 = scan(runs).checkpoints[1]
    recipe = Recipe(base=runs / "checkpoint-2", output=tmp_path / "out",
                    layers={row: runs / "partial-step4" for row in p4.saved.rows})
    run_compose(build_plan(recipe), workers=2)
    step_of = sources_of_rows(p4, p4, ref / "checkpoint-4", ref / "checkpoint-2")
    expect_rows_from(tmp_path / "out", step_of)
    expect_model_file_from(tmp_path / "out", step_of)


def test_partial_base_without_a_recorded_layout(selective, tmp_path):
    """A partial save made before any full save records no model-file layout: the output
    takes it from a full source in the recipe, and has no model file when there is none."""
    runs, ref, _spec = selective
    run = tmp_path / "run"
    shutil.copytree(runs, run)
    for step in (4, 6):
        (run / f"partial-step{step}" / PARTIAL_MODEL_FILES).unlink()
    p4 = scan(run).checkpoints[1]
    layers = {row: run / "partial-step4" for row in p4.saved.rows}
    with_full = Recipe(base=run / "partial-step6", output=tmp_path / "a",
                       layers=layers | {"layers.0": run / "checkpoint-2"})
    run_compose(build_plan(with_full), workers=1)
    step_of = sources_of_rows(p4, p4, ref / "checkpoint-4", ref / "checkpoint-6") | {"layers.0": ref / "checkpoint-2"}
    expect_model_file_from(tmp_path / "a", step_of)

    alone = Recipe(base=run / "partial-step6", output=tmp_path / "b", layers=layers)
    plan = build_plan(alone)
    assert any("model files: none" in line for line in plan.describe())
    run_compose(plan, workers=1)
    assert not (tmp_path / "b" / "model.safetensors").exists() and (tmp_path / "b" / "latest").is_file()


def test_a_damaged_model_file_layout_is_refused_with_one_line(selective, tmp_path):
    runs, _ref, _spec = selective
    run = tmp_path / "run"
    shutil.copytree(runs, run)
    (run / "partial-step6" / PARTIAL_MODEL_FILES).write_text("{not json")
    p4 = scan(run).checkpoints[1]
    recipe = write_recipe(tmp_path, run / "partial-step6", {row: run / "partial-step4" for row in p4.saved.rows})
    assert_one_line_error(tailor("--apply", recipe), 4, PARTIAL_MODEL_FILES, "unreadable model-file layout")
    assert not (tmp_path / "composed").exists()


def test_the_callback_needs_a_deepspeed_engine():
    from types import SimpleNamespace

    from tailor_tui.selective.hf import SelectiveCheckpointCallback
    from tailor_tui.selective.saver import Parity

    trainer = SimpleNamespace(model_wrapped=torch.nn.Linear(2, 2),  # a run without DeepSpeed
                              _save_checkpoint=lambda model, trial: None, args=None, state=None)
    callback = SelectiveCheckpointCallback(trainer, Parity())
    assert trainer._save_checkpoint == callback._save_checkpoint  # the Trainer's save step is the callback's
    with pytest.raises(ValueError, match="needs a DeepSpeed ZeRO-3 run"):
        trainer._save_checkpoint(None, None)
    with pytest.raises(ValueError, match="newer_saves must be"):
        SelectiveCheckpointCallback(trainer, Parity(), newer_saves="delete")
