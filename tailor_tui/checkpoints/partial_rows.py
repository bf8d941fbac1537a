"""The CRC-32s of a partial checkpoint's rows file (`tailor_rows_rank_{r}.safetensors`).

safetensors stores no checksum, so `selective.save_rows` records one per tensor in the file's
metadata: under "crc32", a JSON object {tensor name: CRC-32 of its first `valid` elements}
(the rank's real data; the padding after it is not covered, nor ever read). Readers check
each slice they take against it, so a flipped bit in a partial save is refused instead of
being carried into a composed file under a fresh CRC. Saves made before the CRCs were
recorded have none: their slices are taken unchecked, as before.
"""

from __future__ import annotations

import json
from pathlib import Path

from tailor_tui import moved
from tailor_tui.checked import crc
from tailor_tui.errors import CheckpointError
from tailor_tui.formats.safetensors_in import safetensors_header, tensor_places

CRC_METADATA = "crc32"

__getattr__ = moved.names(__name__, {"crc_range_checked": "tailor_tui.checked.evidence"})


def crc_metadata(slices: dict[str, memoryview]) -> str:
    """The metadata value recording each slice's CRC-32 (`slices`: name -> its valid bytes)."""
    return json.dumps({name: crc.crc32(view) for name, view in sorted(slices.items())}, separators=(",", ":"))


def read_rows_file(path: Path) -> tuple[dict, dict[str, int]]:
    """From one read of the rows file `path`'s header: where each tensor lies (as
    `safetensors_in.safetensors_tensors`) and {tensor name: CRC-32 of its valid bytes} recorded
    ({} if none)."""
    header, start = safetensors_header(path)
    return tensor_places(header, start), _recorded_crcs(path, header)


def _recorded_crcs(path: Path, header: dict) -> dict[str, int]:
    metadata = header.get("__metadata__") or {}
    text = metadata.get(CRC_METADATA) if isinstance(metadata, dict) else None
    if text is None:
        return {}
    try:
        crcs = json.loads(text)
        if isinstance(crcs, dict) and all(isinstance(v, int) and 0 <= v < 1 << 32 for v in crcs.values()):
            return crcs
    except (TypeError, ValueError):
        pass
    raise CheckpointError(f"{path}: its recorded CRC-32s are unreadable; the partial checkpoint is corrupt, re-copy it")


def partial_slice(path: Path, tensors: dict, key: str, param: str, length: int) -> tuple:
    """(dtype, shape, first byte, end byte) of one parameter's slice in a partial checkpoint's
    rows file (`tensors`: its safetensors_tensors), checked to hold `length` fp32 elements."""
    name = f"{key}/{param}"
    found = tensors.get(name)
    if found is None:
        raise CheckpointError(f"{path}: has no tensor {name}; the partial checkpoint is incomplete, re-copy it")
    dtype, shape, begin, end = found
    if dtype != "F32" or end - begin < length * 4:
        raise CheckpointError(
            f"{path}: tensor {name} is {dtype} {list(shape)}, expected F32 of at least {length} "
            "elements; the partial checkpoint is from another run or layout"
        )
    return found
