"""Resharding: compose into another data-parallel world size (`--world-size M`, `world_size: M`).

Proved on real runs: every parameter's fp32 weights, exp_avg and exp_avg_sq in the output equal
its chosen source's (DeepSpeed's zero_to_fp32 reading, whatever the source's world size), and
stock DeepSpeed at world size M (the HF Trainer for HF runs) loads the output with plain
`load_checkpoint`, saves it again bit for bit and takes a finite step. DeepSpeed's sub-group rule
is checked against the same run made at 3 and at 4 ranks.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import signal
import struct
import zipfile
import zlib

import pytest
from conftest import INSTALLED_DEEPSPEED, OLDEST_DEEPSPEED, checkpoints_of, resume_with
from helpers import (
    assert_every_file_fsynced,
    assert_one_line_error,
    assert_optim_states_equal,
    assert_rows_from_picks,
    edit_structure,
    expect_rows_from,
    finish,
    flat_record,
    flip_byte,
    fsynced_files,
    hidden,
    start_apply,
    tailor,
    wait_for_line,
    write_recipe,
)
from pilot_helpers import private_copy

from tailor_tui.checkpoints.checkpoint import open_checkpoint
from tailor_tui.checkpoints.layout import pieces
from tailor_tui.errors import CheckpointError
from tailor_tui.formats.ptfile import locate, read_structure
from tailor_tui.planning.build import build_plan
from tailor_tui.planning.recipe_file import load_recipe
from tailor_tui.resharding import partition as reshard
from tailor_tui.resharding.partition import consistent_sizes, param_groups_of, plan_reshard
from tailor_tui.verifying.against_recipe import verify_against_recipe
from tailor_tui.verifying.same_content import SameContent


def with_world_size(recipe, m: int):
    recipe.write_text(recipe.read_text().replace("layers:\n", f"world_size: {m}\nlayers:\n"))
    return recipe


def resharded(tmp_path, base, picks: dict, m: int):
    """`tailor-tui --apply` of a recipe (`world_size: m`) taking `picks` over `base`: the recipe."""
    recipe = with_world_size(write_recipe(tmp_path, base, picks), m)
    result = tailor("--apply", recipe)
    assert result.returncode == 0, result.stderr
    return recipe


def verifies(recipe, *extra: str) -> None:
    verified = tailor("--verify", recipe, *extra)
    assert verified.returncode == 0, verified.stdout + verified.stderr


def rank_files(out, tag: str) -> list[str]:
    return sorted(p.name for p in (out / tag).iterdir())


def resumes_at(out, spec, m: int, tmp_path, release: str = INSTALLED_DEEPSPEED) -> None:
    """Stock DeepSpeed `release` (the HF Trainer for HF runs) at world size `m` loads `out`, saves
    what it loaded bit for bit, and takes a finite step."""
    losses = resume_with(release, out, dataclasses.replace(spec, world_size=m), tmp_path / "resume")
    assert_optim_states_equal(out, tmp_path / "resume" / "resaved")
    assert losses and all(math.isfinite(x) for x in losses), losses


def test_pieces_reassemble_every_parameter():
    """Each rank's elements at one world size, taken from the parts at another, are the flattened
    parameter's elements of that rank: for sizes that divide and sizes that do not."""
    for numel in (1, 2, 7, 100, 101, 1031):
        for a in range(1, 7):
            part_a = math.ceil(numel / a)
            parts = [list(range(numel))[r * part_a:(r + 1) * part_a] for r in range(a)]
            for b in range(1, 7):
                part_b = math.ceil(numel / b)
                for r in range(b):
                    got, at = [], 0
                    for rank, within, first, count in pieces(numel, a, b, r):
                        assert first == at and count > 0
                        got += parts[rank][within:within + count]
                        at += count
                    assert got == list(range(numel))[r * part_b:(r + 1) * part_b], (numel, a, b, r)


def test_sub_groups_are_deepspeeds_at_each_world_size(real_run):
    """The same run made at 3 and at 4 ranks (sub_group_size 2000): its sub-group boundaries move,
    and each is what tailor-tui makes of the other's."""
    run3, spec3 = real_run("ds_bf16_3_subgroups")
    run4, spec4 = real_run("ds_bf16_4_subgroups")
    c3, c4 = open_checkpoint(checkpoints_of(run3, spec3)[-1]), open_checkpoint(checkpoints_of(run4, spec4)[-1])
    assert c3.layout.groups != c4.layout.groups
    assert plan_reshard(c3, 4).layout == c4.layout and plan_reshard(c4, 3).layout == c3.layout
    assert plan_reshard(c3, 4).param_groups == param_groups_of(c4)
    assert plan_reshard(c3, 4).sub_group_size == 2000
    lo, hi = consistent_sizes(c3.layout, param_groups_of(c3))
    assert lo <= 2000 <= hi


def test_without_a_config_the_sub_groups_must_be_unambiguous(real_run, monkeypatch):
    """With no readable DeepSpeed config, the sizes the base's sub-groups allow are used when
    they all group alike at the new world size, and refused otherwise."""
    hf, hf_spec = real_run("hf_bf16_2")
    ds, ds_spec = real_run("ds_bf16_3_subgroups")
    hf_base, ds_base = open_checkpoint(checkpoints_of(hf, hf_spec)[-1]), open_checkpoint(checkpoints_of(ds, ds_spec)[-1])
    from_config = plan_reshard(hf_base, 3)
    monkeypatch.setattr(reshard, "_config", lambda ckpt: (None, "the config file /gone.json is gone or unreadable"))
    inferred = plan_reshard(hf_base, 3)
    assert inferred.layout == from_config.layout and inferred.sub_group_size is None
    with pytest.raises(CheckpointError, match="put the training's DeepSpeed config back"):
        plan_reshard(ds_base, 4)
    monkeypatch.setattr(reshard, "_config", lambda ckpt: ({"zero_optimization": {"sub_group_size": 500}}, "x"))
    with pytest.raises(CheckpointError, match="not what DeepSpeed makes of sub_group_size 500"):
        plan_reshard(ds_base, 4)


def test_4_to_2_ranks_mixing_world_sizes_resumes_in_deepspeed(real_run, tmp_path):
    """DeepSpeed layout, sub-groups, a frozen parameter; one row from a run of another world size."""
    run4, spec = real_run("ds_bf16_4_subgroups")
    run3, spec3 = real_run("ds_bf16_3_subgroups")
    c2, c4, c6 = checkpoints_of(run4, spec)
    picks = {"layers.1": c4, "norm": c2, "embed_tokens": checkpoints_of(run3, spec3)[0]}
    recipe = write_recipe(tmp_path, c6, picks)
    assert_one_line_error(tailor("--apply", recipe), 5, "world size 3, the base has 4", "world_size:")

    plan = tailor("--apply", recipe, "--world-size", "2", "--dry-run")
    assert plan.returncode == 0, plan.stderr
    assert "reshard: 4 → 2 ranks; 9 optimizer sub-group(s) (the base has 5), sub_group_size 2,000" in plan.stdout
    result = tailor("--apply", recipe, "--world-size", "2", "-j", "2")
    assert result.returncode == 0, result.stderr
    assert "4 → 2 ranks" in result.stderr and "warning: embed_tokens come(s) from" in result.stderr
    out = tmp_path / "composed"
    assert rank_files(out, c6.name) == ["bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt",
                                        "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt",
                                        "zero_pp_rank_0_mp_rank_00_model_states.pt",
                                        "zero_pp_rank_1_mp_rank_00_model_states.pt"]
    assert_rows_from_picks(out, picks, c6)
    verifies(recipe, "--world-size", "2")
    assert json.loads((out / "tailor_provenance.json").read_text())["world_size"] == 2
    resumes_at(out, spec, 2, tmp_path)


def test_hf_2_to_3_ranks_resumes_in_the_trainer(real_run, tmp_path):
    """The recipe's `world_size`; the HF layout's other files: RNG states of ranks that exist at
    both sizes are kept, a new rank gets none; the 16-bit model file is composed as always."""
    run, spec = real_run("hf_bf16_2")
    c2, c4, c6 = checkpoints_of(run, spec)
    picks = {"layers.1": c4, "lm_head": c2}
    recipe = resharded(tmp_path, c6, picks, 3)
    out = tmp_path / "composed"
    assert sorted(p.name for p in out.glob("rng_state*")) == ["rng_state_0.pth", "rng_state_1.pth"]
    assert (out / "rng_state_1.pth").read_bytes() == (c6 / "rng_state_1.pth").read_bytes()
    assert len(rank_files(out, "global_step6")) == 6
    assert_rows_from_picks(out, picks, c6)
    verifies(recipe)
    resumes_at(out, spec, 3, tmp_path)


def test_fp16_2_to_3_ranks_with_the_oldest_release(real_run, tmp_path):
    """A run DeepSpeed 0.14.4 wrote: fp16 (a dynamic loss scaler), sub-groups, a frozen parameter,
    its config passed as a file (that release records the file's path: sub_group_size is read
    from the file); 0.14.4 itself resumes at 3 ranks."""
    run, spec = real_run("ds_fp16_2_config_file", deepspeed=OLDEST_DEEPSPEED)
    c2, c4, c6 = checkpoints_of(run, spec)
    picks = {"layers.1": c2, "layers.3": c4}
    recipe = resharded(tmp_path, c6, picks, 3)
    plan = build_plan(load_recipe(recipe), check_output=False)
    assert plan.reshard.sub_group_size == 2000
    assert f"the config file {run / 'ds_config.json'}" in plan.reshard.sub_group_size_from
    out = tmp_path / "composed"
    assert_rows_from_picks(out, picks, c6)
    verifies(recipe)
    resumes_at(out, spec, 3, tmp_path, OLDEST_DEEPSPEED)


def test_tied_frozen_fp32_3_to_1_rank_takes_rank_0s_rng_state(real_run, tmp_path):
    """Tied embeddings, a frozen parameter, fp32; one process reads `rng_state.pth`."""
    run, spec = real_run("hf_fp32_3_tied")
    c2, c4, c6 = checkpoints_of(run, spec)
    picks = {"layers.2": c4, "embed_tokens": c2}  # layers.2 holds the frozen parameter
    recipe = resharded(tmp_path, c6, picks, 1)
    out = tmp_path / "composed"
    assert [p.name for p in out.glob("rng_state*")] == ["rng_state.pth"]
    assert (out / "rng_state.pth").read_bytes() == (c6 / "rng_state_0.pth").read_bytes()
    assert_rows_from_picks(out, picks, c6, tied=True)
    verifies(recipe)
    resumes_at(out, spec, 1, tmp_path)


def test_partial_base_and_sources_reshard(real_run, tmp_path):
    """Selective saves (a partial base, a partial and a full source), 3 -> 2 ranks: every row
    equals the full reference save the same run wrote at the step it was saved at."""
    run, _spec = real_run("ds_selective_parity")
    full, p4, p6 = run / "run" / "global_step2", run / "run" / "partial-step4", run / "run" / "partial-step6"
    picks = {"layers.0": p4, "layers.2": p4, "norm": p4, "layers.1": full}
    recipe = resharded(tmp_path, p6, picks, 2)
    ref = {s: run / "reference" / f"global_step{s}" for s in (2, 4, 6)}
    expect_rows_from(tmp_path / "composed", {"embed_tokens": ref[6], "layers.0": ref[4], "layers.1": ref[2],
                                             "layers.2": ref[4], "layers.3": ref[6], "norm": ref[4],
                                             "lm_head": ref[6]})
    verifies(recipe)


def test_a_legacy_format_base_reshards(real_run, tmp_path):
    run, spec = real_run("ds_legacy_serialization")
    c2, c4, c6 = checkpoints_of(run, spec)
    picks = {"layers.1": c4, "embed_tokens": c2}
    recipe = resharded(tmp_path, c6, picks, 3)
    assert_rows_from_picks(tmp_path / "composed", picks, c6)
    verifies(recipe)


@pytest.mark.parametrize("world", ["1", "3"])
def test_a_nan_row_is_refused_when_resharding(real_run, tmp_path, world):
    """The non-finite guard counts what the reshard writers read: layers.2 blew up at step 6. Into 3
    ranks, the jobs that take pieces of a file another job checks count theirs too: the same total."""
    run, spec = real_run("ds_blown_up")
    c2, c4, c6 = checkpoints_of(run, spec)
    recipe = write_recipe(tmp_path, c6, {"layers.1": c4})
    result = tailor("--apply", recipe, "--world-size", world)
    assert_one_line_error(result, 8, "layers.2", "global_step6", "global_step4", "5,120 NaN/Inf")
    assert not (tmp_path / "composed").exists() and not hidden(tmp_path)


def _inner(obj) -> dict:
    return obj["optimizer_state_dict"]


@pytest.mark.parametrize(("change", "expected"), [
    (lambda inner: inner.__setitem__("ds_zero_partition_groups", [[0, 1, 2]]),
     ("partitioned over groups of their own (AutoEP", "cannot be resharded")),
    (lambda inner: inner.__setitem__("partition_count", [3, 3]),
     ("its partition_count is [3, 3], not a ZeRO-3 world size", "reshards ZeRO stage 3")),
])
def test_optimizer_states_deepspeed_cannot_load_elsewhere_are_refused(real_run, tmp_path, change, expected):
    """0.19's AutoEP expert groups (`ds_zero_partition_groups`) and ZeRO 1/2's per-group partition
    counts: a real run's optimizer state changed to hold them is refused in one line."""
    _run, (_c2, _c4, c6) = private_copy(real_run, tmp_path, "ds_bf16_3_subgroups")
    edit_structure(next(c6.glob("*rank_0_*optim_states.pt")), lambda obj: change(_inner(obj)))
    result = tailor("--apply", write_recipe(tmp_path, c6, {}), "--world-size", "2")
    assert_one_line_error(result, 4, *expected)
    assert not (tmp_path / "composed").exists() and not hidden(tmp_path)


def test_sub_groups_that_merge_must_agree_on_their_step(real_run, tmp_path):
    """At 1 rank DeepSpeed puts parameters of the base's sub-groups 0 and 1 into one sub-group,
    which has one `step`: when theirs differ, the reshard is refused."""
    from tailor_tui.formats.pickled import StorageRef
    from tailor_tui.formats.ptpickle import tensor

    _run, (_c2, _c4, c6) = private_copy(real_run, tmp_path, "ds_bf16_3_subgroups")
    assert reshard.plan_reshard(open_checkpoint(c6), 1).layout.groups[0] != open_checkpoint(c6).layout.groups[0]

    def step_99(obj):
        storage = StorageRef("", 4, 1, "FloatStorage")
        _inner(obj)["optimizer_state_dict"]["state"][1]["step"] = tensor(storage, ())
        return {id(storage): struct.pack("<f", 99.0)}

    edit_structure(next(c6.glob("*rank_0_*optim_states.pt")), step_99)
    result = tailor("--apply", write_recipe(tmp_path, c6, {}), "--world-size", "1")
    assert_one_line_error(result, 4, "sub-groups 0 and 1 hold different 'step' values", "cannot be resharded")
    assert not (tmp_path / "composed").exists() and not hidden(tmp_path)


def test_a_corrupt_source_is_refused_when_resharding(real_run, tmp_path):
    _run, (c2, _c4, c6) = private_copy(real_run, tmp_path, "ds_bf16_3_subgroups")
    target = next(c2.glob("*rank_1_*optim_states.pt"))
    record = flip_byte(target, flat_record(target), where=0.999)
    rows = ("embed_tokens", "layers.0", "layers.1", "layers.2", "layers.3", "norm", "lm_head")
    recipe = write_recipe(tmp_path, c6, {r: c2 for r in rows})
    result = tailor("--apply", recipe, "--world-size", "2")
    assert_one_line_error(result, 4, target.name, f"record {record} fails its CRC-32 check")
    assert not (tmp_path / "composed").exists() and not hidden(tmp_path)


def test_world_sizes_that_cannot_be_are_one_line(real_run, tmp_path):
    run, spec = real_run("hf_bf16_2")
    c2, _c4, c6 = checkpoints_of(run, spec)
    recipe = write_recipe(tmp_path, c6, {"layers.1": c2})
    for bad in ("0", "-2", "two"):
        result = tailor("--apply", recipe, "--world-size", bad)
        assert result.returncode == 2 and "--world-size" in result.stderr and "at least 1" in result.stderr
    assert_one_line_error(tailor("--apply", recipe, "--world-size", "100000"), 2,
                          "--world-size 100000", "largest trainable parameter")
    for bad, needle in (("0", "'0'"), ("two", "'two'"), ("1.5", "'1.5'")):
        with_world_size(write_recipe(tmp_path, c6, {"layers.1": c2}), bad)
        assert_one_line_error(tailor("--apply", recipe), 3, "recipe.yaml:4:13", "`world_size` must be a whole number",
                              needle)
    with_world_size(write_recipe(tmp_path, c6, {"layers.1": c2}), 100000)
    assert_one_line_error(tailor("--apply", recipe), 3, "recipe.yaml:4:1", "largest trainable parameter")
    stats = tailor("--stats", run, "--world-size", "2")
    assert stats.returncode == 2 and "--world-size goes with --apply or --verify" in stats.stderr
    assert not (tmp_path / "composed").exists()


def test_cancelling_a_reshard_leaves_nothing(real_run, tmp_path):
    run, spec = real_run("hf_bf16_2")
    c2, _c4, c6 = checkpoints_of(run, spec)
    recipe = write_recipe(tmp_path, c6, {"layers.1": c2})
    proc = start_apply(recipe, "--world-size", "3", "-j", "2")
    seen = wait_for_line(proc, "rank ")
    os.killpg(proc.pid, signal.SIGINT)
    err = finish(proc, seen)
    assert proc.returncode == 130, err
    assert not (tmp_path / "composed").exists() and not hidden(tmp_path)


def test_verifying_a_resharded_output_without_its_world_size_names_the_flag(real_run, tmp_path):
    run, spec = real_run("ds_bf16_3_subgroups")
    c2, _c4, c6 = checkpoints_of(run, spec)
    recipe = write_recipe(tmp_path, c6, {"layers.2": c2})
    assert tailor("--apply", recipe, "--world-size", "2").returncode == 0
    assert_one_line_error(tailor("--verify", recipe), 2, "composed for 2 ranks", "--world-size 2")
    verifies(recipe, "--world-size", "2")
    assert_one_line_error(tailor("--verify", recipe, "--world-size", "1"), 2, "composed for 2 ranks")


@pytest.mark.parametrize("which", [0, -1])
def test_a_corrupt_source_is_refused_whichever_output_rank_takes_from_it(real_run, tmp_path, which):
    """Each source file's records are checked whole by one output rank's job (the first to take from
    it), the others read only their pieces: a flipped bit in any flat tensor of a source, whether or not
    that job takes from that tensor, is refused."""
    _run, (c2, _c4, c6) = private_copy(real_run, tmp_path, "ds_bf16_3_subgroups")
    target = next(c2.glob("*rank_1_*optim_states.pt"))
    with zipfile.ZipFile(target) as z:
        flat = sorted((i for i in z.infolist() if "/data/" in i.filename and i.file_size > 256),
                      key=lambda i: i.header_offset)
    record = flip_byte(target, flat[which].filename, where=0.5)
    rows = ("embed_tokens", "layers.0", "layers.1", "layers.2", "layers.3", "norm", "lm_head")
    recipe = write_recipe(tmp_path, c6, {r: c2 for r in rows})
    jobs = build_plan(load_recipe(recipe), world_size=5).rank_jobs()
    checked = [taken for job in jobs for taken in job.verifies]  # every source file, by one job each
    assert sorted(checked) == sorted({taken for job in jobs for taken in job.files}) and len(jobs) == 5
    result = tailor("--apply", recipe, "--world-size", "5")
    assert_one_line_error(result, 4, target.name, f"record {record} fails its CRC-32 check")
    assert not (tmp_path / "composed").exists() and not hidden(tmp_path)


def test_a_corrupt_frozen_fragment_of_a_partial_base_is_refused_when_resharding(real_run, tmp_path):
    """A partial checkpoint's files are checked by every job that takes from them, its model_states'
    frozen fragments whole too: a flipped bit in one is refused, not carried under a fresh CRC-32."""
    from tailor_tui.formats.ptfile import frozen_fragment_bytes

    run, spec = real_run("ds_selective_parity")
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    p4, p6 = copy / "run" / "partial-step4", copy / "run" / "partial-step6"
    target = next(p6.glob("*/*rank_1_*model_states.pt"))
    (fragment,) = frozen_fragment_bytes(target, list(spec.frozen)).values()
    record = flip_byte(target, fragment.record.name, where=0.5)
    recipe = with_world_size(write_recipe(tmp_path, p6, {"layers.0": p4, "layers.2": p4, "norm": p4}), 2)
    result = tailor("--apply", recipe)
    assert_one_line_error(result, 4, target.name, f"record {record} fails its CRC-32 check")
    assert not (tmp_path / "composed").exists() and not hidden(tmp_path)


def test_every_file_of_a_resharded_output_is_fsynced_before_it_is_published(real_run, tmp_path, monkeypatch):
    """Durable by default: each rank file's structure and filled tensors, model_states without frozen
    fragments included, and every folder, reach the disk before the output is renamed into place."""
    from tailor_tui.compose.compose_run import run_compose

    run, spec = real_run("hf_bf16_2")
    c2, _c4, c6 = checkpoints_of(run, spec)
    plan = build_plan(load_recipe(write_recipe(tmp_path, c6, {"layers.1": c2})), world_size=3)
    fsynced = fsynced_files(monkeypatch)
    run_compose(plan, workers=1)
    assert_every_file_fsynced(plan.output, fsynced)


def _change_element(path, tensor_of, element: int, change) -> None:
    """Change the bytes of element `element` of the tensor `tensor_of(obj)` (obj: the file's
    structure as the torch-free reader reads it) to `change(its bytes)`, in place, and set its
    record's CRC-32 anew: a file load_pt accepts, holding other bytes."""
    obj, records, prefix = read_structure(path)
    found = locate(tensor_of(obj), records, prefix)
    at = found.offset + element * found.itemsize
    with open(path, "r+b") as f:
        f.seek(at)
        old = f.read(found.itemsize)
        f.seek(at)
        f.write(change(old))
        f.seek(found.record.data_offset)
        data = f.read(found.record.size)
        for crc_at in found.record.crc_offsets:
            f.seek(crc_at)
            f.write(struct.pack("<I", zlib.crc32(data)))


def _problems(report) -> list:
    return [*report.other, *(p for found in report.problems.values() for p in found)]


def test_verifying_a_resharded_output_reports_each_changed_piece(real_run, tmp_path):
    """A rank's tensors are compared whole against their pieces side by side: one padding byte
    changed (-0.0), one byte of one piece of an exp_avg and one of a frozen fragment are each
    reported for its row, rank and piece, as piece by piece, and nothing else is."""
    run, spec = real_run("ds_bf16_3_subgroups")
    c2, _c4, c6 = checkpoints_of(run, spec)
    recipe = resharded(tmp_path, c6, {"layers.2": c2}, 5)
    plan = build_plan(load_recipe(recipe), check_output=False)
    assert verify_against_recipe(plan).ok
    jobs, zeros = plan.rank_jobs(), reshard.ZEROS
    job, g = next((job, g) for job in jobs for g, group in enumerate(job.groups)
                  if any(p.source == zeros and p.length for p in group) and sum(p.source != zeros for p in group) > 2)
    pad = next(p for p in job.groups[g] if p.source == zeros and p.length)
    piece = [p for p in job.groups[g] if p.source != zeros and p.length][1]
    frozen_job, (name, frozen) = next((j, (n, ps)) for j in jobs[::-1] for n, ps in j.frozen
                                      if j.rank != job.rank and sum(p.source != zeros for p in ps) > 1)
    fragment = [p for p in frozen if p.source != zeros and p.length][-1]
    composed = open_checkpoint(tmp_path / "composed")
    optim = composed.ranks[job.rank].optim_states
    _change_element(optim, lambda obj: obj["optimizer_state_dict"]["fp32_flat_groups"][g], pad.at,
                    lambda old: old[:-1] + bytes([old[-1] ^ 0x80]))
    _change_element(optim, lambda obj: obj["optimizer_state_dict"]["optimizer_state_dict"]["state"][g]["exp_avg"],
                    piece.at + piece.length - 1, lambda old: bytes([old[0] ^ 1]) + old[1:])
    _change_element(composed.ranks[frozen_job.rank].model_states,
                    lambda obj: obj["frozen_param_fragments"][name], fragment.at, lambda old: bytes([old[0] ^ 1]) + old[1:])
    report = verify_against_recipe(plan)
    expected = {
        pad.row: f"rank {job.rank}: padding after {pad.param} (fp32) is not zero bytes",
        piece.row: f"rank {job.rank}: exp_avg of {piece.param} (elements {piece.at}…) differs from "
                   f"{plan.sources[piece.source].name} rank {piece.rank}",
        fragment.row: f"rank {frozen_job.rank}: frozen of {name} (elements {fragment.at}…) differs from "
                      f"{plan.sources[fragment.source].name} rank {fragment.rank}",
    }
    for row, problem in expected.items():
        assert problem in report.problems[row], (problem, dict(report.problems))
    assert len(_problems(report)) == 3, _problems(report)


def test_verifying_a_resharded_output_checks_each_ranks_model_states(real_run, tmp_path):
    """Output ranks' model_states files that hold the same records are unpickled once: one whose
    bytes differ (its global_steps, CRC-32s right) is loaded and reported on its own."""
    run, spec = real_run("hf_bf16_2")
    c2, _c4, c6 = checkpoints_of(run, spec)
    recipe = resharded(tmp_path, c6, {"layers.1": c2}, 3)
    composed = open_checkpoint(tmp_path / "composed")
    files = [composed.ranks[r].model_states for r in range(3)]
    same = SameContent()
    assert same.content(files[0]) == same.content(files[2]) is not None  # rank 2 reuses rank 0's
    edit_structure(files[1], lambda obj: obj.update(global_steps=obj["global_steps"] + 1))
    report = verify_against_recipe(build_plan(load_recipe(recipe), check_output=False))
    assert _problems(report) == ["rank 1: model_states ['global_steps'] is not the base's"]
