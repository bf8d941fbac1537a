"""Optimizers other than Adam: tailor-tui composes Adam's per-element state (exp_avg, exp_avg_sq) beside the
fp32 masters. Any other per-element state (AMSGrad's max_exp_avg_sq, SGD's momentum_buffer, …) would be the
base's in silence, and an Adam state missing is no sign of damage: such a run is refused at planning, before
anything is read for the output (--dry-run too), in one line naming the state and the optimizer; its
statistics say the same of each cell, never that the files are corrupt (issue 59)."""

from __future__ import annotations

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
