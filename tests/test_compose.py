"""ComposedCase checkpoints hold exactly the chosen source's state for every row.

Checked with a reader that is not the compose step's code path (DeepSpeed's zero_to_fp32),
on real DeepSpeed-written checkpoints of every supported shape.
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path

import pytest
import torch
from conftest import checkpoints_of, tree_digest
from helpers import ComposedCase, compose, param_row, parity_picks
from safetensors.torch import load_file
from zero_reader import model_states, optim_states, read_full_state

from tailor_tui.compose.compose_run import run_compose
from tailor_tui.planning.build import build_plan
from tailor_tui.planning.recipe import Recipe

RUN_NAMES = ["hf_bf16_2", "hf_fp32_3_tied", "ds_bf16_3_subgroups"]










@pytest.fixture(scope="module", params=RUN_NAMES)
def composed(request, real_run, tmp_path_factory):
    run, spec = real_run(request.param)
    ckpts = checkpoints_of(run, spec)
    picks = parity_picks(spec, ckpts)
    before = tree_digest(run)
    out, events = compose(tmp_path_factory.mktemp(request.param), ckpts, picks, workers=2)
    assert tree_digest(run) == before, "a source file changed"
    return ComposedCase(spec, ckpts, out, run=run, picks=picks, events=events)


def expected_source(name: str, picks: dict[str, Path], base: Path, tied: bool = False) -> Path:
    row = param_row(name)
    if tied and row == "lm_head":
        row = "embed_tokens"  # a tied lm_head is the embedding matrix itself
    return picks.get(row, base)


def test_every_parameter_and_moment_equals_its_chosen_source(composed):
    spec, ckpts, picks, out = composed.spec, composed.ckpts, composed.picks, composed.out
    got = read_full_state(out)
    states = {c: read_full_state(c) for c in ckpts}
    names = list(got["fp32"])
    assert len(names) == len(states[ckpts[-1]]["fp32"])
    chosen_from = set()
    for key in ("fp32", "exp_avg", "exp_avg_sq"):
        for name, tensor in got[key].items():
            src = expected_source(name, picks, ckpts[-1], spec.tied)
            chosen_from.add(src)
            assert torch.equal(tensor, states[src][key][name]), f"{key} {name} differs from {src.name}"
    assert chosen_from == set(ckpts)  # the recipe really mixes three checkpoints
    # frozen parameters (no moments) are in fp32 and came from their row's source too
    for frozen in spec.frozen:
        src = expected_source(frozen, picks, ckpts[-1])
        assert torch.equal(got["fp32"][frozen], states[src]["fp32"][frozen])
        assert frozen not in got["exp_avg"]


def test_sources_really_differ(composed):
    """Guards the test above: picking a row must be observable."""
    ckpts = composed.ckpts
    a, b = read_full_state(ckpts[0]), read_full_state(ckpts[-1])
    assert not torch.equal(a["fp32"]["model.layers.1.self_attn.q_proj.weight"],
                           b["fp32"]["model.layers.1.self_attn.q_proj.weight"])


def test_everything_else_is_the_base(composed):
    spec, ckpts, out = composed.spec, composed.ckpts, composed.out
    base = ckpts[-1]
    base_optim, out_optim = optim_states(base), optim_states(out)
    for b, o in zip(base_optim, out_optim):
        assert o["zero_stage"] == b["zero_stage"] and o["partition_count"] == b["partition_count"]
        assert o["optimizer_state_dict"]["param_groups"] == b["optimizer_state_dict"]["param_groups"]
        for g, st in b["optimizer_state_dict"]["state"].items():
            assert torch.equal(torch.as_tensor(o["optimizer_state_dict"]["state"][g]["step"]),
                               torch.as_tensor(st["step"]))
        assert vars(o["loss_scaler"]) == vars(b["loss_scaler"])
    for b, o in zip(model_states(base), model_states(out)):
        for key in ("global_steps", "global_samples", "skipped_steps", "dp_world_size",
                    "lr_scheduler", "ds_config", "param_shapes", "buffer_names"):
            assert o[key] == b[key], key
    # HF files (trainer_state.json, scheduler.pt, rng, args, config) or recovery scripts: byte-equal
    root = base if spec.layout == "hf" else base.parent
    copied = [p for p in root.iterdir() if p.is_file() and p.suffix != ".safetensors"
              and p.name not in ("latest", "tailor_demo_spec.json")]
    assert copied
    for p in copied:
        assert (out / p.name).read_bytes() == p.read_bytes(), p.name
    assert (out / "latest").read_text().strip() == base.name if spec.layout == "deepspeed" else (
        (out / "latest").read_text() == (base / "latest").read_text())


def test_padding_is_zero(composed):
    spec, out = composed.spec, composed.out
    world = spec.world_size
    padded = 0
    for rank, (ms, osd) in enumerate(zip(model_states(out), optim_states(out))):
        for g, shapes in enumerate(ms["param_shapes"]):
            offset = 0
            tensors = [osd["fp32_flat_groups"][g],
                       osd["optimizer_state_dict"]["state"][g]["exp_avg"],
                       osd["optimizer_state_dict"]["state"][g]["exp_avg_sq"]]
            for shape in shapes.values():
                numel = math.prod(shape)
                part = math.ceil(numel / world)
                valid = max(0, min(part, numel - rank * part))
                for t in tensors:
                    assert not t[offset + valid: offset + part].any()
                padded += part - valid
                offset += part
    if world == 3:
        assert padded, "no padding to check"


def test_16bit_model_file_is_composed_from_sources(composed):
    spec, ckpts, picks, out = composed.spec, composed.ckpts, composed.picks, composed.out
    if spec.layout != "hf":
        pytest.skip("save_dir runs have no model.safetensors")
    got = load_file(out / "model.safetensors")
    files = {c: load_file(c / "model.safetensors") for c in ckpts}
    assert set(got) == set(files[ckpts[-1]])
    for name, tensor in got.items():
        src = expected_source(name, picks, ckpts[-1], spec.tied)
        assert torch.equal(tensor, files[src][name]), name


def test_progress_was_reported_per_rank(composed):
    spec, events = composed.spec, composed.events
    finished = {e.task for e in events if type(e).__name__ == "TaskFinished"}
    assert {f"rank {r}" for r in range(spec.world_size)} <= finished


def test_provenance_records_recipe_and_sources(composed):
    import json

    spec, ckpts, out = composed.spec, composed.ckpts, composed.out
    prov = json.loads((out / "tailor_provenance.json").read_text())
    assert prov["base"]["step"] == spec.steps
    assert {s["step"] for s in prov["sources"]} == {2, 4}
    assert prov["rows"]["layers.1"] == str(ckpts[1].resolve())
    assert "version: 1" in prov["recipe"]


def test_no_hard_links_into_sources(composed):
    run, out = composed.run, composed.out
    src_inodes = {f.stat().st_ino for f in run.rglob("*") if f.is_file()}
    assert all(f.stat().st_ino not in src_inodes for f in out.rglob("*") if f.is_file())


def test_parity_recipe_of_base_alone_reproduces_base_state(real_run, tmp_path):
    """An empty recipe gives back the base's state exactly (padding aside)."""
    run, spec = real_run("hf_bf16_2")
    ckpts = checkpoints_of(run, spec)
    out, _ = compose(tmp_path, ckpts, {})
    got, want = read_full_state(out), read_full_state(ckpts[-1])
    for key in got:
        assert got[key].keys() == want[key].keys()
        assert all(torch.equal(got[key][n], want[key][n]) for n in got[key])
    assert hashlib.sha256((out / "model.safetensors").read_bytes()).digest() is not None


def test_sharded_model_files_are_composed_shard_by_shard(real_run, tmp_path):
    """HF writes big models as model-0000i-of-0000n.safetensors plus an index."""
    import shutil

    from huggingface_hub import save_torch_state_dict

    run, spec = real_run("hf_bf16_2")
    sharded = []
    for c in checkpoints_of(run, spec):
        dst = tmp_path / "run" / c.name
        shutil.copytree(c, dst)
        weights = load_file(dst / "model.safetensors")
        (dst / "model.safetensors").unlink()
        save_torch_state_dict(weights, dst, max_shard_size="40KB")
        sharded.append(dst)
    shards = sorted(p.name for p in sharded[-1].glob("model-*.safetensors"))
    assert len(shards) > 1

    picks = parity_picks(spec, sharded)
    out, _ = compose(tmp_path, sharded, picks)
    index = "model.safetensors.index.json"
    assert (out / index).read_bytes() == (sharded[-1] / index).read_bytes()
    assert sorted(p.name for p in out.glob("*.safetensors")) == shards
    full = {c: {k: v for s in shards for k, v in load_file(c / s).items()} for c in sharded}
    for shard in shards:
        base_names = set(load_file(sharded[-1] / shard))
        got = load_file(out / shard)
        assert set(got) == base_names  # each tensor stays in the base's shard
        for name, tensor in got.items():
            assert torch.equal(tensor, full[expected_source(name, picks, sharded[-1])][name]), name


def test_rank_files_are_valid_archives_laid_out_like_the_base(composed):
    """The streaming rank writer keeps the base's zip layout and rewrites CRCs of what it changed."""
    import zipfile

    spec, ckpts, out = composed.spec, composed.ckpts, composed.out
    base_tag = ckpts[-1] / "global_step6" if spec.layout == "hf" else ckpts[-1]
    for base_file in sorted(base_tag.glob("*optim_states.pt")):
        mine = out / "global_step6" / base_file.name
        assert mine.stat().st_size == base_file.stat().st_size
        with zipfile.ZipFile(mine) as z, zipfile.ZipFile(base_file) as b:
            assert z.testzip() is None  # every record's CRC-32 matches its bytes
            assert [(i.filename, i.header_offset) for i in z.infolist()] == \
                   [(i.filename, i.header_offset) for i in b.infolist()]
            assert z.read(z.namelist()[0]) == b.read(b.namelist()[0])  # data.pkl untouched


def test_reserialising_fallback_gives_the_same_state(real_run, tmp_path, monkeypatch):
    """Archives the streaming path does not handle are re-serialised; same result."""
    from tailor_tui.compose import rank_task

    run, spec = real_run("ds_bf16_3_subgroups")
    ckpts = checkpoints_of(run, spec)
    picks = parity_picks(spec, ckpts)
    streamed, _ = compose(tmp_path / "a", ckpts, picks)
    monkeypatch.setattr(rank_task, "stream_optim_states", lambda job, out, counter: None)
    reserialised, _ = compose(tmp_path / "b", ckpts, picks)
    a, b = read_full_state(streamed), read_full_state(reserialised)
    for key in a:
        assert all(torch.equal(a[key][n], b[key][n]) for n in a[key])


def test_no_fsync_skips_every_fsync_and_writes_the_same_output(real_run, tmp_path, monkeypatch):
    """--no-fsync (durable=False) trades crash durability for speed: no fsync at all, the
    same bytes; the option travels with the composition (no process-wide switch to reset)."""
    import os

    from tailor_tui.events import TaskOptions
    from tailor_tui.verifying.against_recipe import verify_against_recipe

    run, spec = real_run("hf_bf16_2")
    ckpts = checkpoints_of(run, spec)
    picks = parity_picks(spec, ckpts)
    calls = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (calls.append(fd), real_fsync(fd)))
    durable, _ = compose(tmp_path / "a", ckpts, picks)  # workers=1: all in this process
    assert calls
    calls.clear()
    recipe = Recipe(base=ckpts[-1], output=tmp_path / "b" / "composed", layers=picks)
    run_compose(build_plan(recipe), workers=1, options=TaskOptions(durable=False))
    assert calls == []
    fast = recipe.output
    assert verify_against_recipe(build_plan(recipe, check_output=False)).ok
    for f in durable.rglob("*"):
        if f.is_file() and f.name != "tailor_provenance.json":
            assert f.read_bytes() == (fast / f.relative_to(durable)).read_bytes(), f


def test_every_file_of_a_composed_output_is_fsynced_before_it_is_published(real_run, tmp_path, monkeypatch):
    from helpers import assert_every_file_fsynced, fsynced_files

    run, spec = real_run("hf_bf16_2")
    ckpts = checkpoints_of(run, spec)
    fsynced = fsynced_files(monkeypatch)
    out, _events = compose(tmp_path, ckpts, parity_picks(spec, ckpts))  # workers=1: all in this process
    assert_every_file_fsynced(out, fsynced)


def test_workers_are_budgeted_by_what_they_hold(real_run, tmp_path):
    from tailor_tui.team.workers import STREAMING_WORKER, TORCH_WORKER, worker_memory

    run, spec = real_run("ds_bf16_3_subgroups")  # a frozen parameter: picking its row needs torch
    ckpts = checkpoints_of(run, spec)
    streaming = build_plan(Recipe(base=ckpts[-1], output=tmp_path / "a", layers={"layers.0": ckpts[0]}))
    assert worker_memory(streaming) == STREAMING_WORKER  # 1 MiB buffer: not one rank per worker
    frozen = build_plan(Recipe(base=ckpts[-1], output=tmp_path / "b", layers={"layers.1": ckpts[0]}))
    assert worker_memory(frozen) == TORCH_WORKER


def test_a_counter_of_small_steps_still_notices_a_cancel_within_32_steps():
    """ByteCounter.add looks at the cancel flag and the clock every 32 steps or MiB (a resharded
    piece of a few bytes is a step): a cancel is noticed within 32 small steps, at once after a big one,
    and every byte still counts."""
    from tailor_tui.errors import Cancelled
    from tailor_tui.events import ByteCounter, TaskProgressed

    events, cancelled = [], [False]
    counter = ByteCounter("rank 0", 10 << 20, events.append, lambda: cancelled[0], interval=0.0)
    for _ in range(100):
        counter.add(4)
    assert counter.done == 400 and any(isinstance(e, TaskProgressed) and e.done > 0 for e in events)
    cancelled[0] = True
    steps = 0
    with pytest.raises(Cancelled):
        for steps in range(1, 100):  # noqa: B007 - read after the loop
            counter.add(4)
    assert steps <= 32
    cancelled[0] = False
    counter = ByteCounter("rank 1", 10 << 20, events.append, lambda: cancelled[0])
    counter.add(4)
    cancelled[0] = True
    with pytest.raises(Cancelled):
        counter.add(1 << 20)
