"""The chunks a DCP `.distcp` file holds: each a torch.save archive, one after another, as torch's
`FileSystemWriter` writes them (`_write_item`: `torch.save(tensor, stream)` at the stream's offset; a
value saved as bytes likewise). A tensor's chunk is a rectangular piece of it (`ChunkStorageMetadata`:
offsets and sizes per dimension), saved as a contiguous tensor of its own.

ZeRO-3 keeps each parameter flattened and cut into one range of elements per rank; a range of a
row-major tensor is a few rectangles (`boxes`): the rest of a first partial row, the whole rows, the
start of a last partial row (and so on down the dimensions), each itself a range of consecutive
elements. So a rank's range is written as those chunks, each streamed from the rank's bytes as they are.
Torch-free.
"""

from __future__ import annotations

import functools
import math

from tailor_tui.formats.dtypes import STORAGE_DTYPE, TABLE
from tailor_tui.formats.pickled import StorageRef
from tailor_tui.formats.ptpickle import dumps, tensor
from tailor_tui.formats.ptwrite import Reserved, layout, serialization_id

ARCHIVE = "archive"  # the archive name torch.save gives a stream
STORAGE_TYPE = {dtype: storage for storage, dtype in STORAGE_DTYPE.items()}
ITEMSIZE = {d.name: d.itemsize for d in TABLE}


def boxes(shape: tuple[int, ...], first: int, count: int) -> list[tuple[tuple[int, ...], tuple[int, ...], int, int]]:
    """The rectangles that elements `first` to `first + count` of a row-major tensor of `shape` make:
    [(offsets, sizes, first element, elements)], in order; each a range of consecutive elements."""
    if count <= 0:
        return []
    if not shape:
        return [((), (), 0, 1)]
    inner = math.prod(shape[1:])
    if inner == 0:
        return []
    if len(shape) == 1:
        return [((first,), (count,), first, count)]
    end = first + count
    row, last = first // inner, (end - 1) // inner
    found = []
    if row == last or first % inner:  # a first row only partly taken: its rectangles, a dimension down
        stop = min(end, (row + 1) * inner)
        for offsets, sizes, at, n in boxes(shape[1:], first - row * inner, stop - first):
            found.append(((row, *offsets), (1, *sizes), row * inner + at, n))
        first, row = stop, row + 1
    if first < end:
        whole = (end - first) // inner
        if whole:
            found.append(((row, *(0,) * (len(shape) - 1)), (whole, *shape[1:]), first, whole * inner))
            first, row = first + whole * inner, row + whole
        if first < end:
            for offsets, sizes, at, n in boxes(shape[1:], 0, end - first):
                found.append(((row, *offsets), (1, *sizes), row * inner + at, n))
    return found


@functools.lru_cache(maxsize=4096)
def tensor_chunk(dtype: str, sizes: tuple[int, ...]):
    """The archive of a chunk (`ptwrite.layout`): a contiguous `dtype` tensor of `sizes` whose bytes (storage 0)
    are the caller's to write, with their CRC-32. Laid out once per shape (a wide run's ranks hold chunks of
    a few shapes, millions of them): never changed once laid out."""
    numel = math.prod(sizes)
    storage = StorageRef("", ITEMSIZE[dtype], numel, STORAGE_TYPE[dtype])
    data, _ = dumps(tensor(storage, tuple(sizes)))
    return layout(archive=ARCHIVE, pickle=data, storages=[Reserved(numel * ITEMSIZE[dtype])],
                  ident=serialization_id(data, ARCHIVE))


def scalar_chunk(key: str, dtype: str, raw: bytes) -> bytes:
    """The archive of a 0-d `dtype` tensor whose bytes are `raw` (AdamW's `step`, Adafactor's `RMS`)."""
    storage = StorageRef("", ITEMSIZE[dtype], 1, STORAGE_TYPE[dtype])
    if len(raw) != ITEMSIZE[dtype]:
        raise ValueError(f"{key}: {len(raw)} bytes for one {dtype}")
    data, _ = dumps(tensor(storage, ()))
    return layout(archive=ARCHIVE, pickle=data, storages=[bytes(raw)], ident=serialization_id(data, key)).whole()


def value_chunk(key: str, value) -> bytes:
    """The archive of a value saved as bytes (a param group's `lr`, `betas`, `params`): torch.save of it."""
    data, storages = dumps(value)
    if storages:
        raise ValueError(f"{key}: a value saved as bytes holds no tensor")
    return layout(archive=ARCHIVE, pickle=data, storages=[], ident=serialization_id(data, key)).whole()
