"""Scanning real checkpoints, and recipe problems found before anything is written."""

from __future__ import annotations

import shutil

import pytest
from conftest import checkpoints_of

from tailor_tui.checkpoints.checkpoint import open_checkpoint
from tailor_tui.checkpoints.scan import scan
from tailor_tui.errors import CheckpointError, IncompatibleError, OutputError, RecipeError
from tailor_tui.planning.build import build_plan
from tailor_tui.planning.recipe import Recipe


def test_scan_finds_hf_checkpoints_in_step_order(real_run):
    run, spec = real_run("hf_bf16_2")
    result = scan(run)
    assert [c.step for c in result.checkpoints] == [2, 4, 6]
    c = result.checkpoints[-1]
    assert (c.kind, c.name, c.tag, c.world_size, c.dtype) == ("hf", "checkpoint-6", "global_step6", 2, "bf16")
    assert c.row_names() == ["embed_tokens", "layers.0", "layers.1", "layers.2", "layers.3", "norm", "lm_head"]
    assert not c.row("lm_head").tied and c.model_files


def test_scan_finds_save_dir_tags_with_sub_groups_and_frozen_params(real_run):
    run, spec = real_run("ds_bf16_3_subgroups")
    result = scan(run)
    assert [c.name for c in result.checkpoints] == ["global_step2", "global_step4", "global_step6"]
    c = result.checkpoints[0]
    assert (c.kind, c.world_size, c.dtype) == ("deepspeed", 3, "bf16")
    assert len(c.layout.groups) > 2  # sub_group_size split HF's two param groups
    assert "model.layers.1.mlp.up_proj.weight" in c.row("layers.1").params  # frozen, still in its row


def test_tied_lm_head_is_a_row_without_storage(real_run):
    run, spec = real_run("hf_fp32_3_tied")
    c = open_checkpoint(checkpoints_of(run, spec)[-1])
    assert c.row("lm_head").tied and not c.row("embed_tokens").tied
    # every parameter belongs to exactly one row
    owned = [p for r in c.rows for p in r.params]
    assert sorted(owned) == sorted(c.layout.param_names())


def test_tag_folder_of_an_hf_checkpoint_names_the_hf_checkpoint(real_run):
    run, spec = real_run("hf_bf16_2")
    c = open_checkpoint(run / "checkpoint-4" / "global_step4")
    assert c.kind == "hf" and c.path == run / "checkpoint-4"


def test_scan_reports_an_incomplete_checkpoint_instead_of_failing(real_run, tmp_path):
    run, spec = real_run("hf_bf16_2")
    shutil.copytree(run / "checkpoint-2", tmp_path / "checkpoint-2")
    shutil.copytree(run / "checkpoint-4", tmp_path / "checkpoint-4")
    (tmp_path / "checkpoint-4/global_step4/bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    result = scan(tmp_path)
    assert [c.name for c in result.checkpoints] == ["checkpoint-2"]
    (path, why), = result.problems
    assert path.name == "checkpoint-4" and "rank_1" in why and "incomplete" in why


def plan_for(base, layers, output):
    return build_plan(Recipe(base=base, output=output, layers=layers))


def test_unknown_row_suggests_the_closest(real_run, tmp_path):
    run, spec = real_run("hf_bf16_2")
    c2, _, c6 = checkpoints_of(run, spec)
    with pytest.raises(RecipeError, match=r"unknown row 'layer.1'; did you mean 'layers.1'"):
        plan_for(c6, {"layer.1": c2}, tmp_path / "out")


def test_full_module_path_is_accepted_but_not_twice(real_run, tmp_path):
    run, spec = real_run("hf_bf16_2")
    c2, c4, c6 = checkpoints_of(run, spec)
    plan = plan_for(c6, {"model.layers.1": c2}, tmp_path / "out")
    assert plan.sources[plan.picks["layers.1"]].path == c2
    with pytest.raises(RecipeError, match="given twice"):
        plan_for(c6, {"model.layers.1": c2, "layers.1": c4}, tmp_path / "out")


def test_tied_row_cannot_be_picked(real_run, tmp_path):
    run, spec = real_run("hf_fp32_3_tied")
    c2, _, c6 = checkpoints_of(run, spec)
    with pytest.raises(RecipeError, match="row 'lm_head' is tied to embed_tokens"):
        plan_for(c6, {"lm_head": c2}, tmp_path / "out")


def test_missing_checkpoint_names_the_row(real_run, tmp_path):
    run, spec = real_run("hf_bf16_2")
    with pytest.raises(CheckpointError, match=r"row 'layers.1': .*checkpoint-99: no such checkpoint folder"):
        plan_for(checkpoints_of(run, spec)[-1], {"layers.1": run / "checkpoint-99"}, tmp_path / "o")
    with pytest.raises(CheckpointError, match="base: .*no such checkpoint folder"):
        plan_for(run / "checkpoint-99", {}, tmp_path / "o")


def test_world_size_mismatch_is_refused(real_run, tmp_path):
    run2, spec2 = real_run("hf_bf16_2")
    run3, spec3 = real_run("ds_bf16_3_subgroups")
    with pytest.raises(IncompatibleError, match=r"row 'layers.1': checkpoint .*global_step2 cannot be "
                       r"combined with base .*checkpoint-6: it has world size 3, the base has 2"):
        plan_for(checkpoints_of(run2, spec2)[-1], {"layers.1": checkpoints_of(run3, spec3)[0]}, tmp_path / "o")


def test_model_mismatch_is_refused(real_run, tmp_path):
    tied, spec_t = real_run("hf_fp32_3_tied")
    ds, spec_d = real_run("ds_bf16_3_subgroups")
    with pytest.raises(IncompatibleError, match="no parameter lm_head.weight"):
        plan_for(checkpoints_of(ds, spec_d)[-1], {"layers.0": checkpoints_of(tied, spec_t)[0]}, tmp_path / "o")


def test_output_must_not_exist_or_touch_a_source(real_run, tmp_path):
    run, spec = real_run("hf_bf16_2")
    c2, _, c6 = checkpoints_of(run, spec)
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "file").write_text("x")
    with pytest.raises(OutputError, match=r"already exists and holds 1 entry \(file\), not written by tailor-tui .*"
                                          "--force replaces only an earlier tailor-tui output"):
        plan_for(c6, {}, tmp_path / "taken")
    with pytest.raises(OutputError, match="source checkpoint"):
        plan_for(c6, {"layers.1": c2}, c2)
    with pytest.raises(OutputError, match="source checkpoint"):
        plan_for(c6, {}, run)  # would hold the sources


def test_ranks_said_to_hold_the_same_elements_do():
    """ZeroLayout.same_holdings (the plan lists a slot's slices once per group of such ranks)
    against Slot.valid, rank by rank, on layouts of every shape: params smaller than the world,
    remainders, empty params, one rank."""
    import random

    from tailor_tui.checkpoints.layout import ZeroLayout

    rng = random.Random(0)
    for _ in range(300):
        world = rng.choice([1, 2, 3, 7, 16, 256, 512])
        groups = tuple(tuple((f"p{g}.{i}", (rng.choice([0, 1, 3, 8, 64, 100, 4096, 256_000]),))
                             for i in range(rng.randint(1, 30))) for g in range(rng.randint(1, 3)))
        layout = ZeroLayout(world, groups, ())
        held: dict[int, tuple] = {}
        for rank in range(world):
            valid = tuple(slot.valid(rank) for slot in layout.slots)
            assert held.setdefault(layout.same_holdings(rank), valid) == valid
        assert len(held) <= 2 * len(layout.slots) + 1
