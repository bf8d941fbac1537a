"""The writers of a rank's files that need torch: the re-serialising fallback (a legacy-format
base, an archive the streaming writer does not handle), and model_states whose frozen
fragments or buffers follow rows.

Importing this module imports torch; `rank_task` does so only for jobs that need it.
"""

from __future__ import annotations

import contextlib
from collections import Counter, defaultdict
from typing import Callable

import torch

from tailor_tui.checked import crc
from tailor_tui.compose.taken import FROZEN, Parts
from tailor_tui.errors import CheckpointError
from tailor_tui.events import ByteCounter
from tailor_tui.fileio import CountingWriter, Target, create, fsync, output_error
from tailor_tui.formats.ds_format import (
    FROZEN_PARAM_FRAGMENTS,
    MODULE,
    flat_keys,
    flat_tensor,
    optimizer_state,
    set_flat_tensor,
)
from tailor_tui.formats.safe_load import load_pt
from tailor_tui.kinds.base import check_keys, dtype_mismatch, rank_reader
from tailor_tui.planning.jobs import RankJob


def save_pt(obj, path: Target, on_bytes: Callable[[int], None] | None, durable: bool = True) -> None:
    """torch.save to `path`, durably; `on_bytes` counts the bytes (None: a plain seekable
    file, which torch.serialization.skip_data needs)."""
    writer = None
    try:
        with open(create(path), "wb") as f:  # a new file, never through a link (as every writer's)
            writer = CountingWriter(f, on_bytes) if on_bytes is not None else None
            torch.save(obj, writer or f)  # type: ignore[arg-type]  # any object with write(); the stub says IO
            f.flush()
            fsync(f.fileno(), durable)
    except OSError as exc:
        raise output_error(writer.error if writer and writer.error else exc, path) from None
    except RuntimeError:
        if writer is not None and writer.error is not None:
            raise output_error(writer.error, path) from None
        raise


def reserialise_optim_states(job: RankJob, out: Target, counter: ByteCounter) -> tuple[Counter, Parts]:
    """Load (memory-mapped), build whole flat tensors, torch.save: the fallback for base
    archives the streaming path does not handle. Memory: the composed rank file. Returns
    the non-finite values of each row, counted in memory, and the CRC-32 of each part of a row
    (`compose.taken`), of the bytes composed in memory."""
    nonfinite: Counter[str] = Counter()
    parts: Parts = {}
    base_files = job.files[0]
    base = load_pt(base_files.optim_states)
    inner = optimizer_state(base, base_files.optim_states, job.group_sizes)
    check_keys(base_files.optim_states, flat_keys(inner, base_files.optim_states, job.group_sizes), job.keys)
    full = {
        s: optimizer_state(load_pt(f.optim_states), f.optim_states, job.group_sizes)
        for s, f in job.files.items()
        if s and f.whole_records and any(c.source == s for c in job.copies)
    }
    for s, theirs in full.items():
        check_keys(job.files[s].optim_states, flat_keys(theirs, job.files[s].optim_states, job.group_sizes), job.keys)
    partial = {s: f.state_file for s, f in job.files.items() if not f.whole_records}  # its slices' safetensors
    readers = {s: rank_reader(job.files[s], job.group_sizes) for s in partial}  # (checks each slice's shape)
    for reader in readers.values():
        reader.check_keys(job.keys)
    copies, padding = defaultdict(list), defaultdict(list)
    for c in job.copies:
        copies[c.group].append(c)
    for g, offset, length in job.padding:
        padding[g].append((offset, length))

    from safetensors import safe_open

    with contextlib.ExitStack() as stack, torch.no_grad():
        opened = {s: stack.enter_context(safe_open(str(p), framework="pt")) for s, p in partial.items()}
        for g, size in enumerate(job.group_sizes):
            for key in job.keys:
                original = flat_tensor(inner, g, key)
                composed = original.detach().clone()
                counter.add(size * 4)
                for c in copies[g]:
                    span = slice(c.offset, c.offset + c.length)
                    if c.param is None:
                        theirs = flat_tensor(full[c.source], g, key)
                        if theirs.dtype != original.dtype:  # copy_ would cast silently
                            raise dtype_mismatch(job.files[c.source].optim_states, key, g,
                                                  str(theirs.dtype), str(original.dtype))
                        composed[span].copy_(theirs[span])
                    else:
                        readers[c.source].place(key, param=c.param, group=g, offset=c.offset, valid=c.length)
                        composed[span].copy_(opened[c.source].get_slice(f"{key}/{c.param}")[: c.length])
                    counter.add(c.length * 4)
                for offset, length in padding[g]:
                    composed[offset : offset + length].zero_()  # padding holds garbage: write zeros
                composed.requires_grad_(original.requires_grad)
                set_flat_tensor(inner, g, key, composed)
                for slot in job.row_slots:
                    if slot.group == g:
                        mine = composed[slot.offset: slot.offset + slot.valid]
                        nonfinite[slot.row] += _count(mine)
                        parts[slot.row, key, (g, slot.offset)] = _crc(mine)
    del full
    save_pt(base, out, counter.add, counter.options.durable)
    return +nonfinite, parts


def _count(t) -> int:
    return int((~torch.isfinite(t)).sum()) if t.is_floating_point() else 0


def _crc(t) -> tuple[int, int]:
    """(CRC-32, length) of a tensor's bytes."""
    data = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
    return crc.crc32(data), len(data)


def compose_model_states(job: RankJob, out: Target, counter: ByteCounter) -> tuple[Counter, Parts]:
    """The base's model_states with frozen fragments and buffers of picked rows replaced;
    the non-finite values of each row's frozen fragments in it, and their CRC-32s (`compose.taken`)."""
    states = load_pt(job.files[0].model_states)
    loaded: dict[int, dict] = {}

    def source(s: int) -> dict:
        if s not in loaded:
            loaded[s] = load_pt(job.files[s].model_states)
        return loaded[s]

    for name, s in job.frozen:
        theirs = source(s)[FROZEN_PARAM_FRAGMENTS][name]
        mine = states[FROZEN_PARAM_FRAGMENTS][name]
        if theirs.shape != mine.shape:
            raise CheckpointError(
                f"{job.files[s].model_states}: frozen fragment {name} has shape {list(theirs.shape)}, "
                f"the base {list(mine.shape)}; the checkpoints are from different layouts"
            )
        states[FROZEN_PARAM_FRAGMENTS][name] = theirs.clone()
    for name, s in job.buffers:
        states[MODULE][name] = source(s)[MODULE][name].clone()
    save_pt(states, out, counter.add, counter.options.durable)
    nonfinite: Counter[str] = Counter()
    parts: Parts = {}
    for i, (row, name, _source, valid) in enumerate(job.frozen_rows):
        fragment = states[FROZEN_PARAM_FRAGMENTS][name]
        nonfinite[row] += _count(fragment.reshape(-1)[:valid])
        parts[row, FROZEN, (i, 0)] = _crc(fragment)
    return +nonfinite, parts


