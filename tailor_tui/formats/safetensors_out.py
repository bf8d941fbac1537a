"""The layout of an exported model's safetensors files, decided before a byte is written.

An export knows every tensor's name, shape and dtype up front, so each file's JSON header,
each tensor's byte range and the shard each tensor lands in are fixed first; workers then
write every tensor's bytes straight into place (`export_rank`), in any order, and nothing
is ever held whole. The format (safetensors): an 8-byte little-endian header length, the
JSON header padded with spaces to a multiple of 8, then the data; a file's tensors laid out in
name order. Which tensor goes to which file, the files' names and the index are
huggingface_hub's (`split_torch_state_dict_into_shards`, what `save_pretrained` shards by), for
the tensors given in the state dict's order: `model-00001-of-00003.safetensors` with
`model.safetensors.index.json`, or a single `model.safetensors` when everything fits.

Torch-free.
"""

from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass

from tailor_tui.errors import UsageError
from tailor_tui.formats.dtypes import PRECISION, SAFETENSORS_ITEMSIZE, SAFETENSORS_NAME

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
ITEMSIZE = SAFETENSORS_ITEMSIZE
NAMED = SAFETENSORS_NAME  # a tensor's dtype -> its name in a header
DTYPES = {precision: NAMED[name] for precision, name in PRECISION.items()}  # --dtype -> safetensors' name


@dataclass(frozen=True)
class Placed:
    """A tensor's place: file `file`, its bytes at `offset` (from the file's start) on."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # safetensors' name: F32, BF16, F16
    file: str
    offset: int

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * ITEMSIZE[self.dtype]


@dataclass(frozen=True)
class ShardFile:
    name: str
    header: bytes  # the length prefix and the JSON header: the file's first bytes
    size: int  # the whole file's


def parse_size(text: str) -> int:
    """`5GB`, `500MB`, `2GiB`, `1000000` -> bytes (as `save_pretrained`'s max_shard_size)."""
    found = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(I?B?)\s*", text.upper())
    if not found:
        raise UsageError(f"--max-shard-size {text!r}: a size such as 5GB, 500MB or 2GiB")
    number, unit, binary = found.groups()
    base = 1024 if binary.startswith("I") else 1000
    value = int(float(number) * base ** " KMGT".index(unit or " "))
    if value < 1:
        raise UsageError(f"--max-shard-size {text!r}: must be at least 1 byte")
    return value


def shards(tensors: list[tuple[str, tuple[int, ...], str]],
           max_shard: int) -> list[list[tuple[str, tuple[int, ...], str]]]:
    """`tensors` (name, shape, safetensors dtype; in the state dict's order) split as huggingface_hub
    splits a state dict (`split_state_dict_into_shards_factory`): in their order, a new shard begun
    when the next tensor would take the open one past `max_shard` bytes; a tensor larger than
    `max_shard` gets a shard of its own at once, placed before the open shard, which stays open."""
    found: list[list[tuple[str, tuple[int, ...], str]]] = []
    current: list[tuple[str, tuple[int, ...], str]] = []
    size = 0
    for tensor in tensors:
        n = math.prod(tensor[1]) * ITEMSIZE[tensor[2]]
        if n > max_shard:
            found.append([tensor])
            continue
        if size + n > max_shard:
            found.append(current)
            current, size = [], 0
        current.append(tensor)
        size += n
    return found + [current] if current else found


def lay_out(tensors: list[tuple[str, tuple[int, ...], str]], max_shard: int,
            metadata: dict | None = None) -> tuple[list[ShardFile], dict[str, Placed], dict | None]:
    """(files, every tensor's place, the index to write or None) of `tensors` (name, shape,
    safetensors dtype), given in the state dict's order: sharded by `shards`, named and indexed
    as huggingface_hub names and indexes them (one shard: `model.safetensors` and no index).
    No tensors at all: one `model.safetensors` holding none."""
    groups = shards(tensors, max_shard) or [[]]
    names = [SINGLE] if len(groups) == 1 else [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
                                               for i in range(len(groups))]
    files, placed = [], {}
    for file, group in zip(names, groups, strict=True):
        header, begin = {"__metadata__": {"format": "pt", **(metadata or {})}}, 0
        for name, shape, dtype in sorted(group):
            end = begin + math.prod(shape) * ITEMSIZE[dtype]
            header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [begin, end]}
            begin = end
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        start = 8 + len(text)
        files.append(ShardFile(file, struct.pack("<Q", len(text)) + text, start + begin))
        for name, shape, dtype in group:
            placed[name] = Placed(name, shape, dtype, file, start + header[name]["data_offsets"][0])
    index = None
    if len(files) > 1:
        index = {"metadata": {"total_size": sum(p.nbytes for p in placed.values())},
                 "weight_map": {name: placed[name].file for name in sorted(placed)}}
    return files, placed, index
