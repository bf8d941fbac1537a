"""A `.pt` file's structure read to be written again changed, without torch.

`Rewritable(path)` holds the structure as the torch-free reader's stand-ins, and for each of
its storages where its bytes lie (`ptwrite.Copied`: copied, their CRC-32 checked, when the
changed structure is written). `clone` gives a tensor its own copy of a storage (torch's
`clone`), `reserved` a new tensor whose bytes the caller writes later (`ptwrite.Reserved`).
Writing: `ptpickle.dumps` the changed object, then `ptwrite.write_archive` with `fills[id(s)]`
for each storage it lists. Used by the resharding skeleton and a partial base's optim file.
"""

from __future__ import annotations

from pathlib import Path

from tailor_tui.errors import CheckpointError
from tailor_tui.formats.pickled import StorageRef, TensorRef
from tailor_tui.formats.ptfile import Unsupported, locate, read_structure
from tailor_tui.formats.ptpickle import dumps, storage_bytes, tensor
from tailor_tui.formats.ptwrite import Copied, Reserved, write_archive


class Rewritable:
    """One file's structure as read, and where each of its storages' bytes lie."""

    def __init__(self, path: Path):
        refs: dict[str, StorageRef] = {}
        self.path = path
        self.obj, self.records, self.prefix = read_structure(path, refs)
        self.fills = {}  # id(StorageRef) -> Copied | Reserved
        for key, ref in refs.items():
            record = self.records.get(f"{self.prefix}data/{key}")
            if record is None or record.size != storage_bytes(ref):
                raise CheckpointError(f"{path}: storage {key} does not match its record in the archive; "
                                      "the file is corrupt, re-copy it from the training run")
            self.fills[id(ref)] = Copied(path, record, record.data_offset, record.size)

    def clone(self, value: TensorRef, fills: dict) -> TensorRef:
        """A copy of `value` in a storage of its own, as torch's `clone` makes one; its bytes
        are recorded in `fills`."""
        at = self.locate(value)
        storage = StorageRef("", value.storage.itemsize, value.numel(), value.storage.type_name)
        fills[id(storage)] = Copied(self.path, at.record, at.offset, at.numel * at.itemsize)
        return tensor(storage, value.size, requires_grad=value.requires_grad)

    def data(self, value: TensorRef, limit: int) -> bytes:
        """`value`'s bytes (a small tensor: at most `limit` bytes, else CheckpointError)."""
        at = self.locate(value)
        if at.numel * at.itemsize > limit:
            raise CheckpointError(f"{self.path}: a value of {at.numel} elements where a small one was expected; "
                                  "the file is from another run or layout")
        with open(self.path, "rb") as f:
            f.seek(at.offset)
            return f.read(at.numel * at.itemsize)

    def locate(self, value: TensorRef):
        try:
            return locate(value, self.records, self.prefix)
        except Unsupported as exc:
            raise CheckpointError(f"{self.path}: a tensor that cannot be copied ({exc})") from None


def reserved(size: int, like, fills: dict) -> TensorRef:
    """A 1-D tensor of `size` elements like `like` (dtype, requires_grad) whose bytes are left
    for the caller to write (TypeError if `like` is no tensor)."""
    if not isinstance(like, TensorRef):
        raise TypeError
    storage = StorageRef("", like.storage.itemsize, size, like.storage.type_name)
    fills[id(storage)] = Reserved(storage_bytes(storage))
    return tensor(storage, (size,), requires_grad=like.requires_grad)


def write(obj, fills: dict, path: Path, **kwargs) -> dict:
    """Write `obj` to `path` as torch.save would, each storage's bytes from `fills`; its records."""
    data, storages = dumps(obj)
    return write_archive(path, archive=path.stem, pickle=data, storages=[fills[id(s)] for s in storages], **kwargs)
