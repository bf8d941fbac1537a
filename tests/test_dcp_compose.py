"""`--apply` of a recipe whose base is a PyTorch Distributed Checkpoint: a real FSDP2 run's layer that blew
up taken from an earlier save, per row, into a DCP checkpoint FSDP2 loads at world sizes 1 and 3 and trains
on; every key of the output bit for bit its chosen source's (torch's own `dcp.load` of each); NaN never
composed silently; a rotten source refused."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from dcp_checks import assert_archives_intact, assert_reads_as_torch, flip_chunk_byte
from helpers import assert_one_line_error, hidden, tailor, write_recipe
from test_dcp_export import load_in_fsdp2

from tailor_tui.checkpoints.dcp_checkpoint import open_dcp
from tailor_tui.dcp.metadata import MetadataIndex
from tailor_tui.dcp.reading import read_metadata


def loaded(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint, as torch's dcp.load gives it."""
    entries = dcp.FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    state = {k: torch.zeros(v.size, dtype=v.properties.dtype) for k, v in entries.items() if hasattr(v, "size")}
    dcp.load(state, checkpoint_id=folder, no_dist=True)
    return state


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.reshape(-1).contiguous().view(torch.uint8).equal(
        b.reshape(-1).contiguous().view(torch.uint8))


@pytest.mark.parametrize("world", [1, 3])
def test_a_blown_up_layer_healed_from_an_earlier_save_loads_in_fsdp2_and_trains(fsdp_run, tmp_path, world):
    run, _spec = fsdp_run("fsdp_llama")
    base, earlier = run / "step-6", run / "step-4"
    recipe = write_recipe(tmp_path, base, {"layers.1": earlier})
    done = tailor("--apply", recipe)
    assert done.returncode == 0, done.stderr
    assert "keep their weights and moments with the base's step count (6)" in done.stderr
    out = tmp_path / "composed"
    assert_archives_intact(out)
    assert assert_reads_as_torch(out)
    got, sources = loaded(out), {base: loaded(base), earlier: loaded(earlier)}
    rows = open_dcp(base).row_of_key()
    for key, tensor in got.items():
        source = earlier if rows.get(key) == "layers.1" and not key.endswith(".step") else base
        assert same_bits(tensor, sources[source][key]), (key, source.name)
    assert not any(bool(t.isnan().any()) for t in got.values() if t.is_floating_point())
    state, stepped = load_in_fsdp2(out, run.parent / run.name, world, tmp_path, spec_file=run / "spec.json")
    assert torch.equal(state["model"]["model.layers.1.mlp.down_proj.weight"],
                       sources[earlier]["model.model.layers.1.mlp.down_proj.weight"])
    assert stepped["finite"] and stepped["loss"] == stepped["loss"]


def test_nan_is_never_composed_silently(fsdp_run, tmp_path):
    run, _spec = fsdp_run("fsdp_llama")
    recipe = write_recipe(tmp_path, run / "step-6", {})
    assert_one_line_error(tailor("--apply", recipe), 8, "(row layers.1) holds 768 NaN/Inf values",
                          "--allow-nonfinite")
    assert not (tmp_path / "composed").exists() and not [p for p in hidden(tmp_path) if "tailor" in p.name]
    done = tailor("--apply", recipe, "--allow-nonfinite")
    assert done.returncode == 0, done.stderr
    assert bool(loaded(tmp_path / "composed")["model.model.layers.1.mlp.down_proj.weight"].isnan().all())


def test_dcp_recipe_errors_are_one_line_and_write_nothing(fsdp_run, tmp_path):
    run, _spec = fsdp_run("fsdp_llama")
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    base, earlier = copy / "step-6", copy / "step-4"
    assert_one_line_error(tailor("--apply", write_recipe(tmp_path, base, {"layers.9": earlier})), 3,
                          "unknown row 'layers.9'")
    assert_one_line_error(tailor("--apply", write_recipe(tmp_path, base, {"layers.1": earlier}), "--world-size",
                                 "2"), 2, "loads at any world size")
    dry = tailor("--apply", write_recipe(tmp_path, base, {"layers.1": earlier}), "--dry-run")
    assert dry.returncode == 0 and "layers.1      step-4" in dry.stdout and "dry run: nothing written" in dry.stdout
    flip_chunk_byte(earlier, "model.model.layers.1.mlp.down_proj.weight")
    assert_one_line_error(tailor("--apply", write_recipe(tmp_path, base, {"layers.1": earlier})), 4,
                          "fails its CRC-32")
    assert not (tmp_path / "composed").exists()


def test_verify_proves_a_dcp_composition_and_fails_what_differs(fsdp_run, tmp_path):
    run, _spec = fsdp_run("fsdp_llama")
    base = run / "step-6"
    recipe = write_recipe(tmp_path, base, {"layers.1": run / "step-4"})
    assert tailor("--apply", recipe).returncode == 0
    done = tailor("--verify", recipe)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "ok    layers.1      step-4" in done.stdout and "verified: every row" in done.stdout
    # the recipe now says layers.1 comes from step-2: the output holds step-4's
    (tmp_path / "other").mkdir()
    other = write_recipe(tmp_path / "other", base, {"layers.1": run / "step-2"}, output=str(tmp_path / "composed"))
    wrong = tailor("--verify", other)
    assert wrong.returncode == 7 and "FAIL  layers.1      step-2" in wrong.stdout, wrong.stdout
    assert "FAIL  layers.0" not in wrong.stdout
    # a byte of the output flipped, in a chunk of layers.2
    out = tmp_path / "composed"
    found = read_metadata(out)
    key = "model.model.layers.2.self_attn.q_proj.weight"
    info = found.storage_data[MetadataIndex(key, found.state_dict_metadata[key].chunks[-1].offsets)]
    with open(out / info.relative_path, "r+b") as f:
        f.seek(info.offset + info.length // 2)
        byte = f.read(1)
        f.seek(info.offset + info.length // 2)
        f.write(bytes([byte[0] ^ 1]))
    flipped = tailor("--verify", recipe)
    assert flipped.returncode == 7 and "FAIL  layers.2      step-6: " + key in flipped.stdout, flipped.stdout
    assert "ok    layers.1      step-4" in flipped.stdout


def test_on_a_filesystem_that_shares_blocks_the_base_files_are_clones(fsdp_run, xfs, tmp_path):
    """On XFS (reflink) each base file of the output shares the base's blocks, its archives still read and checked;
    the output loads as the one written byte by byte (--no-clone)."""
    from scratch_xfs import shared_bytes

    run, _spec = fsdp_run("fsdp_llama")
    there = xfs / "fsdp_llama"
    if not there.exists():
        shutil.copytree(run, there)
    recipe = write_recipe(xfs, there / "step-6", {"layers.1": there / "step-4"}, output="dcp-cloned")
    done = tailor("--apply", recipe)
    assert done.returncode == 0, done.stderr
    assert "sharing the base's blocks (reflink)" in done.stdout
    plain = write_recipe(tmp_path, there / "step-6", {"layers.1": there / "step-4"}, output=str(tmp_path / "plain"))
    assert tailor("--apply", plain, "--no-clone").returncode == 0
    out = xfs / "dcp-cloned"
    assert all(shared_bytes(out / f) > 0 for f in ("__0_0.distcp", "__1_0.distcp"))
    assert shared_bytes(tmp_path / "plain" / "__0_0.distcp") == 0
    ours, theirs = loaded(out), loaded(tmp_path / "plain")
    assert ours.keys() == theirs.keys() and all(same_bits(ours[k], theirs[k]) for k in ours)
    assert tailor("--verify", recipe).returncode == 0


def test_rows_from_a_save_at_another_world_size_keep_their_chunks_and_load(fsdp_run, tmp_path):
    """A row taken from a save of 3 ranks into a base of 2: its keys keep their three chunks, the others two;
    FSDP2 at 2 ranks loads the mix, each key its source's."""
    run, _spec = fsdp_run("fsdp_llama")
    other, _ = fsdp_run("fsdp_llama_3")
    recipe = write_recipe(tmp_path, run / "step-6", {"layers.1": other / "step-4", "layers.2": other / "step-4"})
    done = tailor("--apply", recipe)
    assert done.returncode == 0, done.stderr
    out = tmp_path / "composed"
    chunks = {k: len(e.chunks) for k, e in read_metadata(out).state_dict_metadata.items() if hasattr(e, "chunks")}
    assert chunks["model.model.layers.1.mlp.down_proj.weight"] == 3 and chunks["model.model.layers.0.mlp.down_proj.weight"] == 2
    got, theirs, ours = loaded(out), loaded(other / "step-4"), loaded(run / "step-6")
    rows = open_dcp(run / "step-6").row_of_key()
    for key, tensor in got.items():
        source = theirs if rows.get(key) in ("layers.1", "layers.2") and not key.endswith(".step") else ours
        assert same_bits(tensor, source[key]), key
    state, stepped = load_in_fsdp2(out, run, 2, tmp_path, spec_file=run / "spec.json")
    assert torch.equal(state["model"]["model.layers.2.self_attn.q_proj.weight"],
                       theirs["model.model.layers.2.self_attn.q_proj.weight"])
    assert stepped["finite"]
    assert tailor("--verify", recipe).returncode == 0


def test_the_plan_says_where_a_sources_hyperparameters_differ(fsdp_run, tmp_path):
    """A source whose param group 0 has another lr (its value rewritten as torch.save writes one): the plan says
    so, naming both values; the base's are kept."""
    from tailor_tui.dcp import metadata as md
    from tailor_tui.dcp.chunks import value_chunk

    run, _spec = fsdp_run("fsdp_llama")
    other = tmp_path / "step-4"
    shutil.copytree(run / "step-4", other)
    found = read_metadata(other)
    archive = value_chunk("optim.param_groups.0.lr", 0.5)
    (other / "__9_0.distcp").write_bytes(archive)
    storage = dict(found.storage_data) | {MetadataIndex("optim.param_groups.0.lr", None):
                                          md.StorageInfo("__9_0.distcp", 0, len(archive))}
    (other / md.METADATA).write_bytes(md.dumps(md.Metadata(found.state_dict_metadata, found.planner_data, storage,
                                                           found.storage_meta)))
    assert loaded_value(other, "optim.param_groups.0.lr") == 0.5
    dry = tailor("--apply", write_recipe(tmp_path, run / "step-6", {"layers.1": other}), "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert "step-4's hyperparameters differ from the base's, whose are kept: 0.lr 0.5 (the base 0.001)" in dry.stdout


def loaded_value(folder: Path, key: str):
    """A value saved as bytes, as torch's own dcp.load reads it."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    value = _load_state_dict_from_keys(keys={key}, checkpoint_id=folder)
    for part in key.split("."):
        value = value[int(part)] if isinstance(value, list) else value[part]
    return value
