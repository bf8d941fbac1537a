"""Reading safetensors files without loading them: a file's header, where each tensor lies.

Beside `safetensors_out` (which lays files out to write them). Every header read is bounded and
checked as the safetensors library checks it (`SafeTensors::read_metadata` and
`Metadata::validate`, safetensors/src/tensor.rs), and a little more strictly where the library
would read a file otherwise than it looks: a header is one JSON object (starting with `{`), of
UTF-8 text with no name twice; each tensor has a known dtype, a shape of non-negative integers,
and two offsets (start <= end) spanning exactly what its shape and dtype need; the tensors,
taken by their offsets, tile the data from its first byte to the file's last, with no gap, no
overlap and nothing after them; `__metadata__` maps text to text. Anything else is one line
naming the file and the tensor or field, not a traceback. Torch-free.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

from tailor_tui.checked.files import open_regular
from tailor_tui.errors import RECOPY, CheckpointError
from tailor_tui.formats.dtypes import SAFETENSORS_ITEMSIZE

MAX_HEADER = 100_000_000  # bytes: the safetensors library's own bound
PER_TENSOR, METADATA = 1 << 10, 1 << 20  # a header's bytes beyond these per tensor it lists are no model's
# what is parsed: a model's header takes ~150 bytes and ~8 JSON values (counted by their `,[{`) per
# tensor; Python holds it three times over (bytes, text, objects), plus ~70 bytes per value
MAX_PARSED, MAX_VALUES = 32 << 20, 1 << 20
USIZE = (1 << 64) - 1  # the library reads shapes and offsets as usize (64-bit): larger is refused
FIELDS = {"dtype", "shape", "data_offsets"}


def safetensors_header(path: Path) -> tuple[dict, int]:
    """(header, first data byte) of a safetensors file (`safetensors_prefix`)."""
    header, prefix = safetensors_prefix(path)
    return header, len(prefix)


def safetensors_prefix(path: Path) -> tuple[dict, bytes]:
    """(header, prefix: the 8-byte length and the header's bytes, as checked) of a safetensors
    file, checked as `check_header` says against the file's size. The header is bounded before it is parsed: at most MAX_HEADER bytes, and at
    most PER_TENSOR bytes per tensor it lists plus METADATA (a crafted header of a few tensors and
    99 MB would take gigabytes as Python objects), at most MAX_PARSED bytes and MAX_VALUES values."""
    try:
        with os.fdopen(open_regular(path), "rb") as f:
            size = os.fstat(f.fileno()).st_size
            first = f.read(8)
            if len(first) < 8:
                raise ValueError(f"{len(first)} byte(s), fewer than the 8 of a header's length")
            (length,) = struct.unpack("<Q", first)
            if length > MAX_HEADER:
                raise ValueError(f"a header of {length:,} bytes")
            if 8 + length > size:
                raise ValueError(f"a header of {length:,} bytes in a file of {size:,}")
            raw = f.read(length)
        if len(raw) != length:
            raise ValueError(f"a header of {length:,} bytes of which {len(raw):,} could be read")
        tensors = raw.count(b'"data_offsets"')
        if length > METADATA + PER_TENSOR * tensors:
            raise ValueError(f"a header of {length:,} bytes for {tensors:,} tensor(s)")
        values = raw.count(b",") + raw.count(b"[") + raw.count(b"{")
        if length > MAX_PARSED or values > MAX_VALUES:
            raise ValueError(f"a header of {length:,} bytes and {values:,} JSON values, more than any model's")
        return check_header(raw, size - 8 - length), first + raw
    except RecursionError:
        raise CheckpointError(f"{path}: not a safetensors file (its header nests too deeply); re-copy it from "
                              "the training run") from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: not a complete safetensors file, truncated or corrupt ({exc}); "
                              f"{RECOPY}") from None


def _object(pairs: list[tuple[str, object]]) -> dict:
    """A JSON object whose names are each given once (the library keeps one of two silently)."""
    found: dict = {}
    for name, value in pairs:
        if name in found:
            raise ValueError(f"its header names {name!r} twice")
        found[name] = value
    return found


def _constant(word: str):
    raise ValueError(f"its header holds {word}, which is not JSON")


def _text(value: object, what: str) -> str:
    """A JSON string the library reads: no lone surrogate (`\\ud800`), which Python accepts."""
    if not isinstance(value, str):
        raise ValueError(f"{what} is {type(value).__name__}, not text")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"{what} holds a lone surrogate escape ({value!r})") from None
    return value


def _count(value: object, what: str) -> int:
    if type(value) is not int or not 0 <= value <= USIZE:
        raise ValueError(f"{what} {value!r}, not an integer from 0 to 2**64-1")
    return value


def check_header(raw: bytes, data_length: int | None) -> dict:
    """The parsed header of `raw` (a header's JSON bytes), checked as the module says; the data
    after it holds `data_length` bytes (None: unknown, only what the header says of itself).
    ValueError (naming the tensor or field) when the library would refuse or misread it."""
    if not raw.startswith(b"{"):
        raise ValueError(f"its header starts with {raw[:1]!r}, not '{{'")
    header = json.loads(raw.decode("utf-8"), object_pairs_hook=_object, parse_constant=_constant)
    spans = []
    for name, info in header.items():
        _text(name, "a tensor's name")
        if name == "__metadata__":
            if not isinstance(info, dict):
                raise ValueError(f"its __metadata__ is {type(info).__name__}, not a table of text to text")
            for key, value in info.items():
                _text(key, "a name in __metadata__")
                _text(value, f"__metadata__[{key!r}]")
            continue
        if not isinstance(info, dict) or info.keys() != FIELDS:
            got = sorted(info) if isinstance(info, dict) else type(info).__name__
            raise ValueError(f"tensor {name!r} has {got}, not its dtype, shape and data_offsets")
        dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
        if not isinstance(dtype, str) or dtype not in SAFETENSORS_ITEMSIZE:
            raise ValueError(f"tensor {name!r} has dtype {dtype!r}, not one tailor-tui knows "
                             f"({', '.join(SAFETENSORS_ITEMSIZE)})")
        if not isinstance(shape, list):
            raise ValueError(f"tensor {name!r} has shape {shape!r}, not a list")
        if not isinstance(offsets, list) or len(offsets) != 2:
            raise ValueError(f"tensor {name!r} has data_offsets {offsets!r}, not two integers")
        start, end = (_count(o, f"tensor {name!r} has a data offset") for o in offsets)
        if start > end:
            raise ValueError(f"tensor {name!r} has data_offsets [{start}, {end}]: its end before its start")
        elements = 1
        for d in shape:  # in the library's order, overflowing as it does
            elements *= _count(d, f"tensor {name!r} has a shape entry")
            if elements > USIZE:
                raise ValueError(f"tensor {name!r}: its shape {shape} does not fit 64 bits (more elements "
                                 "than 2**64)")
        if elements * SAFETENSORS_ITEMSIZE[dtype] * 8 > USIZE:
            raise ValueError(f"tensor {name!r}: its shape {shape} and dtype {dtype} do not fit 64 bits (more "
                             "bits than 2**64)")
        if elements * SAFETENSORS_ITEMSIZE[dtype] != end - start:
            raise ValueError(f"tensor {name!r}: its shape {shape} and dtype {dtype} do not fit its "
                             f"{end - start:,} bytes")
        spans.append((start, end, name))
    at = 0
    for start, end, name in sorted(spans, key=lambda span: span[:2]):  # as the library sorts them
        if start != at:
            raise ValueError(f"tensor {name!r} starts at byte {start:,} of the data, not at {at:,} where the "
                             f"previous one ends ({'a gap' if start > at else 'an overlap'})")
        at = end
    if data_length is not None and at != data_length:
        raise ValueError(f"its tensors end at byte {at:,} of the data, which holds {data_length:,} "
                         f"({'bytes after the last tensor' if data_length > at else 'truncated'})")
    return header


def header_prefix(header: str) -> bytes:
    """A file's prefix (8-byte length + JSON header) for its header text."""
    raw = header.encode()
    return struct.pack("<Q", len(raw)) + raw


def parse_prefix(prefix: bytes) -> dict[str, tuple[str, tuple, int, int]]:
    """name -> (dtype, shape, first byte, end byte) in the file, from a file's prefix (its header
    checked as `check_header` checks it, the data's length unknown). ValueError if unsound."""
    (length,) = struct.unpack("<Q", prefix[:8])
    if len(prefix) != 8 + length:
        raise ValueError(f"a prefix of {len(prefix):,} bytes for a header of {length:,}")
    return tensor_places(check_header(prefix[8:], None), 8 + length)


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
