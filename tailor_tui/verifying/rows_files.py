"""A partial checkpoint's rows files (`tailor_rows_rank_{r}.safetensors`) as the verifier reads them.

Read with the safetensors library (`safe_open`). safetensors stores no checksum: a partial save
records one per tensor in the file's metadata, under "crc32", a JSON object {tensor name: CRC-32
of the tensor's first `valid` elements} (the rank's real data; the padding after it is not
covered). Every slice the verifier compares is checked against it first (zlib's CRC-32 of its
little-endian bytes), so a damaged source is one line, not a verdict drawn from bytes nobody
checked. A save made before the CRC-32s were recorded has none: its slices are taken unchecked.

A parameter of a partial checkpoint is reassembled here from every rank's slice of it: rank r
holds elements [r*part, r*part + valid(r)) of the flattened parameter (ZeRO-3's partition).
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path

from tailor_tui.errors import CheckpointError
from tailor_tui.verifying.torch_files import open_binary

CRC_METADATA = "crc32"


def _damaged(path: Path, why: str) -> CheckpointError:
    return CheckpointError(f"{path}: {why}; the partial checkpoint is damaged or incomplete, re-copy it")


class RowsFiles:
    """Slices of rows files, each read and checked once (kept for the caller's lifetime)."""

    def __init__(self) -> None:
        self.handles: dict[Path, tuple[object, dict[str, int]]] = {}
        self.slices: dict[tuple[Path, str], object] = {}

    def _open(self, path: Path):
        if path not in self.handles:
            from safetensors import SafetensorError, safe_open

            with open_binary(path):  # not a FIFO or a device: safetensors would wait on it
                pass
            try:
                handle = safe_open(str(path), "pt")
                metadata = handle.metadata() or {}
            except (SafetensorError, OSError, ValueError) as exc:
                raise _damaged(path, f"not a readable safetensors file ({str(exc)[:200]})") from None
            self.handles[path] = (handle, recorded_slices(path, metadata))
        return self.handles[path]

    def slice(self, path: Path, name: str, valid: int):
        """The first `valid` elements (fp32) of tensor `name` of the rows file `path`, checked
        against the CRC-32 its save recorded."""
        import torch
        from safetensors import SafetensorError

        key = (Path(path), name)
        if key not in self.slices:
            handle, recorded = self._open(key[0])
            try:
                found = handle.get_slice(name)
                dtype, shape = found.get_dtype(), found.get_shape()
            except SafetensorError:
                raise _damaged(path, f"has no tensor {name}") from None
            if dtype != "F32" or len(shape) != 1 or shape[0] < valid:
                raise _damaged(path, f"tensor {name} is {dtype} {list(shape)}, not F32 of at least {valid} elements")
            tensor = found[:valid] if valid else torch.zeros(0, dtype=torch.float32)
            stored = recorded.get(name)
            # an ndarray is a buffer; some numpy releases' stubs declare its __buffer__ for Python 3.12 on only
            if stored is not None and zlib.crc32(
                    tensor.contiguous().view(torch.uint8).numpy()) != stored:  # type: ignore[arg-type, unused-ignore]
                raise CheckpointError(f"{path}: tensor {name} fails its CRC-32 check (the file is damaged); "
                                      "re-copy the partial checkpoint, or take its rows from another checkpoint")
            self.slices[key] = tensor
        return self.slices[key]

    def parameter(self, ranks, key: str, name: str, numel: int, part: int):
        """Parameter `name`'s flattened tensor `key` (fp32, exp_avg, exp_avg_sq) of `numel`
        elements, `part` per rank, put together from the slices of `ranks` (a partial save's `kinds.partial.PartialRankFiles`, in order)."""
        import torch

        pieces = []
        for rank, files in enumerate(ranks):
            valid = max(0, min(part, numel - rank * part))
            if valid:
                pieces.append(self.slice(files.state_file, f"{key}/{name}", valid))
        whole = torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.float32)
        if whole.numel() != numel:
            raise CheckpointError(f"{ranks[0].state_file.parent}: its ranks' slices of {name} hold {whole.numel()} "
                                  f"elements, the parameter has {numel}; the partial checkpoint is incomplete")
        return whole


def recorded_slices(path: Path, metadata: dict) -> dict[str, int]:
    """{tensor name: CRC-32} the save recorded ({} if none)."""
    text = metadata.get(CRC_METADATA)
    if text is None:
        return {}
    try:
        crcs = json.loads(text)
    except (TypeError, ValueError):
        crcs = None
    if not isinstance(crcs, dict) or not all(type(v) is int and 0 <= v < 1 << 32 for v in crcs.values()):
        raise CheckpointError(f"{path}: its recorded CRC-32s are unreadable; the partial checkpoint is corrupt, "
                              "re-copy it")
    return crcs
