"""Layer-wise selective checkpointing: save only some rows of a live ZeRO-3 engine.

Runs inside training, on every rank (like `engine.save_checkpoint`). Each rank writes
only its own slices of the chosen rows' fp32 master weights, exp_avg and exp_avg_sq —
no gather, no collective beyond the barriers a normal save has — plus the small
engine-level state a resume needs:

    ROOT/partial-step{N}/
        tailor_partial.json                          which rows, step, world size, layout
        global_step{N}/
            zero_pp_rank_{r}_mp_rank_00_model_states.pt   DeepSpeed's own (counters, scheduler,
                                                         buffers, frozen params, param shapes)
            tailor_rows_rank_{r}.safetensors         "{fp32|exp_avg|exp_avg_sq}/{param}": this
                                                     rank's slice of each saved parameter
                                                     (their CRC-32s in its metadata)
            tailor_optim_skeleton_rank_{r}.pt        the optimizer state without its big
                                                     tensors (per-sub-group step, param
                                                     groups, loss scaler)
        trainer_state.json, scheduler.pt, rng_state_{r}.pth, …   (HF layout)

The folder appears atomically (written under a hidden name, renamed when every rank is
done). tailor-tui composes partial checkpoints with full ones into a standard
checkpoint that stock DeepSpeed and the HF Trainer resume from. Partial folders are not
named `checkpoint-N` and `latest` is never touched, so nothing mistakes one for a
resumable checkpoint.

    from tailor_tui.selective.saver import save_rows
    save_rows(engine, "ckpt", rows=["embed_tokens", "layers.1", "layers.3", "norm", "lm_head"])
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from tailor_tui.checkpoints.layout import ZeroLayout
from tailor_tui.checkpoints.rows import Row, RowIndex, RowNaming, find_row, list_rows
from tailor_tui.checkpoints.rows import model_rows as rows_of_model
from tailor_tui.fileio import fsync_dir, fsync_file, replace_dir
from tailor_tui.formats.ds_format import (
    DS_CONFIG,
    DS_VERSION,
    FP32_FLAT_GROUPS,
    MASTERS,
    OPTIMIZER_STATE_DICT,
    STATE,
    flat_keys,
)
from tailor_tui.kinds.partial import (
    CRC_METADATA,
    KEYS_METADATA,
    PARTIAL_MANIFEST,
    PARTIAL_ROWS,
    PARTIAL_SKELETON,
    crc_metadata,
)


def partial_name(step: int) -> str:
    return f"partial-step{step}"


def row_naming(engine) -> RowNaming:
    """How the engine's model names its rows (`rows.RowNaming`), from its parameters and buffers."""
    return RowNaming([*(n for n, _ in engine.module.named_parameters()),
                      *(n for n, _ in engine.module.named_buffers())])


def engine_rows(engine) -> tuple[Row, ...]:
    """The engine's model's rows as a scan of its checkpoints finds them (`rows.model_rows`): its parameters and
    buffers, and the names under which a parameter is held again (a block several layers run: its own row)."""
    module = engine.module
    first: dict[int, str] = {}  # a parameter's first name
    aliases: dict[str, str] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        if id(param) in first:
            aliases[name] = first[id(param)]
        else:
            first[id(param)] = name
    return rows_of_model([n for n, _ in module.named_parameters()], [n for n, _ in module.named_buffers()],
                         aliases)


def model_rows(engine) -> list[str]:
    """The engine's rows in model order (what `rows=` may name)."""
    return _saveable(engine_rows(engine))


def _saveable(found: tuple[Row, ...]) -> list[str]:
    """The rows of `found` a partial save may hold: those with parameters of their own, in model order."""
    return [r.name for r in found if r.params]


def save_rows(engine, root: str | os.PathLike, rows: Iterable[str], *, step: int | None = None,
              layout: str = "deepspeed", write_extra: Callable[[Path], None] | None = None,
              lineage: str | None = None) -> Path:
    """Save rows `rows` of `engine` (a DeepSpeed ZeRO-3 engine) under `root`; call on every rank.

    `rows` are row names (`embed_tokens`, `layers.3`, `norm`, `lm_head`) or module paths
    (`model.layers.3`). `write_extra(folder)` runs on every rank before the folder is
    published (the HF callback writes trainer_state.json, RNG states etc. there); files it
    writes are fsynced with the rest. Returns the folder.
    """
    import deepspeed
    import torch
    import torch.distributed as dist

    if engine.zero_optimization_stage() != 3:
        raise ValueError(f"save_rows needs a ZeRO stage 3 engine, this one runs stage {engine.zero_optimization_stage()}")
    step = int(engine.global_steps if step is None else step)
    root = Path(root)
    final = root / partial_name(step)
    if lineage is not None and (final / PARTIAL_MANIFEST).is_file():  # every rank decides alike
        theirs = json.loads((final / PARTIAL_MANIFEST).read_text()).get("lineage")
        if theirs != lineage:
            raise ValueError(f"{final} was saved by another run; it is not replaced (move it away to save here)")
    rank, world = dist.get_rank(), dist.get_world_size()
    found = engine_rows(engine)
    wanted, index = _resolve_rows(found, rows), RowIndex(found)
    tag = f"global_step{step}"
    staging = root / f".{partial_name(step)}.saving"
    if rank == 0:
        shutil.rmtree(staging, ignore_errors=True)
        (staging / tag).mkdir(parents=True)
    dist.barrier()

    # As engine.save_checkpoint does: parameters kept gathered between steps (persistent ones)
    # are partitioned for the save, so model_states holds placeholders, and gathered again after.
    if engine._optimizer_has_ckpt_event_prologue():
        engine.optimizer.checkpoint_event_prologue()
    # DeepSpeed's own model_states file: counters, lr scheduler, buffers, frozen params, shapes
    engine._save_checkpoint(str(staging), tag)
    state = engine.optimizer.state_dict()
    shapes = engine._get_zero_param_shapes()
    zero = ZeroLayout(world, tuple(tuple((n, tuple(s)) for n, s in g.items()) for g in shapes), ())
    # the optimizer's state kept per element, saved per row beside the masters; a state that cannot be taken apart
    # by row (factored, 8-bit) is refused (IncompatibleError)
    keys = flat_keys(state, f"rank {rank}'s optimizer", tuple(zero.group_sizes()))
    slots = zero.slots
    inner = state[OPTIMIZER_STATE_DICT]
    tensors, valid = {}, {}
    for slot in slots:
        if index.row_of(slot.name) not in wanted:
            continue
        for key in keys:
            flat = state[FP32_FLAT_GROUPS][slot.group] if key == MASTERS else inner[STATE][slot.group][key]
            # the slice, padding included (it is zeroed when composed): a copy, no gather
            tensors[f"{key}/{slot.name}"] = flat.detach()[slot.offset: slot.offset + slot.part].float().cpu().clone()
            valid[f"{key}/{slot.name}"] = slot.valid(rank)
    from safetensors.torch import save_file

    rows_file = staging / tag / PARTIAL_ROWS.format(rank=rank)
    crcs = crc_metadata({name: memoryview(t[: valid[name]].numpy()).cast("B") for name, t in tensors.items()})
    save_file(tensors, str(rows_file), metadata={"format": "tailor-partial", "step": str(step), CRC_METADATA: crcs,
                                                 KEYS_METADATA: json.dumps(keys)})
    del tensors
    skeleton = staging / tag / PARTIAL_SKELETON.format(rank=rank)
    torch.save({OPTIMIZER_STATE_DICT: _skeleton(state, keys), DS_CONFIG: engine.config,
                DS_VERSION: deepspeed.__version__}, skeleton)
    if engine._optimizer_has_ckpt_event_epilogue():
        engine.optimizer.checkpoint_event_epilogue()
    if write_extra is not None:
        write_extra(staging)
    if rank == 0:
        engine._copy_recovery_script(str(staging))  # zero_to_fp32.py, as a full save has
    for f in (rows_file, skeleton, staging / tag / f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt"):
        fsync_file(f)
    dist.barrier()

    if rank == 0:
        manifest = {
            "format": "tailor-partial",
            "version": 1,
            "layout": layout,
            "step": step,
            "tag": tag,
            "world_size": world,
            "dtype": "bf16" if engine.bfloat16_enabled() else "fp16" if engine.fp16_enabled() else "fp32",
            "rows": [r for r in model_rows(engine) if r in wanted],
        }
        if lineage is not None:
            manifest["lineage"] = lineage
        (staging / PARTIAL_MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        for f in staging.rglob("*"):
            if f.is_file() and f.parent == staging:
                fsync_file(f)
        fsync_dir(staging / tag)
        fsync_dir(staging)
        if final.exists():  # an older save of the same step: replaced once the new one is complete
            replace_dir(staging, final)
        else:
            os.rename(staging, final)
            fsync_dir(root)
    dist.barrier()
    return final


def _resolve_rows(found: tuple[Row, ...], rows: Iterable[str]) -> set[str]:
    known = _saveable(found)
    wanted = set()
    for r in rows:
        # a row's name, its module path (`model.layers.3`), or an unambiguous end of it (`rows.find_row`)
        name = getattr(find_row(found, r), "name", None)
        if name not in known:
            raise ValueError(f"unknown row {r!r}; this model has rows {list_rows(known)}")
        wanted.add(name)
    return wanted


def _skeleton(state: dict, keys: tuple[str, ...]) -> dict:
    """The optimizer state with its big tensors (`keys`: the per-element state's) replaced by empty ones (same
    dtypes and requires_grad): what a composed checkpoint takes from a partial base."""
    import torch

    def empty(t):
        return torch.empty(0, dtype=t.dtype).requires_grad_(t.requires_grad)

    inner = dict(state[OPTIMIZER_STATE_DICT])
    inner[STATE] = {
        g: {k: (empty(v) if k in keys else v) for k, v in s.items()}
        for g, s in inner[STATE].items()
    }
    out = dict(state)
    out[OPTIMIZER_STATE_DICT] = inner
    out[FP32_FLAT_GROUPS] = [empty(t) for t in state[FP32_FLAT_GROUPS]]
    return out


# --- strategies: which rows each save holds ------------------------------------------------


def _full(save: int, full_every: int) -> bool:
    """Whether the `save`-th save (0-based) is a full one: the first, and every `full_every`-th."""
    return save == 0 or bool(full_every and save % full_every == 0)


@dataclass(frozen=True)
class Parity:
    """LLMTailor's parity strategy: the first save is full, then rows at odd positions
    (in model order) at one save and even positions at the next; `always` rows every time;
    a full save every `full_every` saves (0: only the first)."""

    always: tuple[str, ...] = ()
    full_every: int = 0

    def rows_for(self, save: int, rows: list[str]) -> list[str] | None:
        """Rows for the `save`-th save (0-based) of a model with `rows`; None: a full save.
        The halves alternate over the partial saves (full ones in between do not count)."""
        if _full(save, self.full_every):
            return None
        fulls_before = 1 + ((save - 1) // self.full_every if self.full_every else 0)
        half = rows[1::2] if (save - fulls_before) % 2 == 0 else rows[0::2]
        return [r for r in rows if r in half or r in self.always]


@dataclass(frozen=True)
class Filter:
    """LLMTailor's filter strategy: the `first` and `last` layers and the `always` rows
    (embeddings, final norm, lm_head by default) at every save, the middle layers only
    at the full save every `full_every` saves (the first save is full)."""

    first: int = 2
    last: int = 2
    always: tuple[str, ...] = ("embed_tokens", "norm", "lm_head", "wte", "wpe", "ln_f")
    full_every: int = 4

    def rows_for(self, save: int, rows: list[str]) -> list[str] | None:
        if _full(save, self.full_every):
            return None
        layers = [r for r in rows if r.rsplit(".", 1)[-1].isdigit()]
        edge = set(layers[: self.first]) | set(layers[len(layers) - self.last:] if self.last else [])
        return [r for r in rows if r in edge or r in self.always]


class SelectiveSaver:
    """Applies a strategy to a DeepSpeed engine's saves: full saves are the engine's own
    `save_checkpoint` (stock format), the others `save_rows`. Call `save` on every rank."""

    def __init__(self, strategy, save_dir: str | os.PathLike):
        self.strategy, self.save_dir, self.saves = strategy, Path(save_dir), 0

    def save(self, engine, step: int | None = None) -> Path:
        step = int(engine.global_steps if step is None else step)
        rows = self.strategy.rows_for(self.saves, model_rows(engine))
        self.saves += 1
        if rows is None:
            engine.save_checkpoint(str(self.save_dir), tag=f"global_step{step}")
            return self.save_dir / f"global_step{step}"
        return save_rows(engine, self.save_dir, rows, step=step)
