"""A DCP checkpoint read without torch (`tailor_tui.dcp.reading`): the `.metadata` torch pickles and the
chunks its `.distcp` files hold, on checkpoints torch itself wrote (FSDP2's `dcp.save` at several world
sizes; `dcp.save` of a real model) and on tailor-tui's own exports; and refused, one line naming the file,
where the metadata or a chunk is crafted, truncated or damaged."""

from __future__ import annotations

import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from dcp_checks import assert_reads_as_torch

from tailor_tui.dcp import metadata as md
from tailor_tui.dcp.reading import locate_chunk, read_metadata
from tailor_tui.errors import CheckpointError


@pytest.fixture
def saved(tmp_path) -> Path:
    """A real model's state (bf16 and fp32 tensors, a value saved as bytes) saved by torch's dcp.save."""
    from run_models import base_model
    from runs import RunSpec

    model = base_model(RunSpec(layers=2))
    state = {"model": {k: (v.to(torch.bfloat16) if "mlp" in k else v) for k, v in model.state_dict().items()},
             "optim": {"param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "params": ["a", "b"]}]}}
    dcp.save(state, checkpoint_id=tmp_path / "saved", no_dist=True)
    return tmp_path / "saved"


def test_torch_written_checkpoints_read_as_torch_reads_them(saved):
    assert assert_reads_as_torch(saved) > 10
    found = read_metadata(saved)
    assert isinstance(found.state_dict_metadata["optim.param_groups.0.lr"], md.BytesStorageMetadata)
    assert found.planner_data["optim.param_groups.0.lr"] == ("optim", "param_groups", 0, "lr")


def _rewrite(folder: Path, change) -> None:
    """The folder's metadata as tailor-tui reads it, changed by `change(metadata) -> metadata`, written back."""
    (folder / md.METADATA).write_bytes(md.dumps(change(read_metadata(folder))))


def _first_tensor(found: md.Metadata) -> tuple[str, md.TensorStorageMetadata]:
    return next((k, e) for k, e in found.state_dict_metadata.items()
                if isinstance(e, md.TensorStorageMetadata) and len(e.size) == 2)


class _Evil:
    def __reduce__(self):
        return (os.system, ("touch /tmp/tailor-pwned",))


def _crafted_global(folder: Path) -> None:
    (folder / md.METADATA).write_bytes(pickle.dumps(_Evil()))


def _outside_the_folder(folder: Path) -> None:
    def change(found):
        index = next(iter(found.storage_data))
        info = found.storage_data[index]
        storage = dict(found.storage_data) | {index: md.StorageInfo("../" + info.relative_path, info.offset,
                                                                     info.length)}
        return md.Metadata(found.state_dict_metadata, found.planner_data, storage, found.storage_meta)
    _rewrite(folder, change)


def _chunk_outside_its_tensor(folder: Path) -> None:
    def change(found):
        key, entry = _first_tensor(found)
        chunk = entry.chunks[0]
        moved = md.ChunkStorageMetadata((entry.size[0], 0), chunk.sizes)
        entries = dict(found.state_dict_metadata) | {key: md.TensorStorageMetadata(entry.dtype, entry.size, (moved,))}
        return md.Metadata(entries, found.planner_data, found.storage_data, found.storage_meta)
    _rewrite(folder, change)


def _chunks_not_covering(folder: Path) -> None:
    def change(found):
        key, entry = _first_tensor(found)
        bigger = (entry.size[0] * 2, *entry.size[1:])
        entries = dict(found.state_dict_metadata) | {key: md.TensorStorageMetadata(entry.dtype, bigger, entry.chunks)}
        return md.Metadata(entries, found.planner_data, found.storage_data, found.storage_meta)
    _rewrite(folder, change)


@pytest.mark.parametrize(("craft", "needle"), [
    (_crafted_global, "Unsupported GLOBAL posix.system"),
    (_outside_the_folder, "not a file of the folder"),
    (_chunk_outside_its_tensor, "lies outside its"),
    (_chunks_not_covering, "its chunks hold"),
], ids=["a global not torch's", "a file outside the folder", "a chunk outside its tensor", "chunks not covering"])
def test_crafted_metadata_is_refused_in_one_line(saved, craft, needle):
    craft(saved)
    with pytest.raises(CheckpointError) as caught:
        read_metadata(saved)
    assert needle in str(caught.value) and "\n" not in str(caught.value) and str(saved) in str(caught.value)
    assert not Path("/tmp/tailor-pwned").exists()


def test_a_truncated_or_swapped_chunk_is_refused(saved, tmp_path):
    found = read_metadata(saved)
    key, entry = _first_tensor(found)
    chunk = entry.chunks[0]
    info = found.storage_data[md.MetadataIndex(key, chunk.offsets)]
    path = saved / info.relative_path
    other_key, other = next((k, e) for k, e in found.state_dict_metadata.items()
                            if isinstance(e, md.TensorStorageMetadata) and e.size != entry.size)
    fd = os.open(path, os.O_RDONLY)
    try:  # the bytes of another tensor's chunk where this one's should be
        other_info = found.storage_data[md.MetadataIndex(other_key, other.chunks[0].offsets)]
        with pytest.raises(CheckpointError, match="holds another tensor than the metadata says"):
            locate_chunk(saved, fd, entry, chunk, other_info)
    finally:
        os.close(fd)
    copy = tmp_path / "short.distcp"
    shutil.copyfile(path, copy)
    os.truncate(copy, info.offset + info.length - 1)
    fd = os.open(copy, os.O_RDONLY)
    try:
        with pytest.raises(CheckpointError, match="runs past the file's end"):
            locate_chunk(saved, fd, entry, chunk, info)
    finally:
        os.close(fd)


def test_a_real_fsdp2_runs_checkpoints_read_as_torch_reads_them(fsdp_run):
    """Every save of a real FSDP2 run (2 ranks: each tensor in two chunks), bit for bit; the layer that blew up
    before the last save holds NaN there, in its weights and its exp_avg_sq, and nowhere before."""
    run, spec = fsdp_run("fsdp_llama")
    saves = sorted(run.glob("step-*"), key=lambda p: int(p.name.split("-")[1]))
    assert [p.name for p in saves] == ["step-2", "step-4", "step-6"]
    for folder in saves:
        assert assert_reads_as_torch(folder) > 3 * 20
    (name,) = spec.blow_up
    for folder, blown in ((saves[1], False), (saves[2], True)):
        found = read_metadata(folder)
        for key in (f"model.{name}", f"optim.state.{name}.exp_avg_sq"):
            entry = found.state_dict_metadata[key]
            assert len(entry.chunks) == 2
            loaded = {key: torch.zeros(entry.size)}
            dcp.load(loaded, checkpoint_id=folder, no_dist=True)
            assert bool(loaded[key].isnan().all()) == blown, (folder.name, key)
