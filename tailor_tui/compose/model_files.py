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
from tailor_tui.formats.safetensors_in import parse_prefix
from tailor_tui.kinds.base import WeightPiece
from tailor_tui.kinds.partial import PARTIAL_MODEL_FILES, MasterWeights
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
                fills.taken[name] = crc_range(cast(int, fin), offset, length, fills.buffer, on_bytes=counter.add)
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
        copy_range(fin, fout, at, n, on_bytes=counter.add, writeback=writeback)
    else:
        counter.add(n)


class _Fills:
    """Writes one tensor's bytes at its place in the output, from its chosen source, where its kind says they
    lie (`kinds.base.WeightSource`): copied as they are stored, or read (checked against the CRC-32 a
    partial save recorded) and cast to the file's dtype."""

    def __init__(self, job: ModelFileJob, stack: contextlib.ExitStack, fout: int, writeback: Writeback,
                 on_bytes: Callable[[int], None]):
        self.job, self.stack, self.fout, self.writeback, self.on_bytes = job, stack, fout, writeback, on_bytes
        self.fd = OpenFiles(stack).fd
        self.taken: dict[str, int] = {}  # tensor -> the CRC-32 of the bytes written for it
        self.buffer = memoryview(bytearray(CAST_CHUNK * 4))

    def write(self, s: int, name: str, dtype: str, shape: tuple, offset: int, length: int) -> None:
        source, param = self.job.weights[s], self.job.params.get(name, name)  # (the file's name may be another)
        try:
            pieces = source.pieces(name, param, dtype, shape)
        except KeyError:
            base = (f"the base's {self.job.base_file}" if self.job.base_file else  # a partial base: its record
                    f"the base's record {Path(self.job.source_names[0]) / PARTIAL_MODEL_FILES}")
            raise CheckpointError(
                f"{self.job.source_names[s]}: its 16-bit model file has no tensor {name}, which {base} names; "
                "one of the two is incomplete or damaged, or they are from different models") from None
        if pieces is None:  # a frozen parameter or a buffer: small, kept in model_states
            data = source_tensor(self.job, s, param, dtype, shape)
            pwrite_all(self.fout, data, offset)
            self.taken[name] = crc.crc32(data)
            self.on_bytes(length)
            return
        written, itemsize = 0, SAFETENSORS_ITEMSIZE[dtype]
        for piece in pieces:  # side by side, in order: the tensor's CRC-32 is theirs combined
            at, n = offset + piece.into * itemsize, piece.count * itemsize
            if piece.stored == dtype and piece.check is None:  # as stored: copied in the kernel, its CRC-32 read
                fd = self.fd(piece.path)
                value = crc_range(fd, piece.at, n, self.buffer)  # what is taken (safetensors stores no CRC)
                copy_range(fd, self.fout, piece.at, n, on_bytes=self.on_bytes, out_offset=at, writeback=self.writeback)
            else:
                value = self._cast(piece, dtype, at)
            written = crc.combine(written, value, n)
        self.taken[name] = written

    def _cast(self, piece: WeightPiece, dtype: str, at: int) -> int:
        """`piece`'s elements read in chunks (checked against its CRC-32, where it has one), cast to `dtype` and
        written from byte `at` of the output; the CRC-32 of the bytes written."""
        stored, itemsize = SAFETENSORS_ITEMSIZE[piece.stored], SAFETENSORS_ITEMSIZE[dtype]
        value = written = 0  # the piece's CRC-32 as stored, checked against its recorded one; as written
        fd, step = self.fd(piece.path), len(self.buffer) // stored
        for start in range(0, piece.count, step):
            n = min(step, piece.count - start)
            view = self.buffer[: n * stored]
            pread_into(fd, view, piece.at + start * stored)
            value = crc.crc32(view, value)
            data = view if piece.stored == dtype else _cast(view, piece.stored, dtype)
            pwrite_all(self.fout, data, at + start * itemsize)
            written = crc.crc32(data, written)
            self.on_bytes(len(data))
        if piece.check is not None:
            piece.check.check(value)
        return written


def _cast(view: memoryview, stored: str, dtype: str) -> bytes:
    import torch

    if stored != "F32":
        raise CheckpointError(f"a weight stored as {stored} cannot be cast to {dtype} here (only fp32 masters are)")
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
    """The bytes of frozen parameter or buffer `name` (`job.params`: not always the file's name for it) as
    partial source `s` holds it in its ranks' model_states, in `dtype` (torch-loaded)."""
    import torch

    source = job.weights[s]
    assert isinstance(source, MasterWeights), "a tensor in no byte range is a partial save's"
    numel = 1
    for d in shape:
        numel *= d
    states = [load_pt(files.model_states) for files in source.ranks]
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
