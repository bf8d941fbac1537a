"""Layer-wise selective checkpointing: partial saves from a live engine, composed back.

A real ZeRO-3 run (3 ranks, sub-groups, a frozen parameter) saves through
`tailor_tui.selective.saver` with the parity strategy: full at step 2, partial at steps 4 and
6; the same run also writes full reference checkpoints at every save. The composed
checkpoint must hold, for every row, exactly the state at the step that row was saved
(read with DeepSpeed's own zero_to_fp32 code), carry step 6's counters, and resume with
stock DeepSpeed.
"""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from conftest import tree_digest
from helpers import (
    assert_one_line_error,
    assert_optim_states_equal,
    compose_newest_per_row,
    expect_rows_from,
    param_row,
    tailor,
    write_recipe,
)
from runs import RunSpec, resume_and_step
from safetensors.torch import load_file, save_file
from zero_reader import model_states, optim_states, read_full_state

from tailor_tui.checkpoints.scan import scan
from tailor_tui.compose.compose_run import run_compose
from tailor_tui.formats.safetensors_in import safetensors_tensors
from tailor_tui.planning.build import build_plan
from tailor_tui.planning.recipe import Recipe
from tailor_tui.selective.saver import Filter, Parity

RUN = "ds_selective_parity"


@pytest.fixture(scope="module")
def selective(real_run):
    run, spec = real_run(RUN)
    return run / "run", run / "reference", spec






def test_strategies_choose_rows_like_llmtailor():
    rows = ["embed_tokens", *(f"layers.{i}" for i in range(6)), "norm", "lm_head"]
    parity = Parity()
    assert parity.rows_for(0, rows) is None  # the first save is full
    odd, even = parity.rows_for(1, rows), parity.rows_for(2, rows)
    assert set(odd) | set(even) == set(rows) and not set(odd) & set(even)
    assert Parity(full_every=3).rows_for(3, rows) is None
    flt = Filter(first=1, last=2, full_every=4)
    assert flt.rows_for(1, rows) == ["embed_tokens", "layers.0", "layers.4", "layers.5", "norm", "lm_head"]
    assert flt.rows_for(4, rows) is None


def test_partial_saves_hold_only_their_rows_and_each_ranks_own_slices(selective):
    runs, _ref, spec = selective
    result = scan(runs)
    assert not result.problems
    full, p4, p6 = result.checkpoints
    assert [c.name for c in result.checkpoints] == ["global_step2", "partial-step4", "partial-step6"]
    assert [c.step for c in result.checkpoints] == [2, 4, 6]
    rows = [r.name for r in full.rows if not r.tied]
    assert full.saved.kind == "full"
    assert sorted(p4.saved.rows) == sorted(rows[1::2]) and sorted(p6.saved.rows) == sorted(rows[0::2])
    assert (runs / "latest").read_text().strip() == "global_step2"  # a partial save is never `latest`
    for part in (p4, p6):
        held = {s.name: s for s in full.layout.slots if param_row(s.name) in part.saved.rows}
        for files in part.ranks:
            tensors = safetensors_tensors(files.rows)
            assert set(tensors) == {f"{k}/{n}" for n in held for k in ("fp32", "exp_avg", "exp_avg_sq")}
            for name, (dtype, shape, _b, _e) in tensors.items():
                assert dtype == "F32" and shape == (held[name.split("/", 1)[1]].part,)  # this rank's slice only
        optim = sum(full.sizes[f.optim_states] for f in full.ranks)
        saved = sum(part.sizes[f.rows] + part.sizes[f.skeleton] for f in part.ranks)
        assert saved < 0.75 * optim


def test_newest_per_row_composes_the_saved_states_and_resumes(selective, tmp_path):
    runs, ref, spec = selective
    before = tree_digest(runs)
    (full, p4, p6), out = compose_newest_per_row(runs, tmp_path)
    expect_rows_from(out, {r.name: ref / ("global_step6" if p6.holds(r.name) else "global_step4")
                           for r in full.rows})
    # the engine-level state is the partial base's: counters, per-sub-group steps, param groups
    for mine, theirs in zip(optim_states(out), optim_states(ref / "global_step6"), strict=True):
        assert mine["optimizer_state_dict"]["param_groups"] == theirs["optimizer_state_dict"]["param_groups"]
        for g, st in mine["optimizer_state_dict"]["state"].items():
            assert torch.equal(torch.as_tensor(st["step"]), torch.as_tensor(theirs["optimizer_state_dict"]["state"][g]["step"]))
    for mine, theirs in zip(model_states(out), model_states(ref / "global_step6"), strict=True):
        assert mine["global_steps"] == theirs["global_steps"] == 6
        assert mine["lr_scheduler"] == theirs["lr_scheduler"]
        for k, v in mine["frozen_param_fragments"].items():
            assert torch.equal(v, theirs["frozen_param_fragments"][k])
    assert tree_digest(runs) == before

    losses = resume_and_step(out, spec, tmp_path / "resume")
    assert losses and all(math.isfinite(x) for x in losses)
    assert_optim_states_equal(out, tmp_path / "resume" / "resaved")  # what DeepSpeed loaded


def test_full_base_streams_rows_from_partial_checkpoints(selective, tmp_path):
    runs, ref, _spec = selective
    p4 = scan(runs).checkpoints[1]
    recipe = Recipe(base=runs / "global_step2", output=tmp_path / "out",
                    layers={row: runs / "partial-step4" for row in p4.saved.rows})
    run_compose(build_plan(recipe), workers=1)
    expect_rows_from(tmp_path / "out", {r.name: ref / ("global_step4" if p4.holds(r.name) else "global_step2")
                                        for r in p4.rows})


def test_rows_a_partial_checkpoint_did_not_save_are_refused(selective, tmp_path):
    runs, _ref, _spec = selective
    path = write_recipe(tmp_path, runs / "partial-step6", {})
    assert_one_line_error(tailor("--apply", path), 3, "partial-step6 is a partial checkpoint without rows",
                          "layers.0", "pick a source")
    path = write_recipe(tmp_path, runs / "global_step2", {"layers.1": runs / "partial-step4"})
    assert_one_line_error(tailor("--apply", path), 3, "layers.1", "did not save it", "layers.0")
    assert not (tmp_path / "composed").exists()


def test_partial_model_states_are_what_deepspeed_writes(selective):
    """The model_states of a partial save equal a full save's of the same step (same
    placeholders, buffers, counters, scheduler): DeepSpeed wrote both."""
    runs, ref, _spec = selective
    for mine, theirs in zip(model_states(runs / "partial-step4" / "global_step4"),
                            model_states(ref / "global_step4"), strict=True):
        assert mine.keys() == theirs.keys()
        for k, v in mine["module"].items():
            assert v.shape == theirs["module"][k].shape, k  # ZeRO-3 placeholders, not full weights
        assert mine["global_steps"] == theirs["global_steps"] and mine["lr_scheduler"] == theirs["lr_scheduler"]


def _copy_run(runs, tmp_path):
    dst = tmp_path / "run"
    shutil.copytree(runs, dst)
    return dst


def test_damaged_partial_checkpoints_are_refused_with_one_line(selective, tmp_path):
    runs, _ref, _spec = selective
    run = _copy_run(runs, tmp_path)
    p4 = run / "partial-step4"
    layers = {row: p4 for row in scan(run).checkpoints[1].saved.rows}
    recipe = write_recipe(tmp_path, run / "global_step2", layers)

    # a manifest from a newer tailor-tui: the scanner says why it skips it, --apply refuses it
    manifest = json.loads((p4 / "tailor_partial.json").read_text())
    (p4 / "tailor_partial.json").write_text(json.dumps(manifest | {"version": 2}))
    assert any("version 2" in why for _p, why in scan(run).problems)
    assert_one_line_error(tailor("--apply", recipe), 4, "tailor_partial.json", "version 2")
    (p4 / "tailor_partial.json").write_text(json.dumps(manifest))

    # a truncated rows file is refused before anything is written
    rows = p4 / "global_step4" / "tailor_rows_rank_1.safetensors"
    good = rows.read_bytes()
    rows.write_bytes(good[: len(good) // 2])
    assert_one_line_error(tailor("--apply", recipe), 4, "tailor_rows_rank_1.safetensors", "truncated")
    # a whole file that lacks a parameter's slice
    rows.write_bytes(good)
    tensors = load_file(rows)
    dropped = sorted(tensors)[0]
    save_file({k: v for k, v in tensors.items() if k != dropped}, rows)
    assert_one_line_error(tailor("--apply", recipe), 4, "has no tensor", dropped)
    rows.write_bytes(good)

    # a partial base whose optimizer skeleton is not one
    skeleton = run / "partial-step6" / "global_step6" / "tailor_optim_skeleton_rank_0.pt"
    torch.save({"optimizer_state_dict": {}}, skeleton)
    p6_recipe = write_recipe(tmp_path, run / "partial-step6", layers)
    assert_one_line_error(tailor("--apply", p6_recipe), 4, "tailor_optim_skeleton_rank_0.pt", "skeleton")
    assert not (tmp_path / "composed").exists()


def test_save_rows_refuses_unknown_rows():
    from types import SimpleNamespace

    from run_models import build_model

    from tailor_tui.selective.saver import _resolve_rows, engine_rows

    engine = SimpleNamespace(module=build_model(RunSpec(layers=2)))  # only its module is read
    assert _resolve_rows(engine_rows(engine), ["model.layers.1", "lm_head"]) == {"layers.1", "lm_head"}
    with pytest.raises(ValueError, match="unknown row 'layers.99'.*embed_tokens"):
        _resolve_rows(engine_rows(engine), ["layers.99"])


def test_a_partial_base_is_composed_by_streaming_workers(selective, tmp_path):
    """A partial base's optim file is written without torch: its workers are budgeted as streaming
    ones (one per core), not as torch ones."""
    from tailor_tui.team.workers import STREAMING_WORKER, worker_memory

    runs, _ref, _spec = selective
    full, p4, p6 = scan(runs).checkpoints
    recipe = Recipe(base=runs / "partial-step6", output=tmp_path / "out",
                    layers={row: runs / "partial-step4" for row in p4.saved.rows if not p6.holds(row)}
                    | {row: runs / "global_step2" for row in full.row_names()
                       if not p6.holds(row) and not p4.holds(row)})
    assert worker_memory(build_plan(recipe)) == STREAMING_WORKER


def test_a_shared_block_is_a_row_partial_saves_save_whole_or_not_at_all(real_run, tmp_path):
    """Issue 60 (7), in selective saves: the saver's rows are the scan's, so Zamba2's shared block
    (`layers.1.shared_transformer`, run by layers 1 and 3) is a row the strategy saves or leaves whole; each
    row of the newest-per-row composition equals the reference save of the step that saved it."""
    run, _spec = real_run("ds_zamba2_selective")
    runs, ref = run / "run", run / "reference"
    (full, p4, p6), out = compose_newest_per_row(runs, tmp_path)
    block = "layers.1.shared_transformer"
    assert block in [r.name for r in full.rows] and (p4.holds(block) != p6.holds(block))
    saved = {r.name: ("global_step6" if p6.holds(r.name) else "global_step4") for r in full.rows if not r.tied}
    owner = {n: r.name for r in full.rows for n in r.params}
    owner |= {alias: owner[target] for r in full.rows for alias, target in r.aliases}  # (zero_to_fp32 names them too)
    mine, refs = read_full_state(out), {tag: read_full_state(ref / tag) for tag in set(saved.values())}
    for key, tensors in mine.items():
        for name, value in tensors.items():
            assert torch.equal(value, refs[saved[owner[name]]][key][name]), (key, name)
