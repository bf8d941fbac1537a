"""An independent reader of ZeRO-3 checkpoints, built on DeepSpeed's own code.

Full fp32 weights come from DeepSpeed's `get_fp32_state_dict_from_zero_checkpoint`;
every optimizer state kept per element (whatever its key: any tensor of a sub-group's state as large as
the sub-group's flat fp32 partition: Adam's exp_avg and exp_avg_sq, AMSGrad's max_exp_avg_sq, SGD's
momentum_buffer, …) is reassembled by feeding its per-rank flat tensors to the same DeepSpeed routine
(`_zero3_merge_trainable_params`) that zero_to_fp32 uses for the weights. None of tailor-tui's
partition code is involved.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import torch
from deepspeed.utils import zero_to_fp32 as z


def latest_folder(ckpt: Path) -> tuple[Path, str]:
    """(folder holding `latest`, tag) for an HF checkpoint-N folder or a tag folder."""
    ckpt = Path(ckpt)
    if (ckpt / "latest").is_file():
        return ckpt, (ckpt / "latest").read_text().strip()
    return ckpt.parent, ckpt.name


def read_full_state(ckpt: Path) -> dict[str, dict[str, torch.Tensor]]:
    """{"fp32": {...}, "exp_avg": {...}, "exp_avg_sq": {...}} (an Adam run's; each run's own states kept per
    element), full tensors by param name."""
    folder, tag = latest_folder(ckpt)
    if any(not _is_zip(f) for f in (folder / tag).glob("*.pt")):
        # zero_to_fp32 memory-maps, which torch's legacy format does not allow: read a copy
        # re-saved by torch in the zip format
        with tempfile.TemporaryDirectory() as tmp:
            copy = Path(tmp) / tag
            shutil.copytree(folder / tag, copy)
            for f in copy.glob("*.pt"):
                torch.save(torch.load(f, weights_only=False), f)
            (Path(tmp) / "latest").write_text(tag)
            return read_full_state(Path(tmp))
    out = {"fp32": z.get_fp32_state_dict_from_zero_checkpoint(str(folder), tag=tag)}
    tag_dir = folder / tag
    model_states = z.parse_model_states(z.get_model_state_files(str(tag_dir)))
    optim_files = z.get_optim_files(str(tag_dir))
    flats: dict[str, list] = {}
    for f in optim_files:
        state = torch.load(f, map_location="cpu", weights_only=False)["optimizer_state_dict"]
        groups = state["optimizer_state_dict"]["state"]
        sizes = [flat.numel() for flat in state["fp32_flat_groups"]]
        keys = per_element_keys(groups, sizes)
        for key in keys:
            flats.setdefault(key, []).append([groups[g][key] for g in sorted(groups)])
        assert flats.keys() == set(keys), f"{f}: keeps {keys} per element, rank 0 {sorted(flats)}"
    for key, per_rank in flats.items():
        merged: dict = {}
        z._zero3_merge_trainable_params(merged, len(optim_files), per_rank, model_states)
        out[key] = z.to_torch_tensor(merged)
    return out


def per_element_keys(groups: dict, sizes: list[int]) -> list[str]:
    """The keys of every sub-group's state (`groups`) that are tensors of its flat partition's size (`sizes`)."""
    found = [sorted(k for k, v in groups.get(g, {}).items() if torch.is_tensor(v) and v.dim() > 0 and v.numel() == n)
             for g, n in enumerate(sizes)]
    assert all(keys == found[0] for keys in found), found
    return found[0]


def optim_states(ckpt: Path) -> list[dict]:
    """The inner optimizer dict of every rank, in rank order (trusted test files only)."""
    folder, tag = latest_folder(ckpt)
    files = z.get_optim_files(str(folder / tag))
    return [torch.load(f, map_location="cpu", weights_only=False)["optimizer_state_dict"] for f in files]


def model_states(ckpt: Path) -> list[dict]:
    folder, tag = latest_folder(ckpt)
    files = z.get_model_state_files(str(folder / tag))
    return [torch.load(f, map_location="cpu", weights_only=False) for f in files]


def _is_zip(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"PK\x03\x04"
