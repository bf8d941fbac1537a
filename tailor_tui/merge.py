"""The merger: composes one checkpoint from a MergePlan.

Each rank's files are composed by `merge_rank` (in a worker process when there are
several workers): the base's optim_states with the fp32 master weights, exp_avg and
exp_avg_sq of every row picked from another checkpoint replaced slice by slice, and
padding slots zeroed. Everything else in the rank files (optimizer `step` of every
sub-group, loss scaler, counters, scheduler) is the base's.

The output is built in a temporary folder beside the destination, checked, and
renamed into place only when complete: an interrupted merge leaves nothing at the
output path. Sources are only ever opened for reading.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import shutil
import signal
import struct
import threading
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, NamedTuple

from . import __version__, crc
from .checkpoint import MODEL_FILE_INDEX, Checkpoint
from .ds_format import (
    FP32_FLAT_GROUPS,
    FROZEN_PARAM_FRAGMENTS,
    MODULE,
    OPTIMIZER_STATE_DICT,
    STATE,
    TENSORS,
    flat_tensor,
    optimizer_state,
    set_flat_tensor,
)
from .errors import CheckpointError, IncompatibleError, MergeCancelled, OutputError
from .events import ByteCounter, Emit, TaskFinished
from .fileio import (
    CountingWriter,
    Writeback,
    copy_file,
    copy_range,
    crc_range,
    fsync,
    fsync_dir,
    open_fd,
    output_error,
    pwrite_all,
    set_durable,
)
from .model_files import merge_model_file, partial_slice, safetensors_tensors
from .output import (
    OUTPUT_FILES,
    PROVENANCE,
    output_lock,
    probe_swap,
    publish,
    remove_stale,
    signals_held,
    temp_prefix,
    written_files,
)
from .plan import MergePlan, RankJob, tied_partner
from .pickled import dtype_name
from .ptfile import (
    Record,
    TensorBytes,
    Unsupported,
    check_crcs,
    checked_crcs,
    file_format,
    locate,
    read_structure,
)
from .safe_load import load_pt


# --- one rank ---------------------------------------------------------------------------


def _save(obj, path: Path, on_bytes: Callable[[int], None] | None) -> None:
    """torch.save to `path`, durably; `on_bytes` counts the bytes (None: a plain seekable
    file, which torch.serialization.skip_data needs)."""
    import torch

    writer = None
    try:
        with open(path, "wb") as f:
            writer = CountingWriter(f, on_bytes) if on_bytes is not None else None
            torch.save(obj, writer or f)
            f.flush()
            fsync(f.fileno())
    except OSError as exc:
        raise output_error(writer.error if writer and writer.error else exc, path) from None
    except RuntimeError:
        if writer is not None and writer.error is not None:
            raise output_error(writer.error, path) from None
        raise


def merge_rank(job: RankJob, out_tag_dir: Path, emit: Emit, cancelled: Callable[[], bool]) -> None:
    """Compose rank `job.rank`'s model_states and optim_states files into `out_tag_dir`."""
    counter = ByteCounter(f"rank {job.rank}", job.total_bytes, emit, cancelled)
    base_files = job.files[0]
    out_optim = out_tag_dir / base_files.optim_states.name
    if base_files.rows is not None:  # a partial base has no optim file to copy: build it
        build_optim_states_from_skeleton(job, out_optim, counter)
    elif not stream_optim_states(job, out_optim, counter):
        _reserialise_optim_states(job, out_optim, counter)

    out_model = out_tag_dir / base_files.model_states.name
    if job.frozen or job.buffers or file_format(base_files.model_states) != "zip":
        _merge_model_states(job, out_model, counter)  # (a legacy-format base's is re-saved as zip)
    else:
        check_crcs(base_files.model_states)
        try:
            copy_file(base_files.model_states, out_model, counter.add)
        except OSError as exc:
            raise output_error(exc, out_model) from None
    counter.finish()


class Span(NamedTuple):
    """A byte range of the output optim file that does not keep the base's bytes."""

    at: int  # where it lies in the base's (and the output's) file
    length: int
    source: int | None  # the checkpoint its bytes come from; None: zeros (padding)
    source_at: int  # where they lie in that checkpoint's file
    record: Record  # the base's record it lies in
    source_record: Record | None  # the full source's record they come from (None: partial, zeros)


def stream_optim_states(job: RankJob, out: Path, counter: ByteCounter) -> bool:
    """Write the composed optim_states file as the base's bytes with replaced ranges.

    The output has the base's exact zip layout. First every record of the base, and every
    record of a source that a slice comes from, is read once and checked against the CRC-32
    its archive stores (a flipped byte is refused, never carried into the output under a
    fresh CRC); that pass also gives the CRCs of the replaced ranges, old and new. Then every
    byte is copied in the kernel (copy_file_range): the base's where nothing replaces it, a
    source's slice where the recipe picks it; padding is written as zeros; each record's
    CRC-32 is updated from its replaced ranges alone (see `crc`). Memory stays at one small
    buffer whatever the file size. Returns False (writing nothing) when the archive is laid
    out in a way this does not handle, or the base's file is in torch's legacy format; the
    caller then re-serialises. Sources may be in either format (legacy ones have no CRC).
    """
    base_path = job.files[0].optim_states
    if file_format(base_path) != "zip":
        return False  # the output is a zip archive: a legacy-format base's file is re-serialised
    used = sorted({c.source for c in job.copies})
    try:
        obj, base_records, prefix = read_structure(base_path)
        base = _flat_tensor_bytes(obj, base_records, prefix, base_path, job.group_sizes)
        sources = {s: _tensor_bytes(job.files[s].optim_states, job.group_sizes)
                   for s in used if job.files[s].rows is None}
    except Unsupported:
        return False
    for s, theirs in sources.items():
        _check_dtypes(base, theirs, job.files[s].optim_states)
    partial = {s: safetensors_tensors(job.files[s].rows) for s in used if job.files[s].rows is not None}
    spans = []
    for c in job.copies:
        for key in TENSORS:
            b = base[c.group, key]
            if c.param is None:
                theirs = sources[c.source][c.group, key]
                at, record = theirs.offset + c.offset * b.itemsize, theirs.record
            else:
                at, record = partial_slice(job.files[c.source].rows, partial[c.source], key, c.param, c.length)[2], None
            spans.append(Span(b.offset + c.offset * b.itemsize, c.length * b.itemsize, c.source, at, b.record, record))
    for g, offset, length in job.padding:
        for key in TENSORS:
            b = base[g, key]
            spans.append(Span(b.offset + offset * b.itemsize, length * b.itemsize, None, 0, b.record, None))
    spans = _coalesced(spans)

    try:
        with contextlib.ExitStack() as stack:
            fin = open_fd(stack, base_path)
            fds = {s: open_fd(stack, job.files[s].rows or job.files[s].optim_states) for s in used}
            buffer = memoryview(bytearray(STREAM_CHUNK))
            old = _read_and_check(fin, base_path, base_records.values(),
                                  {(sp.record, sp.at, sp.length) for sp in spans}, buffer, counter)
            new = {}
            for s in sources:
                taken = {(sp.source_record, sp.source_at, sp.length) for sp in spans if sp.source == s}
                checked = _read_and_check(fds[s], job.files[s].optim_states, {r for r, _, _ in taken}, taken,
                                          buffer, counter)
                new.update({(s, at): value for (at, _n), value in checked.items()})
            fout = open_fd(stack, out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            writeback = Writeback(fout)
            position, crc_changes = 0, defaultdict(int)
            for sp in spans:
                copy_range(fin, fout, position, sp.at - position, counter.add, writeback=writeback)
                if sp.source is None:  # padding holds garbage: write zeros
                    pwrite_all(fout, bytes(sp.length), sp.at)
                    value = crc.zeros(sp.length)
                else:
                    copy_range(fds[sp.source], fout, sp.source_at, sp.length, counter.add, sp.at, writeback)
                    value = new.get((sp.source, sp.source_at))
                    if value is None:  # from a partial checkpoint: its safetensors file has no CRCs
                        value = crc_range(fds[sp.source], sp.source_at, sp.length, buffer, counter.add)
                tail = sp.record.data_offset + sp.record.size - sp.at - sp.length
                crc_changes[sp.record] ^= crc.shift(old[sp.at, sp.length] ^ value, tail)
                position = sp.at + sp.length
            copy_range(fin, fout, position, os.fstat(fin).st_size - position, counter.add, writeback=writeback)
            for record, change in crc_changes.items():
                for at in record.crc_offsets:
                    os.pwrite(fout, struct.pack("<I", record.crc ^ change), at)
            fsync(fout)
    except OSError as exc:
        raise output_error(exc, out) from None
    return True


def _read_and_check(fd: int, path: Path, records, ranges: set, buffer: memoryview,
                    counter: ByteCounter) -> dict[tuple[int, int], int]:
    """Read every byte of `records` of the file `fd` once, checking each record's stored
    CRC-32 (`ptfile.checked_crcs`), and return the CRC of each (record, offset, length) in
    `ranges` as {(offset, length): crc}."""
    found = {}
    for record in sorted(records, key=lambda r: r.data_offset):
        mine = sorted((at, n) for r, at, n in ranges if r == record)
        found.update(zip(mine, checked_crcs(fd, path, record, mine, buffer, counter.add)))
    return found


def build_optim_states_from_skeleton(job: RankJob, out: Path, counter: ByteCounter) -> None:
    """Write a partial base's optim file: its skeleton (everything but the flat tensors) as
    the archive, every slice copied into place in the kernel.

    torch writes the archive with every tensor's space reserved and not written
    (`torch.serialization.skip_data`), so the file has torch's own layout; then every row's
    slices are copied in from the checkpoints the plan names, padding is zeroed, the small
    tensors (per-group steps) are written, and each record's CRC-32 is set from the bytes
    written. The flat tensors are `torch.empty`: never touched, they occupy no memory.
    Memory: the skeleton and one small buffer, whatever the file size.
    """
    import torch

    skeleton = load_pt(job.files[0].skeleton)
    inner = _skeleton_state(skeleton, job.files[0].skeleton, job.group_sizes)
    reserved = set()  # storages whose bytes come from the sources
    for g, size in enumerate(job.group_sizes):
        for key in TENSORS:
            flat = torch.empty(size, dtype=torch.float32).requires_grad_(flat_tensor(inner, g, key).requires_grad)
            reserved.add(flat.untyped_storage()._cdata)
            set_flat_tensor(inner, g, key, flat)
    with torch.serialization.skip_data():
        storages = _storages_in_save_order(skeleton)
        _save(skeleton, out, None)  # small: the tensors' space is only reserved
    try:
        obj, records, prefix = read_structure(out)
        layout = _flat_tensor_bytes(obj, records, prefix, out, job.group_sizes)
    except Unsupported as exc:
        raise OutputError(f"{out}: torch wrote an archive this tailor-tui cannot fill ({exc}); "
                          "please report it with your torch version") from None
    small = [(storage, records[f"{prefix}data/{key}"]) for key, storage in enumerate(storages)
             if storage._cdata not in reserved]
    data_records = [records[f"{prefix}data/{key}"] for key in range(len(storages))]

    partial = {s: safetensors_tensors(job.files[s].rows) for s in {c.source for c in job.copies}
               if job.files[s].rows is not None}
    try:
        with contextlib.ExitStack() as stack:
            fout = open_fd(stack, out, os.O_RDWR)
            fds = {s: open_fd(stack, job.files[s].rows or job.files[s].optim_states)
                   for s in {c.source for c in job.copies}}
            full = {s: _tensor_bytes(job.files[s].optim_states, job.group_sizes)
                    for s in fds if job.files[s].rows is None}
            buffer = memoryview(bytearray(STREAM_CHUNK))
            for s, theirs in full.items():  # the skeleton's flat tensors are fp32
                _check_dtypes({k: ("FloatStorage", 4) for k in theirs}, theirs, job.files[s].optim_states)
                taken = {(theirs[c.group, key].record, theirs[c.group, key].offset + c.offset * 4, c.length * 4)
                         for c in job.copies if c.source == s for key in TENSORS}
                _read_and_check(fds[s], job.files[s].optim_states, {r for r, _, _ in taken}, taken, buffer, counter)
            writeback = Writeback(fout)
            for c in job.copies:
                for key in TENSORS:
                    if c.param is None:
                        at = full[c.source][c.group, key].offset + c.offset * 4
                    else:
                        at = partial_slice(job.files[c.source].rows, partial[c.source], key, c.param, c.length)[2]
                    copy_range(fds[c.source], fout, at, c.length * 4, counter.add,
                               layout[c.group, key].offset + c.offset * 4, writeback)
            for g, offset, length in job.padding:
                for key in TENSORS:
                    pwrite_all(fout, bytes(length * 4), layout[g, key].offset + offset * 4)
            for storage, record in small:  # per-group steps and the like
                pwrite_all(fout, _storage_bytes(storage), record.data_offset)
            del skeleton, inner, storages, small
            for record in data_records:
                value = crc_range(fout, record.data_offset, record.size, buffer)
                for at in record.crc_offsets:
                    os.pwrite(fout, struct.pack("<I", value), at)
            fsync(fout)
    except OSError as exc:
        raise output_error(exc, out) from None


def _storages_in_save_order(obj) -> list:
    """The storages torch.save writes for `obj`, in the order of their record keys (0, 1, …):
    torch numbers storages as its pickler first meets them, and this pickler meets them alike."""
    import io
    import pickle

    import torch

    order, seen = [], set()

    class Walker(pickle.Pickler):
        def persistent_id(self, o):
            if isinstance(o, torch.storage.TypedStorage) or torch.is_storage(o):
                storage = o._untyped_storage if isinstance(o, torch.storage.TypedStorage) else o
                if storage._cdata not in seen:
                    seen.add(storage._cdata)
                    order.append(storage)
                return ("storage", len(order))
            return None

    Walker(io.BytesIO(), protocol=2).dump(obj)
    return order


def _storage_bytes(storage) -> bytes:
    import torch

    return torch.empty(0, dtype=torch.uint8).set_(storage).numpy().tobytes()


def _coalesced(spans: list[Span]) -> list[Span]:
    """Spans in file order, neighbours from the same source and records joined into one
    (the params of a layer lie side by side in both files: one copy, one CRC step)."""
    joined: list[Span] = []
    for span in sorted(spans, key=lambda s: s.at):
        last = joined[-1] if joined else None
        if (last and span.at == last.at + last.length and span.source == last.source
                and span.record == last.record and span.source_record == last.source_record
                and (span.source is None or span.source_at == last.source_at + last.length)):
            joined[-1] = last._replace(length=last.length + span.length)
            continue
        joined.append(span)
    return joined


def _check_dtypes(base: dict, theirs: dict, path: Path) -> None:
    """Refuse a source whose flat tensors are stored in another dtype than the base's (bf16
    optimizer states, say): their bytes would be reinterpreted. `base` maps (group, key) to
    TensorBytes or to (dtype, itemsize)."""
    for (g, key), tb in theirs.items():
        mine = base[g, key]
        expected = (mine.dtype, mine.itemsize) if isinstance(mine, TensorBytes) else mine
        if (tb.dtype, tb.itemsize) != expected:
            raise _dtype_mismatch(path, key, g, tb.dtype, expected[0])


def _dtype_mismatch(path: Path, key: str, group: int, theirs: str, mine: str) -> IncompatibleError:
    """`theirs`, `mine`: a torch dtype (`torch.bfloat16`) or storage type (`BFloat16Storage`)."""
    return IncompatibleError(
        f"{path}: its {key} of sub-group {group} is stored as {dtype_name(theirs)}, the base's as "
        f"{dtype_name(mine)}; checkpoints saved with another optimizer-state precision cannot be combined")


def _tensor_bytes(path: Path, group_sizes: tuple[int, ...]) -> dict:
    """{(group, key): TensorBytes} of the flat fp32 weights and moments of an optim file."""
    return _flat_tensor_bytes(*read_structure(path), path, group_sizes)


def _flat_tensor_bytes(obj, records: dict, prefix: str, path: Path, group_sizes: tuple[int, ...]) -> dict:
    inner = optimizer_state(obj, path, group_sizes)
    return {(g, key): locate(flat_tensor(inner, g, key), records, prefix)
            for g in range(len(group_sizes)) for key in TENSORS}


# One small buffer, reused: on this kind of VM fresh 64 MiB buffers ran at 0.6 GiB/s (page
# faults on every chunk); a reused 1 MiB buffer stays in CPU cache between read and CRC.
STREAM_CHUNK = 1 << 20


def _reserialise_optim_states(job: RankJob, out: Path, counter: ByteCounter) -> None:
    """Load (memory-mapped), build whole flat tensors, torch.save: the fallback for base
    archives the streaming path does not handle. Memory: the composed rank file."""
    import torch

    base_files = job.files[0]
    base = load_pt(base_files.optim_states)
    inner = optimizer_state(base, base_files.optim_states, job.group_sizes)
    full = {
        s: optimizer_state(load_pt(f.optim_states), f.optim_states, job.group_sizes)
        for s, f in job.files.items()
        if s and f.rows is None and any(c.source == s for c in job.copies)
    }
    partial = {s: f.rows for s, f in job.files.items() if f.rows is not None}
    indexes = {s: safetensors_tensors(p) for s, p in partial.items()}
    copies, padding = defaultdict(list), defaultdict(list)
    for c in job.copies:
        copies[c.group].append(c)
    for g, offset, length in job.padding:
        padding[g].append((offset, length))

    from safetensors import safe_open

    with contextlib.ExitStack() as stack, torch.no_grad():
        opened = {s: stack.enter_context(safe_open(str(p), framework="pt")) for s, p in partial.items()}
        for g, size in enumerate(job.group_sizes):
            for key in TENSORS:
                original = flat_tensor(inner, g, key)
                merged = original.detach().clone()
                counter.add(size * 4)
                for c in copies[g]:
                    span = slice(c.offset, c.offset + c.length)
                    if c.param is None:
                        theirs = flat_tensor(full[c.source], g, key)
                        if theirs.dtype != original.dtype:  # copy_ would cast silently
                            raise _dtype_mismatch(job.files[c.source].optim_states, key, g,
                                                  str(theirs.dtype), str(original.dtype))
                        merged[span].copy_(theirs[span])
                    else:
                        partial_slice(partial[c.source], indexes[c.source], key, c.param, c.length)
                        merged[span].copy_(opened[c.source].get_slice(f"{key}/{c.param}")[: c.length])
                    counter.add(c.length * 4)
                for offset, length in padding[g]:
                    merged[offset : offset + length].zero_()  # padding holds garbage: write zeros
                merged.requires_grad_(original.requires_grad)
                set_flat_tensor(inner, g, key, merged)
    del full
    _save(base, out, counter.add)


def _skeleton_state(obj, path: Path, group_sizes: tuple[int, ...]) -> dict:
    """The inner optimizer dict of a partial checkpoint's skeleton (big tensors left empty)."""
    try:
        inner = obj[OPTIMIZER_STATE_DICT]
        flat, state = inner[FP32_FLAT_GROUPS], inner[OPTIMIZER_STATE_DICT][STATE]
        if len(flat) != len(group_sizes) or any(g not in state for g in range(len(group_sizes))):
            raise ValueError
    except (KeyError, TypeError, ValueError):
        raise CheckpointError(
            f"{path}: not a partial-checkpoint optimizer skeleton for {len(group_sizes)} sub-groups; "
            "the partial checkpoint is corrupt or from another run"
        ) from None
    return inner


def _merge_model_states(job: RankJob, out: Path, counter: ByteCounter) -> None:
    """The base's model_states with frozen fragments and buffers of picked rows replaced."""
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
    _save(states, out, counter.add)


# --- the task list -------------------------------------------------------------------------


def planned_tasks(plan: MergePlan) -> list[tuple[str, int]]:
    """(task name, total bytes) of every task a merge will report, in order."""
    ranks = [(f"rank {job.rank}", job.total_bytes) for job in plan.rank_jobs()]
    return ranks + [(job.task, job.total_bytes) for job in plan.model_file_jobs()]


# --- running the tasks ------------------------------------------------------------------------

_WORKER_QUEUE = None
_WORKER_CANCEL = None


def _worker_init(events, cancel, parent: int, durable: bool) -> None:
    global _WORKER_QUEUE, _WORKER_CANCEL
    set_durable(durable)
    # Ctrl-C reaches the whole process group: the parent alone decides how to stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # A worker holds its own copy of the task queue's pipe, so it would wait forever if the
    # parent were killed (kill -9, OOM killer): it leaves as soon as it is orphaned.
    # `parent` comes from the parent itself: read here, it could already be init's PID.
    threading.Thread(target=_exit_when_orphaned, args=(parent,), daemon=True).start()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    _WORKER_QUEUE, _WORKER_CANCEL = events, cancel


def _exit_when_orphaned(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(1)


def _run_task(task, out_dir: Path) -> None:
    run = merge_rank if isinstance(task, RankJob) else merge_model_file
    run(task, out_dir, _WORKER_QUEUE.put, _WORKER_CANCEL.is_set)


def default_workers(plan: MergePlan) -> int:
    """As many workers as cores and available memory allow (each holds one rank in memory)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    per_worker = max(plan.base.rank_bytes(r) for r in range(plan.base.world_size)) * 2 + (256 << 20)
    return max(1, min(len(plan.base.ranks), cores, _available_memory() // per_worker))


def _available_memory() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 << 30


def _run_inline(tasks, out_dirs, emit: Emit, cancel: threading.Event) -> None:
    for task, out in zip(tasks, out_dirs):
        run = merge_rank if isinstance(task, RankJob) else merge_model_file
        run(task, out, emit, cancel.is_set)


def prepare_worker_processes() -> None:
    """Start multiprocessing's resource tracker now, while sys.stderr is the real one.

    The tracker is started lazily with `sys.stderr.fileno()` among the fds it inherits;
    inside a full-screen app stderr is replaced and the first worker spawn would fail.
    """
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()


def _run_pool(tasks, out_dirs, workers: int, emit: Emit, cancel: threading.Event, durable: bool) -> None:
    import multiprocessing as mp
    from concurrent.futures import FIRST_EXCEPTION, ProcessPoolExecutor, wait

    ctx = mp.get_context("spawn")  # fork after torch has started threads can deadlock
    events, stop = ctx.Queue(), ctx.Event()
    pool = ProcessPoolExecutor(workers, mp_context=ctx, initializer=_worker_init,
                               initargs=(events, stop, os.getpid(), durable))
    finished: set[str] = set()

    def emit_and_count(event) -> None:
        if isinstance(event, TaskFinished):
            finished.add(event.task)
        emit(event)

    try:  # from the first spawn on: a Ctrl-C deferred while spawning arrives as the block ends
        with _children_ignore_sigint():
            futures = [pool.submit(_run_task, t, o) for t, o in zip(tasks, out_dirs)]
        pending = set(futures)
        while pending:
            if cancel.is_set():
                stop.set()
            _drain(events, emit_and_count, timeout=0.05)
            done, pending = wait(pending, timeout=0, return_when=FIRST_EXCEPTION)
            for f in done:
                if f.exception() is not None:
                    stop.set()
                    raise f.exception()
        # A worker's events go through its queue's feeder thread and may arrive after its
        # result: wait for every task's last event, so no rank's bar stops short of done.
        deadline = time.monotonic() + 10
        while len(finished) < len(tasks) and time.monotonic() < deadline:
            _drain(events, emit_and_count, timeout=0.05)
    finally:
        # Workers still starting up need the queue and event: they are shut down (and have
        # exited) before those are released.
        stop.set()
        pool.shutdown(wait=True, cancel_futures=True)


@contextlib.contextmanager
def _children_ignore_sigint():
    """Spawn workers that never see SIGINT, without the parent missing one.

    A terminal's Ctrl-C reaches the whole process group; a worker still starting up would
    die with a traceback of its own. SIGINT is blocked while `submit` spawns the processes:
    a blocked signal stays blocked across exec, so a worker cannot receive it before its
    initializer ignores it (which also drops one already pending). The parent only defers
    it: a Ctrl-C pressed while workers start is delivered when it is unblocked, and the
    merge is cancelled (ignoring SIGINT here instead lost that Ctrl-C: the merge ran on).
    """
    if threading.current_thread() is not threading.main_thread():
        yield  # signals are the main thread's business (the TUI gets Ctrl-C as a key anyway)
        return
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def _drain(events, emit: Emit, timeout: float) -> None:
    try:
        emit(events.get(timeout=timeout) if timeout else events.get_nowait())
        while True:
            emit(events.get_nowait())
    except queue.Empty:
        pass


# --- the whole merge --------------------------------------------------------------------------


@dataclass(frozen=True)
class MergeResult:
    output: Path
    seconds: float
    bytes_written: int
    peak_rss: int  # bytes: the largest peak resident memory of any process that merged a task


def run_merge(
    plan: MergePlan,
    workers: int | None = None,
    emit: Emit = lambda event: None,
    cancel: threading.Event | None = None,
    durable: bool = True,
) -> MergeResult:
    """Write the composed checkpoint described by `plan`; atomic, cancellable; fsynced
    before it is renamed into place unless `durable` is False (`--no-fsync`)."""
    set_durable(durable)
    try:
        return _compose(plan, workers, emit, cancel or threading.Event(), durable)
    finally:
        set_durable(True)


def _compose(plan: MergePlan, workers: int | None, emit: Emit, cancel: threading.Event,
             durable: bool) -> MergeResult:
    started = time.monotonic()
    out = plan.output
    peaks = [0]

    def emit_and_watch(event) -> None:
        if isinstance(event, TaskFinished):
            peaks[0] = max(peaks[0], event.peak_rss)
        emit(event)

    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise output_error(exc, out.parent) from None
    with output_lock(out):
        remove_stale(out)
        if plan.force and out.is_dir():
            probe_swap(out)
        tmp = out.parent / f"{temp_prefix(out)}{os.getpid()}"
        published = False
        try:
            try:
                tmp.mkdir()
            except OSError as exc:
                raise output_error(exc, out.parent) from None
            tag_dir = tmp / plan.base.tag
            tag_dir.mkdir()
            _copy_other_files(plan, tmp, cancel)
            if plan.base.kind == "deepspeed" or plan.base.partial:  # an HF base's is among its files
                _write_text(tmp / "latest", plan.base.tag)
            layout = plan.model_layout()
            if plan.base.partial and layout is not None and layout.index is not None:
                _write_text(tmp / MODEL_FILE_INDEX, layout.index)
            tasks = [*plan.rank_jobs(), *plan.model_file_jobs()]
            out_dirs = [tag_dir if isinstance(t, RankJob) else tmp for t in tasks]
            n = workers if workers is not None else default_workers(plan)
            n = max(1, min(n, len(tasks)))
            if n == 1:
                _run_inline(tasks, out_dirs, emit_and_watch, cancel)
            else:
                _run_pool(tasks, out_dirs, n, emit_and_watch, cancel, durable)
            if cancel.is_set():
                raise MergeCancelled()
            verify_output(plan, tmp)
            record = provenance(plan) | {OUTPUT_FILES: written_files(tmp)}
            _write_text(tmp / PROVENANCE, json.dumps(record, indent=2) + "\n")
            fsync_dir(tag_dir)
            fsync_dir(tmp)
            with signals_held():  # a cancel now waits until the output is whole at its path
                publish(tmp, out, plan.force)
                published = True
        except KeyboardInterrupt:
            if published:
                raise MergeCancelled(f"cancelled as the merge finished: {out} is complete and holds the new "
                                     "composition (check it with --verify)") from None
            cancel.set()
            shutil.rmtree(tmp, ignore_errors=True)
            raise MergeCancelled() from None
        except BaseException:
            if not published:
                shutil.rmtree(tmp, ignore_errors=True)
            raise
    written = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    return MergeResult(out, time.monotonic() - started, written, peaks[0])


def _write_text(path: Path, text: str) -> None:
    try:
        with open(path, "w") as f:
            f.write(text)
            f.flush()
            fsync(f.fileno())
    except OSError as exc:
        raise output_error(exc, path) from None


def _copy_other_files(plan: MergePlan, tmp: Path, cancel: threading.Event) -> None:
    root = plan.other_files_root()
    for rel in plan.other_files():
        if cancel.is_set():
            raise MergeCancelled()
        dst = tmp / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        check_crcs(root / rel)  # scheduler.pt, rng_state_*.pth, training_args.bin: torch zip archives
        try:
            copy_file(root / rel, dst)
        except OSError as exc:
            raise output_error(exc, dst) from None


def verify_output(plan: MergePlan, root: Path) -> None:
    """Check the composed folder before it is moved into place: every file there and whole."""
    import zipfile

    tag_dir = root / plan.base.tag
    latest = (root / "latest").read_text().strip() if (root / "latest").is_file() else None
    if latest != plan.base.tag:
        raise OutputError(f"{root}/latest names '{latest}', expected '{plan.base.tag}' (internal error)")
    for files in plan.base.ranks:
        for f in (files.model_states, files.optim_states):
            out = tag_dir / f.name
            if not out.is_file() or not zipfile.is_zipfile(out):
                raise OutputError(f"{out}: missing or incomplete after the merge (internal error)")
    for job in plan.model_file_jobs():
        if not (root / job.name).is_file():
            raise OutputError(f"{root / job.name}: missing after the merge (internal error)")


def _identity(ckpt: Checkpoint) -> dict:
    files = {}
    for f, size in sorted(ckpt.sizes.items()):
        st = f.stat()
        files[os.path.relpath(f, ckpt.path)] = {"bytes": size, "mtime": st.st_mtime}
    return {
        "path": str(ckpt.path.resolve()),
        "kind": ckpt.kind,
        "tag": ckpt.tag,
        "step": ckpt.step,
        "world_size": ckpt.world_size,
        "dtype": ckpt.dtype,
        "deepspeed_version": ckpt.ds_version,
        "files": files,
    }


def provenance(plan: MergePlan) -> dict:
    rows = {}
    for row in plan.base.rows:
        if row.tied:
            rows[row.name] = f"tied to {tied_partner(plan.base, row)}"
        else:
            rows[row.name] = str(plan.sources[plan.picks[row.name]].path.resolve())
    return {
        "tool": f"tailor-tui {__version__}",
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "recipe": plan.recipe.to_yaml(),
        "recipe_file": str(plan.recipe.source_file.resolve()) if plan.recipe.source_file else None,
        "rows": rows,
        "base": _identity(plan.base),
        "sources": [_identity(s) for s in plan.sources[1:]],
    }

