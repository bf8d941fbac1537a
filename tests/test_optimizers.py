"""Optimizers other than Adam: tailor-tui composes Adam's per-element state (exp_avg, exp_avg_sq) beside the
fp32 masters. Any other per-element state (AMSGrad's max_exp_avg_sq, SGD's momentum_buffer, …) would be the
base's in silence, and an Adam state missing is no sign of damage: such a run is refused at planning, before
anything is read for the output (--dry-run too), in one line naming the state and the optimizer; its
statistics say the same of each cell, never that the files are corrupt (issue 59)."""

from __future__ import annotations

import re

import pytest
from conftest import checkpoints_of
from helpers import assert_one_line_error, hidden, stats_json, tailor, write_recipe

CASES = {"ds_amsgrad": ("'exp_avg', 'exp_avg_sq', 'max_exp_avg_sq' per element", "AdamW with amsgrad"),
         "ds_sgd": ("'momentum_buffer' per element", "SGD with momentum")}


@pytest.mark.parametrize("name", sorted(CASES))
def test_another_optimizers_state_is_refused_at_planning_and_never_called_corrupt(real_run, tmp_path, name,
                                                                                 monkeypatch):
    monkeypatch.setenv("TAILOR_TUI_CACHE", str(tmp_path / "cache"))
    run, spec = real_run(name)
    (ckpt,) = checkpoints_of(run, spec)
    recipe = write_recipe(tmp_path, ckpt, {"layers.1": ckpt})
    for how in (["--dry-run"], [], ["--world-size", "1"]):
        result = tailor("--apply", recipe, *how)
        assert_one_line_error(result, 5, "optim_states.pt", *CASES[name], "compose checkpoints of an Adam")
        assert not (tmp_path / "composed").exists() and not hidden(tmp_path)
    errors = {c.get("error") or "" for c in stats_json(run)["cells"]}  # each cell names its rank's file
    assert errors and all(needle in e for e in errors for needle in CASES[name]), errors
    assert not any("corrupt" in e for e in errors), errors


def test_the_state_rule_tells_another_optimizer_from_a_damaged_file():
    """What each sub-group keeps per element (a tensor of its size, not the 0-d step) names the optimizer; an
    Adam state of another size is damage, named as such (CheckpointError, exit 4), never another optimizer."""
    import torch

    from tailor_tui.errors import CheckpointError, IncompatibleError
    from tailor_tui.formats.ds_format import optimizer_state

    def file_of(**state):
        inner = {"fp32_flat_groups": [torch.zeros(6)], "optimizer_state_dict": {"state": {0: {"step": torch.tensor(3.0),
                                                                                              **state}}}}
        return {"optimizer_state_dict": inner}

    adam = {"exp_avg": torch.zeros(6), "exp_avg_sq": torch.zeros(6)}
    assert optimizer_state(file_of(**adam), "f.pt", (6,))
    for state, needle in (({**adam, "max_exp_avg_sq": torch.zeros(6)}, "AdamW with amsgrad"),
                          ({"momentum_buffer": torch.zeros(6)}, "SGD with momentum"),
                          ({}, "keeps nothing per element (SGD without momentum)"),
                          ({"exp_avg": torch.zeros(6)}, "'exp_avg' per element (Lion")):
        with pytest.raises(IncompatibleError, match=re.escape(needle)):
            optimizer_state(file_of(**state), "f.pt", (6,))
    with pytest.raises(CheckpointError, match="exp_avg holds 5 elements, the layout says 6; the file is truncated"):
        optimizer_state(file_of(exp_avg=torch.zeros(5), exp_avg_sq=torch.zeros(6)), "f.pt", (6,))


def test_the_selective_saver_refuses_to_save_another_optimizers_run_partially(tmp_path):
    """A partial save holds Adam's state of the rows it saves: of an AMSGrad run it would lose max_exp_avg_sq.
    The saver refuses (the training script gets the one line), and no partial save is published; the full
    save before it stands."""
    from tailor_tui.runs.demo_run import RunSpec, make_run

    spec = RunSpec(layout="deepspeed", steps=4, save_every=2, amsgrad=True, selective="parity")
    with pytest.raises(Exception, match=re.escape("per element (AdamW with amsgrad)")):
        make_run(tmp_path / "out", spec)
    saved = sorted(p.name for p in (tmp_path / "out" / "run").iterdir() if not p.name.startswith("."))
    assert "global_step2" in saved and not [name for name in saved if "partial" in name], saved
