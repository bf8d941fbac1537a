"""Reading safetensors files without loading them: a file's header, where each tensor lies.

Beside `safetensors_out` (which lays files out to write them). Every header read is bounded and
checked against the file's size, so a truncated or crafted file is one line, not a traceback.
Torch-free.
"""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path

from tailor_tui.errors import CheckpointError
from tailor_tui.formats.dtypes import SAFETENSORS_ITEMSIZE
from tailor_tui.reading import open_regular

MAX_HEADER = 100_000_000  # bytes: the safetensors library's own bound
PER_TENSOR, METADATA = 1 << 10, 1 << 20  # a header's bytes beyond these per tensor it lists are no model's
# what is parsed: a model's header takes ~150 bytes and ~8 JSON values (counted by their `,[{`) per
# tensor; Python holds it three times over (bytes, text, objects), plus ~70 bytes per value
MAX_PARSED, MAX_VALUES = 32 << 20, 1 << 20


def safetensors_header(path: Path) -> tuple[dict, int]:
    """(header, first data byte) of a safetensors file. The header is bounded before it is parsed:
    at most MAX_HEADER bytes, and at most PER_TENSOR bytes per tensor it lists plus METADATA (a
    crafted header of a few tensors and 99 MB would take gigabytes as Python objects), at most
    MAX_PARSED bytes and MAX_VALUES values; each tensor's bytes are what its shape and dtype need."""
    try:
        with os.fdopen(open_regular(path), "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > MAX_HEADER:
                raise ValueError(f"a header of {length:,} bytes")
            raw = f.read(length)
        tensors = raw.count(b'"data_offsets"')
        if length > METADATA + PER_TENSOR * tensors:
            raise ValueError(f"a header of {length:,} bytes for {tensors:,} tensor(s)")
        values = raw.count(b",") + raw.count(b"[") + raw.count(b"{")
        if length > MAX_PARSED or values > MAX_VALUES:
            raise ValueError(f"a header of {length:,} bytes and {values:,} JSON values, more than any model's")
        header = json.loads(raw)
        if not isinstance(header, dict):
            raise ValueError("its header is not a JSON object")
        size = path.stat().st_size
        for name, info in header.items():
            if name == "__metadata__":
                continue
            (start, end), itemsize = info["data_offsets"], SAFETENSORS_ITEMSIZE.get(info["dtype"])
            if 8 + length + end > size:
                raise ValueError(f"{name} runs past the end of the file")
            if not 0 <= start <= end or itemsize and math.prod(info["shape"]) * itemsize != end - start:
                raise ValueError(f"{name}: its shape and dtype do not fit its {end - start:,} bytes")
        return header, 8 + length
    except RecursionError:
        raise CheckpointError(f"{path}: not a safetensors file (its header nests too deeply); re-copy it from "
                              "the training run") from None
    except (OSError, ValueError, KeyError, TypeError, IndexError, struct.error) as exc:
        raise CheckpointError(f"{path}: not a complete safetensors file, truncated or corrupt ({exc}); "
                              "re-copy it from the training run") from None


def header_prefix(header: str) -> bytes:
    """A file's prefix (8-byte length + JSON header) for its header text."""
    raw = header.encode()
    return struct.pack("<Q", len(raw)) + raw


def parse_prefix(prefix: bytes) -> dict[str, tuple[str, tuple, int, int]]:
    """name -> (dtype, shape, first byte, end byte) in the file, from a file's prefix."""
    (length,) = struct.unpack("<Q", prefix[:8])
    return tensor_places(json.loads(prefix[8: 8 + length]), 8 + length)


def tensor_places(header: dict, start: int) -> dict[str, tuple[str, tuple, int, int]]:
    """name -> (dtype, shape, first byte, end byte) in the file, from its parsed header (the
    tensors' data starting at byte `start`)."""
    return {
        name: (info["dtype"], tuple(info["shape"]), start + info["data_offsets"][0], start + info["data_offsets"][1])
        for name, info in header.items()
        if name != "__metadata__"
    }


def safetensors_tensors(path: Path) -> dict[str, tuple[str, tuple, int, int]]:
    """name -> (dtype, shape, first byte, end byte) in the file, from its JSON header."""
    return tensor_places(*safetensors_header(path))
