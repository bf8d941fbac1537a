"""What a scan reads of each checkpoint's rank-0 model_states file, cached outside the run.

Opening a checkpoint unpickles rank 0's model_states file, its bounds checked first: on a
run of 100 checkpoints of an 80-row model that is most of a scan. What `open_checkpoint`
takes from it (`ModelStates`: DeepSpeed release, step, ZeRO layout, rows, precision) is
kept as JSON under `cache.cache_dir()`, keyed by the file's identity (path, device, inode,
size, mtime) and FORMAT: a second scan of a run unpickles nothing, a changed file is read
again. An entry is validated field by field when read back; anything else is read again.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from itertools import chain
from pathlib import Path
from typing import Callable

from tailor_tui.checkpoints.cache import entry, file_identity, read_json, write_json
from tailor_tui.checkpoints.layout import ZeroLayout
from tailor_tui.checkpoints.rows import Row

FORMAT = 6  # of the entries: bump when what they hold or mean changes (4: a multimodal model's rows per stack;
# 5: a PEFT model's rows the plain model's where LoRA adapts a numbered Sequential; 6: a block several layers run,
# a row of its own)
MAX_CACHED = 64 << 20  # an entry larger than this is not one of ours
PRECISIONS = ("fp16", "fp32")


@dataclass(frozen=True)
class ModelStates:
    """What open_checkpoint takes from a rank-0 model_states file."""

    ds_version: str  # "" when absent
    step: int
    layout: ZeroLayout
    rows: tuple[Row, ...]  # in model order
    precision: str  # "fp16" or "fp32" as model_states tells it (a bf16 run is told by its optim files' names)


def cached(path: Path, read: Callable[[Path], ModelStates], *, cache: Path | None) -> ModelStates:
    """`read(path)`, or what it gave for the file as it is now when `cache` holds it; None: no cache."""
    if cache is None:
        return read(path)
    try:
        identity = file_identity(path)  # before reading: a file changed meanwhile is read again next time
    except OSError:
        return read(path)  # missing or unreadable: `read` says why
    where = entry(cache, "scan", hashlib.sha256(json.dumps([FORMAT, identity]).encode()).hexdigest())
    found = from_json(read_json(where, MAX_CACHED), identity)
    if found is None:
        found = read(path)
        write_json(where, to_json(found, identity))
    return found


def to_json(states: ModelStates, identity: list) -> dict:
    layout = states.layout
    return {
        "format": FORMAT,
        "identity": identity,
        "ds_version": states.ds_version,
        "step": states.step,
        "world_size": layout.world_size,
        "groups": [[[name, list(shape)] for name, shape in group] for group in layout.groups],
        "frozen": [[name, list(shape)] for name, shape in layout.frozen],
        "rows": [[r.name, r.module_path, list(r.params), list(r.buffers), [list(a) for a in r.aliases], r.group]
                 for r in states.rows],
        "precision": states.precision,
    }


def from_json(data, identity: list) -> ModelStates | None:
    """The entry `data` holds for the file of `identity`; None if it is anything else."""
    try:
        if data["format"] != FORMAT or data["identity"] != identity:
            return None
        layout = ZeroLayout(_count(data["world_size"], least=1),
                            tuple(_shapes(group) for group in _list(data["groups"])), _shapes(data["frozen"]))
        rows = tuple(Row(_str(name), _str(path), _strs(params), _strs(buffers),
                         tuple(_pair(a) for a in _list(aliases)), _str(group))
                     for name, path, params, buffers, aliases, group in _list(data["rows"]))
        if data["precision"] not in PRECISIONS:
            return None
        return ModelStates(_str(data["ds_version"]), _count(data["step"]), layout, rows, data["precision"])
    except (TypeError, ValueError, KeyError):
        return None


def _list(value) -> list:
    if type(value) is not list:
        raise TypeError("not a list")
    return value


def _str(value) -> str:
    if type(value) is not str:
        raise TypeError("not a string")
    return value


def _strs(values) -> tuple[str, ...]:
    values = tuple(_list(values))
    if not set(map(type, values)) <= {str}:  # map, not a loop: thousands of names per entry
        raise TypeError("not strings")
    return values


def _pair(value) -> tuple[str, str]:
    alias, target = _strs(value)
    return alias, target


def _count(value, least: int = 0) -> int:
    if type(value) is not int or value < least:  # a bool is an int, but not a count
        raise ValueError("not a count")
    return value


def _shapes(pairs) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """(name, shape) pairs; checked as a whole (thousands of parameters per entry)."""
    found = tuple((name, tuple(shape)) for name, shape in _list(pairs))
    dims = list(chain.from_iterable(shape for _, shape in found))
    if not (set(map(type, (name for name, _ in found))) <= {str} and set(map(type, dims)) <= {int}
            and min(dims, default=0) >= 0):
        raise ValueError("not (name, shape) pairs")
    return found
