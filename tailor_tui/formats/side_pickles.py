"""A run-level side file checked as torch will read it, before it is trusted or copied. Torch-free.

The files an output takes whole from its base (`rng_state_R.pth`, `scheduler.pt`, `training_args.bin`,
Accelerate's `random_states_R.pkl`, `scheduler.bin`, `optimizer.bin`, a `.bin` of weights no row
changes, …) are torch files or plain pickles. `check_side_file` is the one check every path runs on
such a file before it copies it (`--apply`, `--heal`): first its records and their CRC-32s
(`ptfile.check_crcs`), then its pickle, read by `pickled`'s bounded unpickler (`pickle_bounds`: size,
memo, nesting, what it would build; well-formed up to its STOP) with every global an inert stand-in
(`side_globals`: nothing it names is imported or called):

- each storage it names (a persistent id) is a record of the archive holding exactly its elements'
  bytes (torch refuses a record of another size), of a storage type torch has, restored to a device
  torch knows;
- each tensor's view (offset, shape, strides) lies inside its storage, and only a floating-point one
  requires gradients;
- the archive's `version` and `byteorder` records are values torch reads, and its pickle sits in the
  folder torch reads (the first record's).

A legacy-format (non-zip) torch file gets the same (its storages' sizes are checked as `ptlegacy`
reads them); a plain pickle (`*.pkl`, as older Accelerate wrote its RNG states) the same bounds and
stand-ins, and no storage (`pickle.load` has none to give it). Any failure is one CheckpointError line
naming the file and what is wrong. Other files (JSON, scripts, tokenizers) are not pickles: only
`check_crcs`' test that they are no damaged zip archive applies.
"""

from __future__ import annotations

import os
import pickle
import re
from pathlib import Path

from tailor_tui.checked.files import open_regular
from tailor_tui.errors import CheckpointError
from tailor_tui.formats.pickle_bounds import MAX_PICKLE_BYTES
from tailor_tui.formats.pickled import read_pickle
from tailor_tui.formats.ptfile import (
    PICKLE_FAILURES,
    Record,
    Unsupported,
    check_crcs,
    file_format,
    read_structure,
)
from tailor_tui.formats.side_globals import DEVICE, stand_in

# torch's reader (caffe2 serialize): the file format versions it reads
MIN_VERSION, MAX_VERSION = 1, 10


def check_side_file(path: Path, *, fd: int | None = None) -> None:
    """Refuse (CheckpointError, one line naming the file) a side file torch would not load as it is
    (see the module's doc); nothing it names is imported or run. `fd`: a descriptor of the file, opened by
    the caller, who copies from it: the checks read that file (through /proc/self/fd, whatever is at
    `path` by now), so the bytes checked are the bytes copied."""
    path = Path(path)
    through = Path(f"/proc/self/fd/{fd}") if fd is not None else None
    if through is None or not through.exists():  # (no /proc: by its path, the caller's fstat compares)
        _check(path)
        return
    try:
        _check(through)
    except CheckpointError as exc:
        raise CheckpointError(str(exc).replace(str(through), str(path))) from None


def _check(path: Path) -> None:
    check_crcs(path)
    fmt = file_format(path)
    if fmt == "zip":
        _check_zip(path)
    elif fmt == "legacy":
        storages: dict = {}
        read_structure(path, storages, stand_in=stand_in)  # each storage's bytes counted as it reads them
        _check_devices(path, storages)
    elif path.suffix == ".pkl":
        _check_plain(path)


def _refused(path: Path, why: str) -> CheckpointError:
    return CheckpointError(f"{path}: refused to load: {why}; it is corrupt or was crafted, re-copy it from the "
                           "training run")


def _check_zip(path: Path) -> None:
    storages: dict = {}
    try:
        _obj, records, prefix = read_structure(path, storages, stand_in=stand_in)
    except Unsupported:
        raise _refused(path, "it has no single data.pkl record (torch's pickle)") from None
    first = next(iter(records), "")
    if "/" not in first or prefix != first.split("/")[0] + "/":
        raise _refused(path, f"its pickle {prefix}data.pkl is not in the folder of its first record {first!r}, "
                             "where torch reads it")
    with open(path, "rb") as f:
        version = _small(f, records.get(f"{prefix}.data/version") or records.get(f"{prefix}version"))
        order = _small(f, records.get(f"{prefix}byteorder"))
    if version is None or not re.fullmatch(rb"\d{1,4}\n?", version) \
            or not MIN_VERSION <= int(version) <= MAX_VERSION:
        raise _refused(path, f"its version record {version!r} is not a format version torch reads")
    if order is not None and order not in (b"little", b"big"):
        raise _refused(path, f"its byteorder record {order[:20]!r} is neither little nor big")
    for key, ref in storages.items():
        record = records.get(f"{prefix}data/{key}")
        if record is None:
            raise _refused(path, f"its pickle names storage {key}, but it has no record {prefix}data/{key}")
        need = ref.numel * ref.itemsize
        if record.size != need:
            raise _refused(path, f"storage {key} ({ref.numel} x {ref.type_name}) needs {need} bytes, its record "
                                 f"{record.name} holds {record.size}")
    _check_devices(path, storages)


def _small(f, record: Record | None) -> bytes | None:
    """The bytes of a small record (version, byteorder: 64 at most are read), None when there is none."""
    if record is None:
        return None
    return os.pread(f.fileno(), min(record.size, 64), record.data_offset)


def _check_devices(path: Path, storages: dict) -> None:
    for key, ref in storages.items():
        if not DEVICE.fullmatch(ref.location):
            raise _refused(path, f"storage {key} is to be restored to device {ref.location[:40]!r}, which torch "
                                 "does not know")


def _check_plain(path: Path) -> None:
    """A plain pickle (`pickle.dump`), bounded as a torch file's and read with the same stand-ins."""
    fd = open_regular(path)
    try:
        data = os.pread(fd, MAX_PICKLE_BYTES + 1, 0)
    finally:
        os.close(fd)
    if len(data) > MAX_PICKLE_BYTES:
        raise _refused(path, f"a pickle larger than {MAX_PICKLE_BYTES >> 20} MiB")
    storages: dict = {}
    try:
        read_pickle(data, storages, stand_in)
    except pickle.UnpicklingError as exc:
        raise _refused(path, str(exc)[:200]) from None
    except PICKLE_FAILURES as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:160]
        raise _refused(path, f"a pickle that cannot be read ({first})") from None
    if storages:
        raise _refused(path, "a plain pickle that names storages (only torch's files hold them)")
