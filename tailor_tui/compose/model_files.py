"""The 16-bit model files of an HF output: `model.safetensors`, or shards with an index.

An output model file keeps the layout of the base's (same header, same byte offsets)
and holds each tensor of its row's chosen source:

- from a full HF source, that source's bytes, copied in the kernel;
- from a partial checkpoint (tailor_tui.selective saves no 16-bit weights: that would
  need a gather), the fp32 master slices of every rank (each checked against the CRC-32
  its save recorded), cast to the file's dtype. This
  is exactly the 16-bit weight: ZeRO-3 makes its 16-bit partition by casting the fp32
  partition after each step (round to nearest even). Frozen parameters and buffers have
  no fp32 master; they come from the source's model_states, as DeepSpeed stores them.

A partial base has no model file of its own; its save recorded the layout of the run's
newest full checkpoint's files (`tailor_model_files.json`: headers and index), so its
output gets the same files a full save would have written.

safetensors stores no checksum: the writer records what each file holds (`FileComposed`), the CRC-32
of every tensor as read from its source (the base's kept tensors too: read once, sequentially, even
where the output shares their blocks) and of its header, for `--verify` to prove the file by once
a source changed.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Callable, cast

from tailor_tui.checked import crc
from tailor_tui.checked.ranges import crc_range, pread_exact, pread_into
from tailor_tui.cloning import clone, worth_it
from tailor_tui.compose.taken import FileComposed
from tailor_tui.errors import CheckpointError
from tailor_tui.events import ByteCounter, Emit, TaskOptions
from tailor_tui.fileio import CREATE, Folder, OpenFiles, Writeback, copy_range, fsync, open_fd, output_error, pwrite_all
from tailor_tui.formats.ds_format import FROZEN_PARAM_FRAGMENTS, MODULE
from tailor_tui.formats.dtypes import SAFETENSORS_ITEMSIZE
from tailor_tui.formats.safe_load import load_pt
from tailor_tui.formats.safetensors_in import parse_prefix, safetensors_tensors
from tailor_tui.kinds.partial import PARTIAL_MODEL_FILES, PartialRankReader
from tailor_tui.planning.jobs import ModelFileJob

CAST_CHUNK = 1 << 20  # elements cast per step: memory stays small whatever the tensor size


def compose_model_file(job: ModelFileJob, out_dir: Folder, emit: Emit, cancelled: Callable[[], bool],
                     options: TaskOptions = TaskOptions()) -> FileComposed:
    """Write one model file: the base's bytes (if it has a file) with every tensor of a row
    picked elsewhere replaced by that source's tensor. Returns what it holds (`compose.taken`): the
    CRC-32 of each tensor's bytes as read from its source (the base's kept ones too: read once, even
    where the output shares their blocks) or cast in memory, and of its header (the plan's, which the
    base's file is checked to start with)."""
    counter = ByteCounter.for_job(job, emit, cancelled, options)
    edits = []  # (offset in the output, bytes, source index, tensor name, dtype, shape)
    kept = []  # (offset, bytes, tensor name): the base's, kept where they are
    for name, (dtype, shape, begin, end) in parse_prefix(job.prefix).items():
        s = job.sources.get(name, 0)
        if s or job.base_file is None:
            edits.append((begin, end - begin, s, name, dtype, shape))
        else:
            kept.append((begin, end - begin, name))

    out = out_dir / job.name
    try:
        out.parent.mkdir(parents=True, exist_ok=True)  # a weight file in a subfolder of the checkpoint
        with contextlib.ExitStack() as stack:
            fout = open_fd(stack, out, CREATE)
            writeback = Writeback(fout, options.durable)
            fin = open_fd(stack, job.base_file) if job.base_file is not None else None
            if fin is None:
                pwrite_all(fout, job.prefix, 0)
            else:  # the offsets of every tensor below are the plan's header's: the base's must be it
                _check_header(fin, job)
            # the base's blocks shared (`cloning`): only the tensors picked elsewhere are written
            replaced = sum(length for _o, length, *_rest in edits)
            how = clone(fin, fout) if fin is not None and options.clone and worth_it(replaced, job.size) else None
            fills = _Fills(job, stack, fout, writeback, lambda n: counter.add(2 * n))
            for offset, length, name in kept:  # checked by no stored CRC-32 (safetensors has none): recorded
                fills.taken[name] = crc_range(cast(int, fin), offset, length, fills.buffer, counter.add)
            position = 0
            for offset, length, s, name, dtype, shape in sorted(edits):
                _keep(fin, fout, position, offset - position, counter, writeback, how)
                fills.write(s, name, dtype, shape, offset, length)
                position = offset + length
            if fin is not None:
                _keep(fin, fout, position, os.fstat(fin).st_size - position, counter, writeback, how)
            os.ftruncate(fout, job.size)
            fsync(fout, options.durable)
            if how is not None:
                counter.shares(job.size - replaced, how)
            if job.base_file is not None:
                os.fchmod(fout, os.stat(job.base_file).st_mode & 0o777 | 0o200)
    except OSError as exc:
        raise output_error(exc, out) from None
    counter.finish()
    return FileComposed(job.name, dict(sorted(fills.taken.items())), header=crc.crc32(job.prefix))


def _check_header(fin: int, job: ModelFileJob) -> None:
    """The base's file starts with the header the plan read (names, dtypes, shapes, offsets): every
    tensor is placed by it."""
    if pread_exact(fin, len(job.prefix), 0) != job.prefix:
        raise CheckpointError(f"{job.base_file}: its header is not the one the composition was planned with; it "
                              "changed since: run again once nothing writes to the run")
def _keep(fin: int | None, fout: int, at: int, n: int, counter: ByteCounter, writeback: Writeback,
          how: str | None) -> None:
    """The base's `n` bytes at `at` kept in the output: copied, or already there in a clone (`how`)."""
    if fin is None or n <= 0:
        return
    if how is None:
        copy_range(fin, fout, at, n, counter.add, writeback=writeback)
    else:
        counter.add(n)


class _Fills:
    """Writes one tensor's bytes at its place in the output, from its chosen source."""

    def __init__(self, job: ModelFileJob, stack: contextlib.ExitStack, fout: int, writeback: Writeback,
                 on_bytes: Callable[[int], None]):
        self.job, self.stack, self.fout, self.writeback, self.on_bytes = job, stack, fout, writeback, on_bytes
        self.fd = OpenFiles(stack).fd
        self.where: dict[int, dict[str, tuple[Path, tuple]]] = {}
        self.rows_index: dict[Path, PartialRankReader] = {}  # a partial rank's rows file, read once
        self.taken: dict[str, int] = {}  # tensor -> the CRC-32 of the bytes written for it
        self.buffer = memoryview(bytearray(CAST_CHUNK * 4))

    def write(self, s: int, name: str, dtype: str, shape: tuple, offset: int, length: int) -> None:
        if s in self.job.partial_ranks:
            param = self.job.params.get(name, name)  # the file's name for it may be another (saved names)
            if param in self.job.slots[s]:
                self.taken[name] = self._cast_slices(s, param, dtype, offset)
            else:  # a frozen parameter or a buffer: small, kept in model_states
                data = source_tensor(self.job, s, param, dtype, shape)
                pwrite_all(self.fout, data, offset)
                self.taken[name] = crc.crc32(data)
            self.on_bytes(length)
            return
        path, (their_dtype, their_shape, begin, end) = self._find(s, name)
        if (their_dtype, their_shape) != (dtype, shape):
            raise CheckpointError(
                f"{path}: tensor {name} is {their_dtype} {list(their_shape)}, the base's "
                f"{dtype} {list(shape)}; the checkpoints are from different models"
            )
        fd = self.fd(path)
        self.taken[name] = crc_range(fd, begin, length, self.buffer)  # what is taken (safetensors stores no CRC)
        copy_range(fd, self.fout, begin, length, self.on_bytes, offset, self.writeback)

    def _find(self, s: int, name: str) -> tuple[Path, tuple]:
        if s not in self.where:
            self.where[s] = {n: (f, info) for f in self.job.source_files[s]
                             for n, info in safetensors_tensors(f).items()}
        if name not in self.where[s]:
            base = (f"the base's {self.job.base_file}" if self.job.base_file else  # a partial base: its record
                    f"the base's record {Path(self.job.source_names[0]) / PARTIAL_MODEL_FILES}")
            raise CheckpointError(
                f"{self.job.source_names[s]}: its 16-bit model file has no tensor {name}, which {base} names; "
                "one of the two is incomplete or damaged, or they are from different models"
            )
        return self.where[s][name]

    def _cast_slices(self, s: int, name: str, dtype: str, offset: int) -> int:
        """Each rank's fp32 slice of parameter `name`, cast to `dtype`, at its place in the flattened tensor;
        the CRC-32 of the tensor's bytes so written (the ranks' real elements lie side by side, in order)."""
        slot, itemsize = self.job.slots[s][name], SAFETENSORS_ITEMSIZE[dtype]
        buffer, written = self.buffer, 0
        for rank, files in enumerate(self.job.partial_ranks[s]):
            valid = slot.valid(rank)
            if not valid:
                continue
            rows = files.rows
            if rows not in self.rows_index:
                self.rows_index[rows] = PartialRankReader(files, ())
            place = self.rows_index[rows].place("fp32", param=name, group=None, offset=0, valid=valid)
            saved = place.slice
            assert saved is not None, "a partial save's place names its slice"
            begin = place.at
            at = offset + rank * slot.part * itemsize
            value = 0  # the slice's CRC-32, checked against the one its save recorded
            for start in range(0, valid, CAST_CHUNK):
                n = min(CAST_CHUNK, valid - start)
                view = buffer[: n * 4]
                pread_into(self.fd(rows), view, begin + start * 4)
                value = crc.crc32(view, value)
                # F32: the master weights are the model's weights
                data = view if dtype == "F32" else _cast(view, dtype)
                pwrite_all(self.fout, data, at + start * itemsize)
                written = crc.crc32(data, written)
            saved.check(value)
        return written


def _cast(view: memoryview, dtype: str) -> bytes:
    import torch

    return _to_bytes(torch.frombuffer(view, dtype=torch.float32), dtype)


def _to_bytes(t, dtype: str) -> bytes:
    """`t` converted to safetensors dtype `dtype`, as raw bytes (little-endian)."""
    import torch

    t = t.to({"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
              "I64": torch.int64, "I32": torch.int32, "U8": torch.uint8, "BOOL": torch.bool}[dtype])
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)  # numpy has no bfloat16; the bits are what is written
    return t.contiguous().numpy().tobytes()


def source_tensor(job: ModelFileJob, s: int, name: str, dtype: str, shape: tuple) -> bytes:
    """The bytes of parameter or buffer `name` (`job.params`: not always the file's name for it) as
    partial source `s` holds it, in `dtype` (torch-loaded: frozen parameters and buffers)."""
    import torch
    from safetensors import safe_open

    ranks = job.partial_ranks[s]
    numel = 1
    for d in shape:
        numel *= d
    if name in job.slots[s]:
        slot, parts = job.slots[s][name], []
        for rank, files in enumerate(ranks):
            if slot.valid(rank):
                with safe_open(str(files.rows), "pt") as f:
                    parts.append(f.get_slice(f"fp32/{name}")[: slot.valid(rank)])
        value = torch.cat(parts)
    else:
        states = [load_pt(files.model_states) for files in ranks]
        fragments = states[0].get(FROZEN_PARAM_FRAGMENTS) or {}
        if name in fragments:  # ZeRO-3 keeps each rank's part of a frozen parameter
            value = torch.cat([st[FROZEN_PARAM_FRAGMENTS][name].flatten() for st in states])[:numel]
        elif name in (states[0].get(MODULE) or {}):
            value = states[0][MODULE][name].flatten()
        else:
            raise CheckpointError(
                f"{job.source_names[s]}: holds no {name}; the checkpoint is from another model"
            )
    return _to_bytes(value, dtype)
