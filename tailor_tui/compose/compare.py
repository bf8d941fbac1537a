"""Comparing loaded checkpoint structures byte for byte (used by the verifiers).

Every comparison is of bytes, not values: -0.0 is not 0.0, and a NaN equals the same NaN.
"""

from __future__ import annotations

from typing import Callable


def same_bytes(a, b) -> bool:
    """Whether two tensors hold the same bytes (dtype and shape included)."""
    import torch

    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


class PartialSlices:
    """A partial checkpoint's rows files as the verifiers read them: each slice read whole and
    checked against the CRC-32 its save recorded before it is compared (a damaged source is one
    line, not a verdict drawn from bytes nobody checked)."""

    def __init__(self):
        self.handles: dict = {}
        self.slices: dict = {}

    def get(self, path, name: str, valid: int):
        """The first `valid` elements of tensor `name` of the rows file `path`, checked."""
        from safetensors import safe_open

        from tailor_tui import crc
        from tailor_tui.checkpoints.partial_rows import check_crc, read_rows_file

        if (path, name) not in self.slices:
            if path not in self.handles:
                self.handles[path] = (safe_open(str(path), "pt"), read_rows_file(path)[1])
            handle, recorded = self.handles[path]
            tensor = handle.get_slice(name)[:valid]
            check_crc(path, recorded, name, crc.crc32(memoryview(tensor.contiguous().view(-1).numpy()).cast("B")))
            self.slices[path, name] = tensor
        return self.slices[path, name]


def nonzero_bytes(t) -> bool:
    """Any byte not zero (-0.0 counts)."""
    import torch

    return bool(t.contiguous().reshape(-1).view(torch.uint8).any())


def differences(mine, theirs, where: str = "", skip: Callable[[str], bool] = lambda where: False) -> list[str]:
    """Where two loaded checkpoint structures differ, byte for byte (`skip`: paths not compared)."""
    import struct

    import torch

    if skip(where):
        return []
    if isinstance(mine, torch.Tensor) or isinstance(theirs, torch.Tensor):
        same = isinstance(mine, torch.Tensor) and isinstance(theirs, torch.Tensor) and same_bytes(mine, theirs)
        return [] if same else [where]
    if type(mine) is not type(theirs):
        return [where]
    if isinstance(mine, dict):
        if list(mine) != list(theirs):
            return [f"{where} (keys)"]
        return [d for k in mine for d in differences(mine[k], theirs[k], f"{where}[{k!r}]", skip)]
    if isinstance(mine, (list, tuple)):
        if len(mine) != len(theirs):
            return [f"{where} (length)"]
        return [d for i, (a, b) in enumerate(zip(mine, theirs)) for d in differences(a, b, f"{where}[{i}]", skip)]
    if isinstance(mine, float):
        return [] if struct.pack("<d", mine) == struct.pack("<d", theirs) else [where]
    if hasattr(mine, "__dict__") and not isinstance(mine, type):  # the loss scaler
        return differences(vars(mine), vars(theirs), where, skip)
    return [] if mine == theirs else [where]
