"""Re-checking an output's weight files: each tensor its row's chosen source's, byte for byte.

- A safetensors file (the 16-bit model files, a PEFT adapter) starts with the header tailor-tui
  writes (the plan's: names, dtypes, shapes, offsets and metadata, the base's), and each tensor,
  read with the safetensors library, is its source's: from a full checkpoint, the tensor of the
  same name in the files the plan names; from a partial checkpoint (which saves no 16-bit
  weights), its fp32 master put together from every rank's slice (`rows_files`, each checked
  against its recorded CRC-32) and cast to the file's dtype by torch (`Tensor.to`: round to
  nearest even, as ZeRO-3 makes its 16-bit partition after each step); a frozen parameter or a
  buffer of a partial checkpoint, which has no master, from its ranks' model_states.
- A torch-format weight file (`pytorch_model*.bin`) holds the base's names in the base's order,
  each tensor its source's (every file loaded by `torch_files.load`, CRC-32s checked first).
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from zlib import crc32

from tailor_tui.formats.ds_format import FROZEN_PARAM_FRAGMENTS, MODULE
from tailor_tui.planning.jobs import BinFileJob
from tailor_tui.verifying.compare import same_bytes
from tailor_tui.verifying.dcp_sources import DcpTensors, is_dcp_rank
from tailor_tui.verifying.recorded import Archives
from tailor_tui.verifying.rows_files import RowsFiles
from tailor_tui.verifying.torch_files import load, open_binary


@dataclass(frozen=True)
class WeightRecord:
    """What the output's provenance record holds of one weight file (`checkpoint.TAKEN_WEIGHTS`,
    `WEIGHT_HEADERS`, `ARCHIVES`): each tensor's CRC-32 as written, a safetensors file's header's, and the
    output's rank and torch-format files' records' listings (`recorded.Archives`); None: not recorded."""

    taken: dict | None = None
    header: int | None = None
    archives: Archives | None = None


def verify_weight_file(plan, job, report, partial: RowsFiles, *, changed: frozenset = frozenset(),
                       record: WeightRecord = WeightRecord()) -> None:
    """Check the output's weight file of `job` (a plan's ModelFileJob or BinFileJob). `changed`: the
    sources that changed since the composition, not read: the file's tensors from them are proven
    against what the composition recorded (`record`); where the base changed, a safetensors file's header
    too, and a torch-format file's names, order and kept tensors by its records' listing. What an older
    record lacks is not compared (`report.unproven`)."""
    if isinstance(job, BinFileJob):
        _verify_bin_file(plan, job, report, changed, record)
    else:
        _verify_safetensors_file(plan, job, report, partial, changed, record)


def _differs(plan, job, report, name: str, s: int) -> None:
    row = job.rows.get(name) or None
    report.add(row, f"{job.name}: {name}{f' (row {row})' if row else ''} differs from {plan.sources[s].name}'s")


def _verify_bin_file(plan, job: BinFileJob, report, changed: frozenset, record: WeightRecord) -> None:
    """A torch-format weight file: the base's names, each tensor's bytes its row's source's (from a source that
    changed since: its storage's CRC-32 what the composition took). Once the base changed, the file's records
    as the composition wrote them (`record.archives`: names and stored CRC-32s, each record's bytes checked
    against its own as torch's loader here reads it) prove its names, order and the base's kept tensors."""
    out_file = plan.output / job.name
    if not out_file.is_file():
        report.add(None, f"{out_file}: missing (the base has {job.name})")
        return
    got = load(out_file)  # (every record's CRC-32 checked)
    loaded: dict[Path, dict] = {}
    taken = record.taken
    if 0 in changed:  # (a listing recorded that fails is a FAIL line of its own: `Archives.failed`)
        if record.archives is None or not record.archives.recorded_for(job.name):
            report.unproven.append(f"{out_file}: its names, their order and the base's tensors not compared: the "
                                   "base changed since the composition, and the output's provenance record holds "
                                   "no listing of its records")
        else:
            record.archives.file_proven(job.name)
    else:
        loaded[job.base_file] = load(job.base_file)
        if list(got) != list(loaded[job.base_file]):
            report.add(None, f"{job.name}: does not hold the base's tensors in the base's order")
            return

    def source(s: int, name: str):
        for path in (job.base_file,) if s == 0 else job.weights[s].files:
            if path not in loaded:
                loaded[path] = load(path)
            if name in loaded[path]:
                return loaded[path][name]
        return None

    for name, tensor in got.items():
        s = job.sources.get(name, 0)
        if s in changed:
            if s:
                _taken(plan, job, report, out_file, name, s, taken, _storage_crc(tensor))
            continue
        want = source(s, name)
        if want is None or not same_bytes(tensor, want):
            _differs(plan, job, report, name, s)


# the safetensors library's own bound on a header (it refuses a longer one)
MAX_HEADER = 100_000_000


def _prefix(path: Path) -> bytes:
    """A safetensors file's 8-byte header length and header, as it holds them (bounded; parsed by the library
    and `_header_names`)."""
    with open_binary(path) as f:
        first = f.read(8)
        if len(first) < 8:
            raise ValueError(f"{len(first)} byte(s), fewer than the 8 of a header's length")
        (length,) = struct.unpack("<Q", first)
        if length > MAX_HEADER:
            raise ValueError(f"a header of {length:,} bytes")
        raw = f.read(length)
    if len(raw) != length:
        raise ValueError(f"a header of {length:,} bytes of which {len(raw):,} could be read")
    return first + raw


def _header_names(prefix: bytes) -> list[str]:
    """The tensor names of a safetensors header (8-byte little-endian length, then JSON), in its
    order. ValueError where the safetensors library would read it otherwise than it looks (it
    checks the rest itself): a header not starting with `{`, or naming something twice (the
    library keeps one of the two silently)."""
    (length,) = struct.unpack("<Q", prefix[:8])
    raw = prefix[8: 8 + length]
    if not raw.startswith(b"{"):
        raise ValueError(f"its header starts with {raw[:1]!r}, not '{{'")
    return [name for name in json.loads(raw, object_pairs_hook=_once) if name != "__metadata__"]


def _once(pairs: list) -> dict:
    found = dict(pairs)
    if len(found) != len(pairs):
        names = sorted(name for name, _value in pairs)
        twice = next(a for a, b in zip(names, names[1:]) if a == b)
        raise ValueError(f"its header names {twice!r} twice")
    return found


def _verify_safetensors_file(plan, job, report, partial: RowsFiles, changed: frozenset,
                             record: WeightRecord) -> None:
    from safetensors import SafetensorError, safe_open

    out_file = plan.output / job.name
    if not out_file.is_file():
        report.add(None, f"{out_file}: missing (the base has {job.name})")
        return
    taken, prefix = record.taken, job.prefix
    older = 0 in changed and job.base_file is not None and (record.header is None or taken is None)
    if older:  # an older record: neither the header nor the base's tensors recorded
        report.unproven.append(f"{out_file}: its header and the base's tensors not compared: the base changed "
                               "since the composition, and the output's provenance record holds no CRC-32 of them")
    elif 0 in changed and job.base_file is not None:  # the header as written, by its recorded CRC-32
        try:
            prefix = _prefix(out_file)
        except (OSError, ValueError) as exc:
            report.add(None, f"{out_file}: not a sound safetensors file ({exc})")
            return
        if crc32(prefix) != record.header:
            report.add(None, f"{out_file}: its header is not the one the composition wrote (its provenance record)")
            return
    else:
        with open_binary(out_file) as f:
            if f.read(len(job.prefix)) != job.prefix:  # names, dtypes, shapes, offsets and metadata
                report.add(None, f"{out_file}: its header is not the base's {job.name} header")
                return
    sources = _Expected(plan, job, partial)
    try:
        out = safe_open(str(out_file), "pt")
    except (SafetensorError, OSError) as exc:
        report.add(None, f"{out_file}: not a readable safetensors file ({str(exc)[:200]})")
        return
    try:
        names = _header_names(prefix)
    except ValueError as exc:
        report.add(None, f"{out_file}: not a sound safetensors file ({exc})")
        return
    for name in names:
        s = job.sources.get(name, 0)
        got = out.get_tensor(name)
        if s in changed:  # what was taken, as recorded (an older record: the base's kept tensors not among them)
            if s or not older:
                _taken(plan, job, report, out_file, name, s, taken, _crc(got))
            continue
        want = sources.tensor(s, name, got)
        if want is None or not same_bytes(got, want):
            _differs(plan, job, report, name, s)


def _taken(plan, job, report, out_file: Path, name: str, s: int, taken: dict | None, crc: int) -> None:
    """Tensor `name` of a weight file, from source `s` that changed since the composition: its CRC-32 `crc`
    (its bytes', a torch-format file's storage's) is what the composition recorded it took."""
    if taken is None or name not in taken:
        report.unproven.append(f"{out_file}: {name} not compared: {plan.sources[s].name} changed since the "
                               "composition, and the output's provenance record holds no CRC-32 of it")
    elif crc != taken[name]:
        row = job.rows.get(name) or None
        report.add(row, f"{job.name}: {name}{f' (row {row})' if row else ''} differs from what the "
                        f"composition took from {plan.sources[s].name} (its provenance record)")


def _storage_crc(tensor) -> int:
    """The CRC-32 of a torch-format file's tensor's whole storage (its record's bytes)."""
    import torch

    return _crc(torch.empty(0, dtype=torch.uint8).set_(tensor.untyped_storage()))


def _crc(tensor) -> int:
    import zlib

    import torch

    return zlib.crc32(tensor.contiguous().reshape(-1).view(torch.uint8).numpy())


class _Expected:
    """The tensors an output weight file's tensors must equal, from each source, read as needed."""

    def __init__(self, plan, job, partial: RowsFiles):
        self.plan, self.job, self.partial = plan, job, partial
        self.files: dict[Path, object] = {}  # full sources' safetensors files, opened
        self.states: dict[int, list] = {}  # partial sources: every rank's model_states, loaded
        self.slots: dict[int, dict] = {}  # partial sources: each trainable parameter's slot
        self.dcp = DcpTensors()  # DCP sources' tensors

    def tensor(self, s: int, name: str, got):
        """Tensor `name` as source `s` holds it, as the output holds it (`got`: its dtype and
        shape); None when the source has no such tensor."""
        source = self.plan.sources[s]
        if source.saved.masters_only:
            value = self._partial(s, self.job.params.get(name, name))  # the file may name it otherwise
            if value is None or value.numel() != got.numel():
                return None
            return value.to(got.dtype).reshape(got.shape)
        for path in self.job.weights[s].files if s in self.job.weights else ():  # (a full source's own files)
            handle = self._open(path)
            if name in handle.keys():
                return handle.get_tensor(name)
        return None

    def _open(self, path: Path):
        from safetensors import safe_open

        if path not in self.files:
            with open_binary(path):  # not a FIFO or a device: safetensors would wait on it
                pass
            self.files[path] = safe_open(str(path), "pt")
        return self.files[path]

    def _partial(self, s: int, name: str):
        """A partial checkpoint's parameter `name`, flattened: the fp32 master from every rank's
        slice, or a frozen parameter's fragments or a buffer from its ranks' model_states."""
        import torch

        source = self.plan.sources[s]
        if is_dcp_rank(source.ranks[0]):  # a PyTorch Distributed Checkpoint: its `model.<name>`, whole
            return self.dcp.tensor(source.ranks[0], f"model.{name}")
        if s not in self.slots:
            self.slots[s] = {slot.name: slot for slot in source.layout.slots}
        slot = self.slots[s].get(name)
        if slot is not None:
            return self.partial.parameter(source.ranks, "fp32", name, slot.numel, slot.part)
        if s not in self.states:
            self.states[s] = [load(files.model_states) for files in source.ranks]
        states = self.states[s]
        shapes = dict(source.layout.frozen)
        if name in shapes and all(name in (st.get(FROZEN_PARAM_FRAGMENTS) or {}) for st in states):
            # ZeRO-3 keeps each rank's part of a frozen parameter, padded
            whole = torch.cat([st[FROZEN_PARAM_FRAGMENTS][name].reshape(-1) for st in states])
            return whole[: math.prod(shapes[name])]
        module = states[0].get(MODULE) or {}
        return module[name].reshape(-1) if name in module else None
