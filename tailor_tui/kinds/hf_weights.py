"""An HF checkpoint's own weight files as a source of an output's: its 16-bit model files (or shards) or its
PEFT adapter, each tensor found by name across the files, whole, stored as the output's file stores it. In
safetensors (`FileWeights`), which keeps no checksum: the writer records what it takes (`compose.taken`); in
torch's format (`BinWeights`: `pytorch_model.bin`, its shards, `adapter_model.bin`), by the storage record each
tensor lies on, whose stored CRC-32 the writer checks as it copies it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from tailor_tui.errors import CheckpointError
from tailor_tui.formats.dtypes import SAFETENSORS_ITEMSIZE
from tailor_tui.formats.pickled import TensorRef
from tailor_tui.formats.ptfile import Structure, read_structure
from tailor_tui.formats.ptpickle import storage_bytes
from tailor_tui.formats.ptwrite import Copied
from tailor_tui.formats.safetensors_in import safetensors_tensors
from tailor_tui.kinds.base import WeightPiece, WeightSource


@dataclass(frozen=True)
class FileWeights(WeightSource):
    """A full HF save's files holding the output file's tensors (`paths`: the model file's shards, or the adapter)."""

    name: str
    paths: tuple[Path, ...]
    # tensor -> (file, (dtype, shape, first byte, end byte)), read from the files' headers when first asked
    _where: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def files(self) -> tuple[Path, ...]:
        return self.paths

    def pieces(self, tensor: str, param: str, dtype: str, shape: tuple[int, ...]) -> tuple[WeightPiece, ...]:
        if not self._where:
            self._where.update((n, (f, info)) for f in self.paths for n, info in safetensors_tensors(f).items())
        path, (their_dtype, their_shape, begin, end) = self._where[tensor]
        if (their_dtype, tuple(their_shape)) != (dtype, tuple(shape)):
            raise CheckpointError(f"{path}: tensor {tensor} is {their_dtype} {list(their_shape)}, the base's {dtype} "
                                  f"{list(shape)}; the checkpoints are from different models")
        return (WeightPiece(path, begin, (end - begin) // SAFETENSORS_ITEMSIZE[dtype], dtype),)


@dataclass(frozen=True)
class BinWeights:
    """A full HF save's torch-format weight files of one family (`paths`: `pytorch_model.bin`, or its shards) as
    the source of an output's file of that family: each tensor's storage record, found by the tensor's name in the
    first file that has it. Picklable: a job carries it to its worker."""

    name: str  # the checkpoint's, for messages
    paths: tuple[Path, ...]
    _read: dict[Path, Structure] = field(default_factory=dict, compare=False, repr=False)

    @property
    def files(self) -> tuple[Path, ...]:
        return self.paths

    def storage(self, tensor: str, like: TensorRef) -> Copied:
        """The record of the storage `tensor` lies on, laid out as `like` (the base's tensor of that name: the
        same size, stride, offset, storage type and storage size), to be copied whole and checked against its
        stored CRC-32. CheckpointError: laid out otherwise, or in none of the files."""
        for path in self.paths:
            if path not in self._read:
                self._read[path] = read_structure(path)
            obj, records, prefix = self._read[path]
            theirs = obj.get(tensor) if isinstance(obj, dict) else None
            if not isinstance(theirs, TensorRef):
                continue
            if ((theirs.size, theirs.stride, theirs.storage_offset, theirs.storage.type_name, storage_bytes(theirs.storage))
                    != (like.size, like.stride, like.storage_offset, like.storage.type_name, storage_bytes(like.storage))):
                raise CheckpointError(
                    f"{path}: tensor {tensor} is {theirs.storage.type_name} {list(theirs.size)}, the base's "
                    f"{like.storage.type_name} {list(like.size)}; the checkpoints are from different models")
            record = records[f"{prefix}data/{theirs.storage.key}"]
            return Copied(path, record, record.data_offset, storage_bytes(theirs.storage))
        raise CheckpointError(f"{self.name}: its weight files have no tensor {tensor}; the checkpoint is incomplete "
                              "or from another model")
