"""The selective callback inside the HF Trainer's other machinery, on real Trainer runs.

load_best_model_at_end ends with the best step's weights; save_total_limit bounds the saves
and recovery still verifies; every save, partial ones too, fires on_save after the Trainer's
logging and evaluation; a relaunch resumes the newest state through resume_point, continues
the strategy's schedule, and one from an older state is refused or sets newer saves aside.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from conftest import tree_digest
from helpers import assert_optim_states_equal, tailor
from runs import continue_run
from safetensors import safe_open

from tailor_tui.checkpoints.scan import scan
from tailor_tui.planning.recipe_draft import RecipeDraft
from tailor_tui.planning.recipe_file import save_recipe
from tailor_tui.selective.run_saves import newest_holders, removable, run_saves
from tailor_tui.selective.saver import Filter, Parity


@pytest.fixture(scope="module")
def best_limit(real_run):
    out, spec = real_run("hf_selective_best_limit")
    return out, out / "run", spec


def test_the_best_step_is_saved_in_full_and_loaded_at_the_end(best_limit):
    out, run, _ = best_limit
    state = json.loads((run / "partial-step10" / "trainer_state.json").read_text())
    assert state["best_model_checkpoint"].endswith("checkpoint-4") and state["best_global_step"] == 4
    with safe_open(out / "final" / "model.safetensors", "pt") as final, \
            safe_open(out / "reference" / "checkpoint-4" / "model.safetensors", "pt") as best:
        assert set(final.keys()) == set(best.keys())
        for name in final.keys():
            assert torch.equal(final.get_tensor(name), best.get_tensor(name)), name


def test_save_total_limit_keeps_what_the_newest_state_needs_and_recovery_verifies(best_limit, tmp_path):
    _, run, _ = best_limit
    # 2 full (step 2) and 4 (the best, full); 6, 8, 10 partial. Kept: the two newest, which hold
    # every row's newest copy, and the best (the newest full); steps 2 and 6 are gone.
    assert sorted(p.name for p in run.iterdir() if p.is_dir()) == ["checkpoint-4", "partial-step10", "partial-step8"]
    composition = RecipeDraft.start([c for c in scan(run).checkpoints])
    composition.output = tmp_path / "recovered"
    recipe = save_recipe(composition.to_recipe(), tmp_path / "recover.yaml")
    assert tailor("--apply", recipe).returncode == 0
    verified = tailor("--verify", recipe)
    assert verified.returncode == 0, verified.stdout + verified.stderr


def test_every_save_fires_on_save_and_a_partial_state_has_its_step_logged(best_limit):
    out, run, _ = best_limit
    assert (out / "on_save.txt").read_text().split() == ["2", "4", "6", "8", "10"]
    history = json.loads((run / "partial-step8" / "trainer_state.json").read_text())["log_history"]
    assert any(h.get("step") == 8 and "loss" in h for h in history)  # written after the step's log
    assert any(h.get("step") == 8 and "eval_loss" in h for h in history)  # and its evaluation


@pytest.fixture
def parity_run(real_run, tmp_path):
    out, spec = real_run("hf_selective_parity")  # 3 ranks: full at 2, parity partials at 4 and 6
    copy = tmp_path / "out"
    shutil.copytree(out, copy)
    return copy, spec


def test_a_relaunch_from_an_older_state_is_refused(parity_run):
    out, spec = parity_run
    before = tree_digest(out / "run")
    with pytest.raises(Exception, match=r"training starts at step 2, .* holds newer saves \(partial-step4, "
                                        r"partial-step6\); resume the newest state with"):
        continue_run(out, spec, steps=8, resume="auto")  # resume_from_checkpoint=True: checkpoint-2
    assert tree_digest(out / "run") == before


def test_a_relaunch_with_resume_point_resumes_the_newest_state_and_continues_the_schedule(parity_run):
    out, spec = parity_run
    run = out / "run"
    partials = tree_digest(run / "partial-step4", run / "partial-step6")
    result = continue_run(out, spec, steps=8, resume="point", resave=out / "resume")
    assert result == {"resumed_from": str(run / "resume-step6"), "step": 8}
    assert_optim_states_equal(run / "resume-step6", out / "resume" / "resaved")  # loaded = composed
    assert tree_digest(run / "partial-step4", run / "partial-step6") == partials
    rows = json.loads((run / "partial-step8" / "tailor_partial.json").read_text())["rows"]
    p4 = json.loads((run / "partial-step4" / "tailor_partial.json").read_text())["rows"]
    assert rows == p4  # the 4th save: the same half as the 2nd (the schedule went on, no full restart)
    assert not (run / "checkpoint-8").exists()


def test_set_aside_moves_newer_saves_out_of_the_way(parity_run):
    out, spec = parity_run
    run = out / "run"
    result = continue_run(out, spec, steps=4, resume="auto", newer_saves="set_aside")
    assert result["step"] == 4
    aside = [p for p in run.iterdir() if p.name.startswith("set-aside-")]
    assert len(aside) == 1 and sorted(p.name for p in aside[0].iterdir()) == ["partial-step4", "partial-step6"]
    assert (run / "partial-step4").is_dir()  # this run's own save at step 4, not the old one
    assert {c.path.parent for c in scan(run).checkpoints} == {run, aside[0]}


def test_parity_halves_alternate_over_partial_saves_only():
    rows = ["embed_tokens", "layers.0", "layers.1", "layers.2", "norm", "lm_head"]
    odd, even = rows[1::2], rows[0::2]
    assert [Parity(full_every=2).rows_for(i, rows) for i in range(6)] == [None, odd, None, even, None, odd]
    assert [Parity().rows_for(i, rows) for i in range(4)] == [None, odd, even, odd]
    assert Filter(first=1, last=1, full_every=2).rows_for(2, rows) is None


def test_rotation_rules(tmp_path):
    from tailor_tui.selective.run_saves import Save

    full2, p4, p6, p8 = (Save(tmp_path / n, s, r) for n, s, r in (
        ("checkpoint-2", 2, None), ("partial-step4", 4, frozenset({"a"})),
        ("partial-step6", 6, frozenset({"b"})), ("partial-step8", 8, frozenset({"a"}))))
    saves = [full2, p4, p6, p8]
    assert newest_holders(saves) == {p8.path, p6.path, full2.path}
    assert removable(saves, keep_newest=1) == [p4]  # the newest full stays: the partials need it
    assert removable(saves, keep_newest=1, protect={p4.path}) == []


def test_an_interrupted_partial_save_is_not_a_column(parity_run):
    out, _ = parity_run
    run = out / "run"
    shutil.copytree(run / "partial-step6", run / ".partial-step8.saving")  # killed before publishing
    result = scan(run)
    assert ".partial-step8.saving" not in {c.path.name for c in result.checkpoints}
    assert [(p.name, "an interrupted partial save" in why and "safe to delete" in why)
            for p, why in result.problems] == [(".partial-step8.saving", True)]
    assert [s.path.name for s in run_saves(run)] == ["checkpoint-2", "partial-step4", "partial-step6"]


def test_a_save_never_replaces_a_partial_folder_of_another_run(parity_run):
    from types import SimpleNamespace

    from tailor_tui.selective.saver import save_rows

    out, _ = parity_run
    folder = out / "run" / "partial-step4"
    before = tree_digest(folder)
    engine = SimpleNamespace(zero_optimization_stage=lambda: 3)
    with pytest.raises(ValueError, match="partial-step4 was saved by another run; it is not replaced"):
        save_rows(engine, out / "run", ["layers.1"], step=4, layout="hf", lineage="another-run")
    assert tree_digest(folder) == before
