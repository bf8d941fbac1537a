"""Comparing loaded checkpoint structures byte for byte.

Every comparison is of bytes, not values: -0.0 is not 0.0, and a NaN equals the same NaN.
"""

from __future__ import annotations

from typing import Callable

from tailor_tui.formats.pickled import Opaque, StorageRef, TensorRef


def same_bytes(a, b) -> bool:
    """Whether two tensors hold the same bytes (dtype and shape included)."""
    import torch

    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


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


def structure_differences(mine, theirs, where: str = "", skip: Callable[[str], bool] = lambda where: False,
                          tensors: Callable[[str, object, object], None] = lambda where, a, b: None) -> list[str]:
    """`differences` of two structures read without torch (`formats.pickled`: tensors and storages as stand-ins,
    no data): where they differ in anything but tensors' bytes. Each pair of tensors (or storages) alike in all
    but their bytes is handed to `tensors(where, mine, theirs)`, which compares the bytes (streamed, by the
    caller): a tensor's dtype, shape, strides and requires_grad are compared here."""
    if skip(where):
        return []
    if isinstance(mine, (TensorRef, StorageRef)) or isinstance(theirs, (TensorRef, StorageRef)):
        if type(mine) is not type(theirs):
            return [where]
        if isinstance(mine, TensorRef):
            def alike(t):
                return t.storage.type_name, t.storage.itemsize, t.size, t.stride, t.requires_grad

            if alike(mine) != alike(theirs):
                return [where]
        elif (mine.type_name, mine.itemsize, mine.numel) != (theirs.type_name, theirs.itemsize, theirs.numel):
            return [where]
        tensors(where, mine, theirs)
        return []
    if type(mine) is not type(theirs):
        return [where]
    if isinstance(mine, dict):
        if list(mine) != list(theirs):
            return [f"{where} (keys)"]
        return [d for k in mine for d in structure_differences(mine[k], theirs[k], f"{where}[{k!r}]", skip, tensors)]
    if isinstance(mine, (list, tuple)):
        if len(mine) != len(theirs):
            return [f"{where} (length)"]
        return [d for i, (a, b) in enumerate(zip(mine, theirs))
                for d in structure_differences(a, b, f"{where}[{i}]", skip, tensors)]
    if isinstance(mine, float):
        import struct

        return [] if struct.pack("<d", mine) == struct.pack("<d", theirs) else [where]
    if isinstance(mine, Opaque):  # a loss scaler, an enumeration member: its arguments and state
        return structure_differences(vars(mine), vars(theirs), where, skip, tensors)
    return [] if mine == theirs else [where]
