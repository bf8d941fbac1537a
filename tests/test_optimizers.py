"""Every optimizer's state follows its row (issue 59): on ZeRO-3's flat partitions an optimizer keeps some states per
element (Adam's exp_avg and exp_avg_sq, AMSGrad's max_exp_avg_sq, SGD's momentum_buffer, Adagrad's sum, RMSprop's
square_avg, Adafactor's unfactored exp_avg_sq, Lion's exp_avg), each sliced per row as the fp32 masters are; every
other entry (step, Adafactor's RMS) is the base's. Real runs of each, composed with rows from two checkpoints: every
state of every rank is its pick's (an independent reader, DeepSpeed's own zero_to_fp32 code, whatever the key),
`--verify` passes the output and fails a copy with one state of one moved row taken from the base, DeepSpeed
resumes it with the state loaded equal to the picks, and the statistics find each run healthy. What cannot be
taken apart by row (a factored or 8-bit state), and checkpoints of two optimizers, are refused at planning."""

from __future__ import annotations

import json
import math
import re
import shutil

import pytest
import torch
from conftest import checkpoints_of
from helpers import (
    assert_one_line_error,
    assert_optim_states_equal,
    assert_rows_from_picks,
    compose_newest_per_row,
    expect_rows_from,
    hidden,
    param_row,
    stats_json,
    tailor,
    two_checkpoint_picks,
    write_recipe,
)
from runs import resume_and_step
from zero_reader import latest_folder, model_states, read_full_state

# each run's states kept per element, as torch's (and transformers') optimizers name them
STATES = {"ds_amsgrad": ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"), "ds_sgd": ("momentum_buffer",),
          "ds_adagrad": ("sum",), "ds_rmsprop": ("momentum_buffer", "square_avg"), "ds_adafactor": ("exp_avg_sq",),
          "ds_lion": ("exp_avg",)}


@pytest.mark.parametrize("name", sorted(STATES))
def test_every_state_an_optimizer_keeps_per_element_is_taken_from_its_rows_pick(real_run, tmp_path, name,
                                                                               monkeypatch):
    monkeypatch.setenv("TAILOR_TUI_CACHE", str(tmp_path / "cache"))
    run, spec = real_run(name)
    oldest, newest = checkpoints_of(run, spec)
    assert sorted(read_full_state(newest).keys() - {"fp32"}) == list(STATES[name])  # what the run keeps
    picks = two_checkpoint_picks(spec, oldest)
    recipe = write_recipe(tmp_path, newest, picks)
    for how in (["--dry-run"], []):
        result = tailor("--apply", recipe, *how)
        assert result.returncode == 0, result.stderr
    out = tmp_path / "composed"
    assert_rows_from_picks(out, picks, newest)
    result = tailor("--verify", recipe)
    assert result.returncode == 0, result.stdout + result.stderr

    # a copy of the output with one state of one moved row the base's, for each state the optimizer keeps
    group, offset, valid = _slice_on_rank_0(newest, "layers.1", spec.world_size)
    (base_file,) = (latest_folder(newest)[0] / latest_folder(newest)[1]).glob("*zero_pp_rank_0_*optim_states.pt")
    base = torch.load(base_file, weights_only=False)["optimizer_state_dict"]["optimizer_state_dict"]["state"][group]
    for key in STATES[name]:
        copy = tmp_path / key / "composed"
        shutil.copytree(out, copy)
        folder, tag = latest_folder(copy)
        (optim,) = (folder / tag).glob("*zero_pp_rank_0_*optim_states.pt")
        mine = torch.load(optim, weights_only=False)
        state = mine["optimizer_state_dict"]["optimizer_state_dict"]["state"][group][key]
        assert not torch.equal(state[offset: offset + valid], base[key][offset: offset + valid])  # the row moved
        state[offset: offset + valid] = base[key][offset: offset + valid]
        torch.save(mine, optim)
        result = tailor("--verify", write_recipe(tmp_path / key, newest, picks))
        assert result.returncode == 7, result.stdout + result.stderr
        assert re.search(rf"layers\.1 .*rank 0: {key} of model\.layers\.1\.", result.stdout), result.stdout

    # DeepSpeed resumes the output; the state it loaded (re-saved as loaded) is the output's, every entry (an Adagrad
    # run's through a workaround: DeepSpeed 0.19 cannot load its own ZeRO-3 Adagrad checkpoints, `demo_run`)
    resume_and_step(out, spec, tmp_path / "resume")
    assert_optim_states_equal(out, tmp_path / "resume" / "resaved")

    cells = stats_json(run)["cells"]
    assert cells and all(c["crc_ok"] and not c.get("error") and c["nonfinite"] == 0 for c in cells), cells
    assert all(c["adam_v_max"] is not None and c["adam_v_max"] > 0 for c in cells), cells


def _slice_on_rank_0(ckpt, row: str, world: int) -> tuple[int, int, int]:
    """(sub-group, offset, valid elements) of the first parameter of `row` in rank 0's flat partition, worked out
    from model_states' param_shapes as ZeRO-3 lays partitions out (each parameter's part: its elements over the
    world size, rounded up), independently of tailor-tui."""
    shapes = model_states(ckpt)[0]["param_shapes"]
    for g, group in enumerate(shapes):
        offset = 0
        for name, shape in group.items():
            numel = math.prod(shape)
            part = math.ceil(numel / world)
            if param_row(name) == row:
                return g, offset, min(part, numel)
            offset += part
    raise AssertionError(f"{row}: not in {ckpt}")


def test_checkpoints_of_two_optimizers_are_refused_at_planning_naming_both(real_run, tmp_path, monkeypatch):
    monkeypatch.setenv("TAILOR_TUI_CACHE", str(tmp_path / "cache"))
    (adam, spec), (sgd, _) = real_run("ds_amsgrad"), real_run("ds_sgd")
    base, other = checkpoints_of(adam, spec)[-1], checkpoints_of(sgd, spec)[-1]
    recipe = write_recipe(tmp_path, base, {"layers.1": other})
    for how in (["--dry-run"], [], ["--world-size", "1"]):
        result = tailor("--apply", recipe, *how)
        assert_one_line_error(result, 5, "row 'layers.1'", f"{sgd.name}/global_step4 keeps 'momentum_buffer' (SGD "
                              f"with momentum) per element, base ", f"{adam.name}/global_step4 'exp_avg', 'exp_avg_sq', "
                              "'max_exp_avg_sq' (AdamW with amsgrad)", "different optimizers")
        assert not (tmp_path / "composed").exists() and not hidden(tmp_path)


def test_an_8_bit_optimizers_state_is_refused_at_planning_as_what_it_is(real_run, tmp_path, monkeypatch):
    """A real run's rank file edited to hold what bitsandbytes' 8-bit optimizers keep beside each sub-group (a
    uint8 state of its size, a 256-value quantization map, a block-wise scale), torch's format kept: refused at
    planning (--dry-run too) in one line naming the optimizer and the state, exit 5, never called corrupt."""
    from helpers import edit_structure

    from tailor_tui.formats.pickled import StorageRef
    from tailor_tui.formats.ptpickle import tensor

    monkeypatch.setenv("TAILOR_TUI_CACHE", str(tmp_path / "cache"))
    run, spec = real_run("ds_sgd")
    shutil.copytree(run, tmp_path / "run")
    oldest, newest = checkpoints_of(tmp_path / "run", spec)

    def eight_bit(obj):
        made = {}
        for entry in obj["optimizer_state_dict"]["optimizer_state_dict"]["state"].values():
            qmap, absmax = StorageRef("", 4, 256, "FloatStorage"), StorageRef("", 4, 1, "FloatStorage")
            entry["qmap1"], entry["absmax1"] = tensor(qmap, (256,)), tensor(absmax, (1,))
            made |= {id(qmap): bytes(1024), id(absmax): bytes(4)}
        return made

    for optim in newest.glob("*optim_states.pt"):
        edit_structure(optim, eight_bit)
    recipe = write_recipe(tmp_path, newest, {"layers.1": oldest})
    for how in (["--dry-run"], []):
        result = tailor("--apply", recipe, *how)
        assert_one_line_error(result, 5, "optim_states.pt: its optimizer keeps 'absmax1' of shape [1] for a "
                              "sub-group of", "not one value per element (a factored or block-wise state)")
        assert "corrupt" not in result.stderr
        assert not (tmp_path / "composed").exists() and not hidden(tmp_path)


def test_the_state_rule_tells_a_state_that_cannot_be_taken_apart_by_row_from_a_damaged_file():
    """What each sub-group keeps per element (a tensor of its size, not the 0-d step) is composed per row,
    whatever the optimizer; a state of another shape (factored, block-wise: 8-bit optimizers' quantization
    blocks) or another dtype (quantized) is refused naming the optimizer and the state, never called corrupt; a
    state of a known optimizer of another size is damage (CheckpointError, exit 4), and so are sub-groups that
    keep different states."""
    from tailor_tui.errors import CheckpointError, IncompatibleError
    from tailor_tui.formats.ds_format import flat_keys, optimizer_state

    def file_of(*states):
        inner = {"fp32_flat_groups": [torch.zeros(6) for _ in states],
                 "optimizer_state_dict": {"state": {g: {"step": torch.tensor(3.0), **s} for g, s in enumerate(states)}}}
        return {"optimizer_state_dict": inner}

    def keys(*states):
        obj = file_of(*states)
        return flat_keys(optimizer_state(obj, "f.pt", (6,) * len(states)), "f.pt", (6,) * len(states))

    adam = {"exp_avg": torch.zeros(6), "exp_avg_sq": torch.zeros(6)}
    assert keys(adam, adam) == ("fp32", "exp_avg", "exp_avg_sq")
    assert keys({**adam, "max_exp_avg_sq": torch.zeros(6)}) == ("fp32", "exp_avg", "exp_avg_sq", "max_exp_avg_sq")
    assert keys({"momentum_buffer": torch.zeros(6)}) == ("fp32", "momentum_buffer")
    assert keys({"exp_avg_sq": torch.zeros(6), "RMS": 0.5}) == ("fp32", "exp_avg_sq")  # Adafactor: RMS a scalar
    assert keys({}) == ("fp32",)  # SGD without momentum: nothing but the masters
    for state, needle in (
            ({"exp_avg_sq_row": torch.zeros(2), "exp_avg_sq_col": torch.zeros(3)},
             "(factored Adafactor) keeps 'exp_avg_sq_col' of shape [3] for a sub-group of 6 elements"),
            ({"state1": torch.zeros(6, dtype=torch.uint8), "qmap1": torch.zeros(256), "absmax1": torch.zeros(1)},
             "(an 8-bit optimizer (bitsandbytes)) keeps 'absmax1' of shape [1]"),
            ({"state1": torch.zeros(6, dtype=torch.uint8)}, "keeps 'state1' per element as uint8, not fp32")):
        with pytest.raises(IncompatibleError, match=re.escape(needle)):
            keys(state)
    with pytest.raises(CheckpointError, match="exp_avg holds 5 elements, the layout says 6; the file is truncated"):
        keys({"exp_avg": torch.zeros(5), "exp_avg_sq": torch.zeros(6)})
    with pytest.raises(CheckpointError, match="sub-group 1 keeps 'exp_avg' per element, sub-group 0 'exp_avg', "
                                              "'exp_avg_sq'; the file is truncated, corrupt"):
        keys(adam, {"exp_avg": torch.zeros(6)})


def test_a_partial_save_of_an_amsgrad_run_keeps_every_state_and_composes_it_back(real_run, tmp_path):
    """The selective saver saves each saved row's max_exp_avg_sq beside its moments and records the keys it saved;
    composed back with the composer's default picks (the step-6 partial as base: its skeleton filled), every
    state of every row is the reference full save's of the step it was saved at, and DeepSpeed resumes it with
    that state."""
    run, spec = real_run("ds_selective_amsgrad")
    runs, ref = run / "run", run / "reference"
    (full, p4, p6), out = compose_newest_per_row(runs, tmp_path)
    assert "max_exp_avg_sq" in read_full_state(out)
    expect_rows_from(out, {r.name: ref / ("global_step6" if p6.holds(r.name) else "global_step4")
                           for r in full.rows})
    resume_and_step(out, spec, tmp_path / "resume")
    assert_optim_states_equal(out, tmp_path / "resume" / "resaved")


def test_an_amsgrad_composition_resharded_keeps_every_state_of_every_row(real_run, tmp_path, monkeypatch):
    """Resharded to one rank (`--world-size 1`), every state kept per element is re-partitioned with its row's
    masters: the independent reader finds each parameter's state its pick's, and `--verify` passes."""
    monkeypatch.setenv("TAILOR_TUI_CACHE", str(tmp_path / "cache"))
    run, spec = real_run("ds_amsgrad")
    oldest, newest = checkpoints_of(run, spec)
    picks = two_checkpoint_picks(spec, oldest)
    recipe = write_recipe(tmp_path, newest, picks)
    for command in (["--apply", recipe, "--world-size", "1"], ["--verify", recipe, "--world-size", "1"]):
        result = tailor(*command)
        assert result.returncode == 0, result.stdout + result.stderr
    assert_rows_from_picks(tmp_path / "composed", picks, newest)


def test_a_non_finite_value_in_any_state_the_optimizer_keeps_is_counted_and_guarded(real_run, tmp_path, monkeypatch):
    """RMSprop with momentum keeps square_avg (the statistics' `v max`) and momentum_buffer: one +Inf in
    layers.1's momentum_buffer on one rank (written back as torch saves it) makes its cell unhealthy, and an
    output that would keep it is refused (exit 8); taking layers.1 from the earlier checkpoint composes."""
    monkeypatch.setenv("TAILOR_TUI_CACHE", str(tmp_path / "cache"))
    run, spec = real_run("ds_rmsprop")
    shutil.copytree(run, tmp_path / "run")
    oldest, newest = checkpoints_of(tmp_path / "run", spec)
    group, offset, _valid = _slice_on_rank_0(newest, "layers.1", spec.world_size)
    (optim,) = newest.glob("*zero_pp_rank_0_*optim_states.pt")
    obj = torch.load(optim, weights_only=False)
    obj["optimizer_state_dict"]["optimizer_state_dict"]["state"][group]["momentum_buffer"][offset] = float("inf")
    torch.save(obj, optim)
    cells = {(c["row"], c["checkpoint"].rsplit("/", 1)[-1]): c for c in stats_json(tmp_path / "run")["cells"]}
    assert cells["layers.1", newest.name]["nonfinite"] == 1, cells["layers.1", newest.name]
    assert all(c["nonfinite"] == 0 for key, c in cells.items() if key != ("layers.1", newest.name)), cells
    result = tailor("--apply", write_recipe(tmp_path, newest, {"layers.0": oldest}))
    assert_one_line_error(result, 8, "layers.1")
    assert not (tmp_path / "composed").exists()
    result = tailor("--apply", write_recipe(tmp_path, newest, {"layers.1": oldest}))
    assert result.returncode == 0, result.stderr


def test_ranks_of_one_checkpoint_that_keep_different_states_are_refused_as_damage(real_run, tmp_path, monkeypatch):
    """Planning reads the state's keys from a checkpoint's first rank; each writer checks every rank file it reads
    against them: rank 1 of an SGD checkpoint edited to keep a second state per element (written back as torch
    saves it) is refused in one line naming the file (exit 4), nothing published."""
    monkeypatch.setenv("TAILOR_TUI_CACHE", str(tmp_path / "cache"))
    run, spec = real_run("ds_sgd")
    shutil.copytree(run, tmp_path / "run")
    oldest, newest = checkpoints_of(tmp_path / "run", spec)
    (optim,) = newest.glob("*zero_pp_rank_1_*optim_states.pt")
    obj = torch.load(optim, weights_only=False)
    for entry in obj["optimizer_state_dict"]["optimizer_state_dict"]["state"].values():
        entry["square_avg"] = entry["momentum_buffer"].clone()
    torch.save(obj, optim)
    result = tailor("--apply", write_recipe(tmp_path, newest, {"layers.1": oldest}), "--allow-nonfinite")
    assert_one_line_error(result, 4, optim.name, "keeps fp32, momentum_buffer, square_avg per sub-group, the "
                          "checkpoint's first rank fp32, momentum_buffer; its ranks disagree")
    assert not (tmp_path / "composed").exists() and not hidden(tmp_path)


def test_a_partial_saves_unreadable_recorded_keys_are_refused(real_run, tmp_path, monkeypatch):
    """The keys a rows file records (the selective saver's) are checked as read: a list that does not start with
    the masters is refused in one line naming the file (exit 4), never guessed."""
    from safetensors.torch import load_file, save_file

    from tailor_tui.formats.safetensors_in import safetensors_header

    monkeypatch.setenv("TAILOR_TUI_CACHE", str(tmp_path / "cache"))
    run, _spec = real_run("ds_selective_amsgrad")
    shutil.copytree(run / "run", tmp_path / "run")
    partial = tmp_path / "run" / "partial-step4"
    rows = next(partial.rglob("tailor_rows_rank_0.safetensors"))
    metadata = safetensors_header(rows)[0]["__metadata__"]
    assert json.loads(metadata["keys"]) == ["fp32", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"]
    save_file(load_file(rows), rows, metadata={**metadata, "keys": json.dumps(["exp_avg", "fp32"])})
    saved = json.loads((partial / "tailor_partial.json").read_text())["rows"]
    result = tailor("--apply", write_recipe(tmp_path, tmp_path / "run" / "global_step2", {saved[0]: partial}))
    assert_one_line_error(result, 4, rows.name, "its recorded keys are unreadable; the partial checkpoint is corrupt")
    assert not (tmp_path / "composed").exists() and not hidden(tmp_path)
