"""`--export X --to DIR --format dcp`: a ZeRO-3 composition as a PyTorch Distributed Checkpoint.

Proved by the real consumer: FSDP2 (`fully_shard` per block and at the root, gloo, on CPU) loads each
export with `dcp.load` + `set_state_dict` at world sizes 1 to 3 (`fsdp_loop.py`: ranks forked from the test
process's server of imports, as a run's are), and every fp32 weight,
`exp_avg`, `exp_avg_sq`, step and hyperparameter it then holds equals DeepSpeed's own reassembly of the
chosen checkpoints (`zero_reader`: zero_to_fp32's routines) bit for bit; one more step trains, finite.
The export's keys, dtypes and sizes are those FSDP2 itself saves of the same model and optimizer.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path

import fsdp_loop
import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import checkpoints_of
from dcp_checks import assert_archives_intact, assert_reads_as_torch
from helpers import assert_one_line_error, flip_byte, hidden, tailor, write_recipe
from pilot_helpers import private_copy
from zero_reader import optim_states, read_full_state

from tailor_tui.checkpoints.checkpoint import open_checkpoint
from tailor_tui.dcp import chunks, metadata
from tailor_tui.kinds.zero import tensor_bytes


def load_in_fsdp2(ckpt: Path, run: Path, world: int, tmp_path: Path, spec_file: Path | None = None) -> tuple[dict, dict]:
    """(the full state FSDP2 holds after loading `ckpt` at `world` ranks, its step's loss and finiteness); the
    model and optimizer are the run's (`spec_file`: its spec, by default the DeepSpeed run's)."""
    out = tmp_path / f"loaded-{world}.pt"
    fsdp_loop.load_in_fsdp2(ckpt, spec_file or run / "tailor_demo_spec.json", world, out)
    return torch.load(out, weights_only=False), torch.load(f"{out}.step", weights_only=False)


def assert_state_from(loaded: dict, picks: dict[str, Path], rows_of: dict[str, str], base: Path) -> None:
    """Every parameter's weights and optimizer state as loaded equal the chosen checkpoint's (DeepSpeed's
    own reassembly), the key sets compared whole."""
    states: dict[Path, dict] = {}
    model, optim = loaded["model"], loaded["optim"]
    want = read_full_state(base)["fp32"]
    assert set(model) >= set(want), sorted(set(want) - set(model))
    for name in want:
        source = picks.get(rows_of[name], base)
        if source not in states:
            states[source] = read_full_state(source)
        assert torch.equal(model[name], states[source]["fp32"][name].float()), name
        kept = [key for key in states[source] if key != "fp32"]  # the optimizer's state kept per element
        if name in states[source][kept[0]]:  # trainable
            for key in kept:
                assert torch.equal(optim["state"][name][key], states[source][key][name]), (name, key)
    full = read_full_state(base)
    trainable = set(full[next(key for key in full if key != "fp32")])
    assert set(optim["state"]) == trainable


def base_groups(base: Path) -> tuple[list[dict], float]:
    inner = optim_states(base)[0]["optimizer_state_dict"]
    return inner["param_groups"], float(inner["state"][0].get("step", -1))  # SGD keeps no step


def rows_of(ckpt: Path) -> dict[str, str]:
    """{state-dict name: the row it comes with}: a tied name (a tied lm_head) with the row of its parameter."""
    found = open_checkpoint(ckpt)
    owner = {p: row.name for row in found.rows for p in row.params}
    return owner | {alias: owner[target] for row in found.rows for alias, target in row.aliases}


CASES = [
    ("hf_bf16_2", 1, {}),  # HF Trainer layout, bf16, 2 ranks; one FSDP2 rank
    ("hf_fp32_3_tied", 2, {}),  # fp32, 3 ranks, tied embeddings, a frozen parameter
    ("ds_bf16_3_subgroups", 3, {"layers.0": 0, "norm": 0}),  # DeepSpeed layout, sub-groups, frozen; composed
    ("ds_amsgrad", 1, {"layers.1": 0}),  # AdamW with amsgrad: max_exp_avg_sq too
    ("ds_sgd", 2, {}),  # SGD with momentum: momentum_buffer, no step
    ("ds_adagrad", 2, {"embed_tokens": 0}),  # Adagrad: sum, and a step tensor; one param group
    ("hf_peft_lora", 2, {"layers.0": 0}),  # LoRA: the adapters trained, the base model frozen (PeftModel's names)
]
ADAM = ("hf_bf16_2", "hf_fp32_3_tied", "ds_bf16_3_subgroups", "ds_amsgrad", "hf_peft_lora")


@pytest.mark.parametrize(("name", "world", "older"), CASES, ids=[c[0] for c in CASES])
def test_fsdp2_loads_the_export_bit_for_bit_and_trains(real_run, tmp_path, name, world, older):
    run, spec = real_run(name)
    ckpts = checkpoints_of(run, spec)
    base = ckpts[-1]
    picks = {row: ckpts[i] for row, i in older.items()}
    recipe = write_recipe(tmp_path, base, picks)
    done = tailor("--export", recipe if picks else base, "--to", tmp_path / "dcp", "--format", "dcp")
    assert done.returncode == 0, done.stderr
    assert ("param groups for AdamW" in done.stderr) == (name in ADAM), done.stderr
    assert ("note: a PEFT run" in done.stderr) == spec.peft
    assert_archives_intact(tmp_path / "dcp")
    loaded, stepped = load_in_fsdp2(tmp_path / "dcp", run, world, tmp_path)
    for folder in (tmp_path / "dcp", tmp_path / f"loaded-{world}.pt.dcp"):  # ours, and what FSDP2 saved of it
        assert assert_reads_as_torch(folder)
    assert_state_from(loaded, picks, rows_of(base), base)
    groups, step = base_groups(base)
    got = loaded["optim"]["param_groups"]
    assert len(got) == len(groups)
    for mine, theirs in zip(got, groups):
        shared = set(mine) & set(theirs) - {"params"}  # (a scheduler's `initial_lr`: for a loader that has one)
        assert shared >= {"lr", "weight_decay"}
        for key in shared:
            assert mine[key] == (tuple(theirs[key]) if key == "betas" else theirs[key]), key
    assert {float(s.get("step", -1)) for s in loaded["optim"]["state"].values()} == {step}
    assert stepped["finite"] and stepped["loss"] == stepped["loss"]
    ours = dcp.FileSystemReader(str(tmp_path / "dcp")).read_metadata().state_dict_metadata
    fsdp = dcp.FileSystemReader(str(tmp_path / f"loaded-{world}.pt.dcp")).read_metadata().state_dict_metadata
    # all FSDP2 saves of the model, but a PEFT run's frozen base weights (the pretrained ones DeepSpeed never saved)
    assert {k for k in fsdp if not (spec.peft and k.startswith("model.") and ".lora_" not in k)} <= set(ours)
    # beyond what a bare AdamW asks for: what the run's scheduler keeps in its groups (a loader with one asks)
    assert {k.split(".")[-1] for k in set(ours) - set(fsdp)} <= {"initial_lr"}
    for key in set(fsdp) & set(ours):
        entry = fsdp[key]
        assert type(ours[key]) is type(entry), key
        if hasattr(entry, "size"):
            assert (ours[key].size, ours[key].properties.dtype) == (entry.size, entry.properties.dtype), key


def test_a_partial_save_exports_its_rows(real_run, tmp_path):
    """Rows from selective (partial) saves: each as the full reference save of its step holds it."""
    from tailor_tui.checkpoints.scan import scan

    run, _spec = real_run("ds_selective_parity")
    runs, ref = run / "run", run / "reference"
    p4, p6 = (c for c in scan(runs).checkpoints if c.saved.kind == "partial")
    rows = {row: runs / "partial-step4" for row in p4.saved.rows if not p6.holds(row)}
    recipe = write_recipe(tmp_path, runs / "partial-step6", rows)
    done = tailor("--export", recipe, "--to", tmp_path / "dcp", "--format", "dcp")
    assert done.returncode == 0, done.stderr
    assert_archives_intact(tmp_path / "dcp")  # (a partial save's pieces: their CRC-32s computed as written)
    state: dict = {}
    dcp.load(state_dict=_template(tmp_path / "dcp", state), checkpoint_id=tmp_path / "dcp", no_dist=True)
    steps = {name: "global_step6" if p6.holds(row) else "global_step4" if row in rows else "global_step2"
             for name, row in rows_of(runs / "partial-step6").items()}
    assert set(steps.values()) >= {"global_step4", "global_step6"}
    references = {step: read_full_state(ref / step) for step in set(steps.values())}
    for name, step in steps.items():
        assert torch.equal(state[f"model.{name}"], references[step]["fp32"][name].float()), (name, step)
        if name in references[step]["exp_avg"]:
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(state[f"optim.state.{name}.{key}"], references[step][key][name]), (name, key)


def _template(folder: Path, state: dict) -> dict:
    """A flat state dict of every tensor the checkpoint holds, zeroed: dcp.load fills it in place."""
    for key, entry in dcp.FileSystemReader(str(folder)).read_metadata().state_dict_metadata.items():
        if hasattr(entry, "size"):
            state[key] = torch.zeros(entry.size, dtype=entry.properties.dtype)
    return state


def test_dcp_export_errors_are_one_line_and_write_nothing(real_run, tmp_path):
    _run, (c2, _c4, c6) = private_copy(real_run, tmp_path, "hf_bf16_2")
    recipe = write_recipe(tmp_path, c6, {"layers.1": c2})
    assert_one_line_error(tailor("--export", recipe, "--to", tmp_path / "m", "--format", "dcp", "--dtype", "bf16"),
                          2, "--dtype and --config go with --format hf")
    assert_one_line_error(tailor("--apply", recipe, "--format", "dcp"), 2, "go with --export")
    target = next(c2.rglob("*rank_1_*optim_states.pt"))
    sizes = tuple(open_checkpoint(c2).layout.group_sizes())
    exp_avg = tensor_bytes(target, sizes)[0, "exp_avg"].record.name  # a moment the DCP export reads
    record = flip_byte(target, exp_avg, where=0.5)
    assert_one_line_error(tailor("--export", recipe, "--to", tmp_path / "m", "--format", "dcp"), 4,
                          f"record {record} fails its CRC-32")
    assert not (tmp_path / "m").exists() and not [p for p in hidden(tmp_path) if "tailor" in p.name]
    dry = tailor("--export", c6, "--to", tmp_path / "m", "--format", "dcp", "--dry-run")
    assert dry.returncode == 0 and "dry run: nothing written" in dry.stdout and not (tmp_path / "m").exists()
    exported = write_recipe(tmp_path, c6, {}, output="m")
    assert tailor("--export", exported, "--to", tmp_path / "m", "--format", "dcp").returncode == 0
    assert_one_line_error(tailor("--verify", exported), 2, "is an export (a PyTorch Distributed Checkpoint")


def test_a_flat_range_is_the_rectangles_that_cover_it():
    """Every range of every small shape: rectangles of consecutive elements, in order, covering it once."""
    for shape in [(7,), (3, 5), (2, 3, 4), (4, 1, 3), (2, 2, 2, 3)]:
        n = int(torch.tensor(shape).prod())
        whole = torch.arange(n).reshape(shape)
        for first in range(n):
            for count in range(1, n - first + 1):
                seen = []
                found = chunks.boxes(shape, first, count)
                assert len(found) <= 2 * len(shape) - 1
                for offsets, sizes, at, k in found:
                    piece = whole[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))].flatten().tolist()
                    assert piece == list(range(at, at + k))
                    seen += piece
                assert seen == list(range(first, first + count))


def test_metadata_unpickles_as_torchs_own():
    """The `.metadata` pickled without torch loads, with torch, as torch's classes with the same fields."""
    from torch.distributed.checkpoint import metadata as tm
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    entry = metadata.TensorStorageMetadata("bfloat16", (4, 3), (metadata.ChunkStorageMetadata((0, 0), (2, 3)),
                                                              metadata.ChunkStorageMetadata((2, 0), (2, 3))))
    ours = metadata.Metadata({"model.w": entry, "optim.param_groups.0.lr": metadata.BytesStorageMetadata()},
                             {"model.w": ("model", "w"), "optim.param_groups.0.lr": ("optim", "param_groups", 0, "lr")},
                             {metadata.MetadataIndex("model.w", (2, 0)): metadata.StorageInfo("__0_0.distcp", 10, 20)},
                             metadata.StorageMeta("/out"))
    got = pickle.loads(metadata.dumps(ours))
    want = tm.Metadata({"model.w": tm.TensorStorageMetadata(
        tm.TensorProperties(dtype=torch.bfloat16), torch.Size([4, 3]),
        [tm.ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([2, 3])),
         tm.ChunkStorageMetadata(torch.Size([2, 0]), torch.Size([2, 3]))]),
        "optim.param_groups.0.lr": tm.BytesStorageMetadata()},
        planner_data={"model.w": ("model", "w"), "optim.param_groups.0.lr": ("optim", "param_groups", 0, "lr")},
        storage_data={tm.MetadataIndex("model.w", torch.Size([2, 0])): _StorageInfo("__0_0.distcp", 10, 20)},
        storage_meta=tm.StorageMeta("/out"), version="1.0.0")
    assert got == want
    assert type(got.state_dict_metadata["model.w"].size) is torch.Size
    archive = chunks.value_chunk("optim.param_groups.0.betas", (0.9, 0.999))
    assert torch.load(io.BytesIO(archive), weights_only=True) == (0.9, 0.999)
