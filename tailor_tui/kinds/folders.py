"""How a checkpoint's folder holds DeepSpeed's tag folder: the training loops' layouts, each a `FolderKind`
named once, asked by what differs between them (never told apart by name elsewhere).

- `HF`: the HF Trainer's `checkpoint-N`, the tag folder beside `latest`, the model's weight files (the
  16-bit `model.safetensors` or its shards, a PEFT adapter, torch-format `.bin` files: composed per row),
  `trainer_state.json` (the training log), the model's `config.json` and the loop's run-level files;
- `ACCELERATE`: Accelerate's `save_state` folder, `checkpoint_N`, DeepSpeed's tag `pytorch_model` (or
  `pytorch_model_I` for model I) beside every process's RNG state (`random_states_R.pkl`);
- `DEEPSPEED`: a tag folder of DeepSpeed's own `save_dir`, `latest` and the recovery scripts beside it, shared
  with the run's other tags.

What a checkpoint saved (every row or some) is its `SaveKind`, which files each rank holds its `RankFiles`:
independent of the folder it lies in. Torch-free.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

TRAINER_STATE = "trainer_state.json"  # in an HF checkpoint-N: the Trainer's state and log history
MODEL_CONFIG = "config.json"  # the model's config, save_pretrained's (in an HF checkpoint-N)
ACCELERATE_TAG = re.compile(r"^pytorch_model(_\d+)?$", re.ASCII)  # Accelerate's save_state: DeepSpeed's tag of model i
ACCELERATE_STATE = re.compile(r"^random_states_\d+\.pkl$", re.ASCII)  # and the RNG state of every process beside it


@dataclass(frozen=True)
class FolderKind:
    """One training loop's layout of a checkpoint folder."""

    name: str  # as recipes' provenance records and messages say it: "hf", "accelerate", "deepspeed"
    label: str  # as the composer describes it
    # named by a folder holding the tag folder beside the loop's other files, composed as a whole; else the tag
    # folder itself, in a save_dir it shares with the run's other tags
    in_folder: bool
    # holds the model's weight files (16-bit model files or shards, a PEFT adapter, torch-format `.bin`), each
    # composed per row
    weights_per_row: bool
    training_log: str | None  # the file of its training log (the loss curve), where it keeps one
    model_config: str | None  # the model's config file it keeps (an export takes it), where it keeps one


HF = FolderKind("hf", "HF Trainer", in_folder=True, weights_per_row=True, training_log=TRAINER_STATE,
                model_config=MODEL_CONFIG)
ACCELERATE = FolderKind("accelerate", "Accelerate save_state", in_folder=True, weights_per_row=False,
                        training_log=None, model_config=None)
DEEPSPEED = FolderKind("deepspeed", "DeepSpeed save_dir", in_folder=False, weights_per_row=False,
                       training_log=None, model_config=None)
FOLDER_KINDS = {kind.name: kind for kind in (HF, ACCELERATE, DEEPSPEED)}
# PyTorch Distributed Checkpoints (`checkpoints.dcp_checkpoint`), no DeepSpeed tag folder in them: one folder
# holding `.metadata` (torchtitan's `step-N`), and the HF Trainer's FSDP `checkpoint-N` (its two DCP folders
# beside its run-level files and its training log)
DCP = FolderKind("dcp", "PyTorch DCP", in_folder=True, weights_per_row=False, training_log=None, model_config=None)
TRAINER_DCP = FolderKind("hf-fsdp", "HF Trainer FSDP (DCP)", in_folder=True, weights_per_row=False,
                         training_log=TRAINER_STATE, model_config=None)


def folder_kind(folder: Path, tag: str) -> FolderKind | None:
    """`HF` or `ACCELERATE` where `folder`, whose `latest` names `tag`, is a checkpoint folder holding the tag
    folder and the training loop's other files; None for a bare DeepSpeed save_dir."""
    if (folder / TRAINER_STATE).is_file():
        return HF
    if ACCELERATE_TAG.match(tag) and any(ACCELERATE_STATE.match(p.name) for p in folder.iterdir()):
        return ACCELERATE
    return None
