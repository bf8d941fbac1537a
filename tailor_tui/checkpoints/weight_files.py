"""What happens to every file of an HF checkpoint folder when it is the base of a composition.

Beside DeepSpeed's tag folder (the rank files, composed per row by the rank writers), an HF
checkpoint folder holds:

- **weight files**, whose tensors belong to rows: `model.safetensors` (or its shards), a PEFT
  adapter (`adapter_model.safetensors`), any other safetensors file (`model_files`), and torch's
  format: `pytorch_model.bin` (or its shards), `adapter_model.bin` (`bin_files`). Each is composed
  per row: every tensor from the checkpoint picked for its row; a shards' index is the base's;
- **weight files tailor-tui does not compose** (a `.bin` in torch's legacy, non-zip format):
  copied from the base only while every row they hold comes from the base; otherwise the
  composition is refused before anything is written;
- **run-level files** (`trainer_state.json`, `scheduler.pt`, RNG states, `training_args.bin`,
  configs, tokenizer files, and anything unknown): copied from the base, and listed as such.

Which row a weight-file tensor belongs to is `rows.RowIndex`'s answer for its name. transformers
5 saves many tensors under other names than the model's parameters (GPT-NeoX's `lm_head.weight`
as `embed_out.weight`, BEiT's `beit.layers.N` as `beit.encoder.layer.N`, a Llava's
`model.language_model.layers.N` as `language_model.model.layers.N`); those are named as loading
would name them (`saved_names`), and a tensor that still has no row is refused by name.
"""

from __future__ import annotations

import difflib
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from tailor_tui.checked.files import NOT_REGULAR, confine, identity, link_refusal
from tailor_tui.checkpoints.rows import Row, list_rows, row_index
from tailor_tui.checkpoints.saved_names import loaded_names
from tailor_tui.errors import CheckpointError, IncompatibleError
from tailor_tui.formats.ds_format import RECOVERY_SCRIPTS
from tailor_tui.formats.pickled import TensorRef
from tailor_tui.formats.ptfile import file_format, read_structure
from tailor_tui.kinds.folders import MODEL_CONFIG, TRAINER_STATE

COMPOSED, COPIED = "composed per row", "copied from the base"


@dataclass(frozen=True)
class FileFate:
    """One file of the base folder and what the composition does with it."""

    path: Path  # relative to the base folder
    fate: str  # COMPOSED or COPIED
    why: str  # a few words: "16-bit model weights", "run-level", …


def is_bin_weights(rel: Path) -> bool:
    """A torch-format weight file (`pytorch_model*.bin`, `adapter_model.bin`)."""
    name = rel.name
    return (name.startswith("pytorch_model") and name.endswith(".bin")) or name == "adapter_model.bin"


def is_safetensors(rel: Path) -> bool:
    return rel.suffix == ".safetensors"


def is_weight_file(rel: Path) -> bool:
    """A file whose tensors belong to rows (composed per row, or refused)."""
    return is_safetensors(rel) or is_bin_weights(rel)


def weight_kinds(names) -> set[str]:
    """The kinds of weight file a checkpoint holds: its model in safetensors or torch's format,
    whatever its sharding (sources are read by tensor name across their shards), or each other
    file by its own name (`adapter_model.safetensors`)."""
    kinds = set()
    for name in names:
        file = Path(name).name
        if file.startswith("pytorch_model") and file.endswith(".bin"):
            kinds.add("pytorch_model.bin")
        elif file.startswith("model") and file.endswith(".safetensors") and Path(name).parent == Path("."):
            kinds.add("model.safetensors")
        else:
            kinds.add(name)
    return kinds


def folder_files(folder: Path, tag_dir: Path) -> list[Path]:
    """Every file of a checkpoint folder outside its tag folder, which is never entered (its rank
    files are the rank writers'; a 512-rank tag holds a thousand of them). One that is no regular
    file (a FIFO, a link to a device) is refused: it could be neither read nor copied. A symbolic
    link is read as the file or folder it leads to where that lies inside the run (the folder
    holding `folder`), and refused where it leaves the run or leads nowhere (`checked.files.confine`);
    a link to a folder this one already holds (its tag folder, a loop) is refused too."""
    run, found = folder.parent, []
    seen = {identity(st) for p in (folder, tag_dir) if (st := _stat(p)) is not None}
    pending = [folder]
    while pending:
        here = pending.pop()
        with os.scandir(here) as entries:
            names = sorted((e.name, e.is_symlink()) for e in entries)
        for name, linked in names:
            path = here / name
            if path == tag_dir:
                continue
            if linked:
                confine(path, run)  # out of the run, or nowhere: refused
            st = _stat(path)
            if st is None:  # removed meanwhile
                continue
            if stat.S_ISDIR(st.st_mode):
                if identity(st) in seen:
                    raise link_refusal(path, os.path.realpath(path), run,
                                       "a folder this checkpoint already holds (its tag folder, or a loop)")
                seen.add(identity(st))
                pending.append(path)
            elif stat.S_ISREG(st.st_mode):
                found.append(path)
            else:  # a FIFO, a device, a socket
                raise CheckpointError(f"{path}: {NOT_REGULAR}; a checkpoint folder holds files tailor-tui reads or "
                                      "copies: remove it, or put the file it stands for in its place")
    return sorted(found)


def _stat(path: Path) -> os.stat_result | None:
    try:
        return os.stat(path)
    except OSError:
        return None


def weight_file_names(folder: Path, tag_dir: Path) -> tuple[str, ...]:
    """The weight files of a checkpoint folder (outside its tag folder), relative to it."""
    return tuple(str(p.relative_to(folder)) for p in folder_files(folder, tag_dir) if is_weight_file(p))


def describe_run_level(rel: Path) -> str:
    name = rel.name
    known = {
        TRAINER_STATE: "run-level: the Trainer's state",
        "training_args.bin": "run-level: the training arguments",
        "scheduler.pt": "run-level: the LR scheduler",
        "optimizer.pt": "run-level",
        MODEL_CONFIG: "run-level: the model's config",
        "generation_config.json": "run-level: the model's config",
        "adapter_config.json": "run-level: the adapter's config",
        "README.md": "run-level: the model card",
        "pytorch_model.bin.index.json": "the shards' index (the output keeps the base's sharding)",
        "model.safetensors.index.json": "the shards' index (the output keeps the base's sharding)",
        "latest": "run-level: DeepSpeed's latest tag",
        "scheduler.bin": "run-level: the LR scheduler (Accelerate)",
        "sampler.bin": "run-level: the data sampler (Accelerate)",
        "dl_state_dict.bin": "run-level: the data loader (Accelerate)",
        "scaler.pt": "run-level: the loss scaler (Accelerate)",
    }
    if name in known:
        return known[name]
    if name in RECOVERY_SCRIPTS:
        return "run-level: DeepSpeed's recovery script"
    if name.startswith(("rng_state", "random_states_")):
        return "run-level: RNG state"
    if name.startswith("custom_checkpoint_"):
        return "run-level: an object registered with Accelerate's register_for_checkpointing"
    if name.startswith(("tokenizer", "special_tokens_map", "vocab", "merges", "added_tokens")):
        return "run-level: tokenizer"
    return "run-level (not known to tailor-tui: kept as the base has it)"


def tensor_rows(names: list[str], rows: tuple[Row, ...], folder: Path) -> dict[str, str | None]:
    """Each tensor name of a weight file of checkpoint folder `folder` -> its row (None: no row
    holds it). Names no row holds are renamed as transformers renames them when it loads the
    architecture `folder/config.json` names."""
    index = row_index(tuple(rows))
    found = {name: index.row_of(name) for name in names}
    missing = [n for n, row in found.items() if row is None]
    if missing and (loaded_as := loaded_names(folder, missing)) is not None:
        for name in missing:
            found[name] = index.row_of(loaded_as[name])
    return found


def tensor_params(names: list[str], rows: tuple[Row, ...], folder: Path) -> dict[str, str]:
    """Each tensor name of a weight file of checkpoint folder `folder` that is not itself the name of
    a parameter or buffer -> the parameter or buffer it holds, as transformers renames it when it
    loads the architecture `folder/config.json` names (transformers 5 saves a Llava's
    `model.language_model.layers.0.…` as `language_model.model.layers.0.…`). What a partial save,
    which has no model file, reads a tensor's values by (its fp32 master slices, model_states)."""
    known = {n for row in rows for n in (*row.params, *row.buffers)}
    other = [n for n in names if n not in known]
    loaded_as = loaded_names(folder, other) if other else None
    if loaded_as is None:
        return {}
    return {n: param for n in other if (param := loaded_as[n]) != n and param in known}


def unplaced_error(file: Path, names: list[str], rows: tuple[Row, ...]) -> IncompatibleError:
    """A weight file's tensors of no row: named, with the row the first is closest to; never advice to
    delete the file (it is the model's own: its names are what needs reading)."""
    params = {p: r.name for r in rows for p in (*r.params, *r.buffers)}
    close = difflib.get_close_matches(names[0], list(params), n=1, cutoff=0.0)
    closest = f"; the closest is {params[close[0]]}'s {close[0]}" if close else ""
    return IncompatibleError(
        f"{file}: tensor(s) {', '.join(names[:3])}{' …' if len(names) > 3 else ''} belong to no row of the model "
        f"(rows {list_rows([r.name for r in rows])}{closest}); tailor-tui cannot tell which checkpoint they "
        "should come from: pick every row from the base to keep the file as the base has it, or give the "
        "checkpoint the config.json its model was saved with (transformers' names are read through it)")


def family(folder: Path, rel: Path) -> tuple[Path, ...]:
    """The files of `folder` that hold the tensors `rel` holds in the base: every shard of the
    model (`pytorch_model*.bin`), or the file of the same name (an adapter)."""
    if rel.name.startswith("pytorch_model"):
        return tuple(sorted(p for p in (folder / rel.parent).glob("pytorch_model*.bin") if p.is_file()))
    return (folder / rel,) if (folder / rel).is_file() else ()


def tensor_names(path: Path) -> list[str]:
    """The tensor names of a torch-format weight file (its pickle only; CRC checked)."""
    obj, _records, _prefix = read_structure(path)
    if not isinstance(obj, dict) or not all(isinstance(k, str) and isinstance(v, TensorRef) for k, v in obj.items()):
        raise CheckpointError(f"{path}: not a weight file (a dict of tensors by name); re-copy it from the run")
    return list(obj)


def composable(path: Path) -> bool:
    return file_format(path) == "zip"
