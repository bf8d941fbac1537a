"""An HF checkpoint's own weight files as a source of an output's: its 16-bit model files (or shards) or its
PEFT adapter in safetensors, each tensor found by name across the files, whole, stored as the output's file
stores it. safetensors keeps no checksum: the writer records what it takes (`compose.taken`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from tailor_tui.errors import CheckpointError
from tailor_tui.formats.dtypes import SAFETENSORS_ITEMSIZE
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
