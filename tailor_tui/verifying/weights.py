"""Re-checking an output's weight files: each tensor its row's chosen source's, byte for byte.

- A safetensors file (the 16-bit model files, a PEFT adapter) starts with the header tailor-tui
  writes (the plan's: names, dtypes, shapes, offsets and metadata, the base's), and each tensor is
  its source's: from a full checkpoint, the bytes of the tensor of the same name in the files the plan
  names; from a partial checkpoint or a DCP one (which save no 16-bit weights), its fp32 master (each
  rank's slice in its rows file, against the CRC-32 its save recorded; a DCP checkpoint's chunks),
  cast to the file's dtype as ZeRO-3 makes its 16-bit partition after each step (round to nearest
  even; `formats.dtypes.cast_difference`); a frozen parameter or a buffer of a partial checkpoint, which
  has no master, is what its ranks' model_states keep of it (each rank's fragment; rank 0's buffer). All
  are claimed on the output's bytes and compared as they are read (`rank_claims`, `streamed`); torch
  loads only a tensor no claim can place (`_compare_cast`: a view torch-free reading cannot locate, a
  cast other than fp32 to 16 bits, a tensor at an odd byte of its file).
- A torch-format weight file (`pytorch_model*.bin`) holds the base's names in the base's order,
  each tensor's bytes its source's (claimed: every record of each file checked against its CRC-32).
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from pathlib import Path
from zlib import crc32

from tailor_tui.dcp.metadata import MetadataIndex
from tailor_tui.errors import CheckpointError
from tailor_tui.formats.ds_format import FROZEN_PARAM_FRAGMENTS, MODULE
from tailor_tui.formats.dtypes import SAFETENSORS_ITEMSIZE, STORAGE_DTYPE, float_name
from tailor_tui.formats.pickled import TensorRef
from tailor_tui.formats.safetensors_in import MAX_HEADER, check_header, parse_prefix, safetensors_tensors
from tailor_tui.planning.jobs import BinFileJob
from tailor_tui.verifying.compare import same_bytes, structure_differences
from tailor_tui.verifying.dcp_sources import MASTERS, DcpTensors, chunk_range, claimed_chunk, is_dcp_rank
from tailor_tui.verifying.rank_claims import RankClaims, Tag, TorchFile
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


def claim_weight_file(ranks: RankClaims, job, partial: RowsFiles, *, changed: frozenset = frozenset(),
                      record: WeightRecord = WeightRecord()) -> None:
    """Claim the output's weight file of `job` (a plan's ModelFileJob or BinFileJob) on `ranks`' claims: each
    tensor's bytes its source's, compared as the file is read. `changed`: the sources that changed since the
    composition, not read: the file's tensors from them are proven against what the composition recorded
    (`record`); where the base changed, a safetensors file's header too, and a torch-format file's names, order
    and kept tensors by its records' listing. What an older record lacks is not compared (`report.unproven`). A
    tensor a partial save or a DCP checkpoint gives is its fp32 master, cast as it is read (`_claim_cast`)."""
    if isinstance(job, BinFileJob):
        _claim_bin_file(ranks, job, changed, record)
    else:
        _claim_safetensors_file(ranks, job, partial, changed, record)


def _differs(plan, job, report, name: str, s: int) -> None:
    row = job.rows.get(name) or None
    report.add(row, _differing(plan, job, name, s))


def _differing(plan, job, name: str, s: int) -> str:
    row = job.rows.get(name) or None
    return f"{job.name}: {name}{f' (row {row})' if row else ''} differs from {plan.sources[s].name}'s"


def _claim_bin_file(ranks: RankClaims, job: BinFileJob, changed: frozenset, record: WeightRecord) -> None:
    """A torch-format weight file: the base's names, each tensor's bytes its row's source's (from a source that
    changed since: its storage's CRC-32 what the composition took). Once the base changed, the file's records
    as the composition wrote them (`record.archives`: names and stored CRC-32s, each record's bytes checked
    against its own as it is read) prove its names, order and the base's kept tensors."""
    plan, report = ranks.plan, ranks.report
    out_file = plan.output / job.name
    if not out_file.is_file():
        report.add(None, f"{out_file}: missing (the base has {job.name})")
        return
    out = TorchFile(ranks.claims, out_file, label=job.task, whole=True)  # (every record's CRC-32 checked)
    ranks.outputs.add(out.f)
    got = out.obj if isinstance(out.obj, dict) else {}
    if 0 in changed:  # (a listing recorded that fails is a FAIL line of its own: `Archives.failed`)
        if record.archives is None or not record.archives.recorded_for(job.name):
            report.unproven.append(f"{out_file}: its names, their order and the base's tensors not compared: the "
                                   "base changed since the composition, and the output's provenance record holds "
                                   "no listing of its records")
        else:
            record.archives.file_proven(job.name)
    else:
        base = ranks.torch_file(0, job.base_file)
        if base is not None and list(got) != list(base.obj if isinstance(base.obj, dict) else {}):
            report.add(None, f"{job.name}: does not hold the base's tensors in the base's order")
            return
    for name, tensor in got.items():
        s = job.sources.get(name, 0)
        row = job.rows.get(name) or None
        if s in changed:
            if s:
                a, n, _dtype, _size = out.place(tensor.storage if isinstance(tensor, TensorRef) else tensor)
                _taken(ranks, job, out_file, name, s, record.taken, out.f, a, n)
            continue
        theirs = None
        for path in (job.base_file,) if s == 0 else job.weights[s].files:
            found = ranks.torch_file(s, path)
            if found is not None and isinstance(found.obj, dict) and name in found.obj:
                theirs = found
                break
        problem = _differing(plan, job, name, s)
        if theirs is None or structure_differences(
                tensor, theirs.obj[name], name,
                tensors=ranks.tensor_claims(out, theirs, "weight", -1, row=row, problem=problem, s=s)):
            report.add(row, problem)


def _prefix(path: Path) -> bytes:
    """An output safetensors file's 8-byte header length and header, as it holds them, unparsed (bounded as
    `safetensors_in.safetensors_prefix` bounds a source's: compared with the plan's bytes, then parsed)."""
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


def _claim_safetensors_file(ranks: RankClaims, job, partial: RowsFiles, changed: frozenset,
                            record: WeightRecord) -> None:
    plan, report = ranks.plan, ranks.report
    out_file = plan.output / job.name
    if not out_file.is_file():
        report.add(None, f"{out_file}: missing (the base has {job.name})")
        return
    taken, prefix = record.taken, job.prefix
    older = 0 in changed and job.base_file is not None and (record.header is None or taken is None)
    if older:  # an older record: neither the header nor the base's tensors recorded
        report.unproven.append(f"{out_file}: its header and the base's tensors not compared: the base changed "
                               "since the composition, and the output's provenance record holds no CRC-32 of them")
    try:
        found = _prefix(out_file)
    except (OSError, ValueError) as exc:
        report.add(None, f"{out_file}: not a sound safetensors file ({exc})")
        return
    if 0 in changed and job.base_file is not None and not older:  # the header as written, by its recorded CRC-32
        if crc32(found) != record.header:
            report.add(None, f"{out_file}: its header is not the one the composition wrote (its provenance record)")
            return
        prefix = found
    elif not older and found != job.prefix:  # names, dtypes, shapes, offsets and metadata
        report.add(None, f"{out_file}: its header is not the base's {job.name} header")
        return
    try:
        places = parse_prefix(prefix)
        size = ranks.claims.size(f := ranks.claims.file(out_file, label=job.task))
        check_header(prefix[8:], size - len(prefix))
    except ValueError as exc:
        report.add(None, f"{out_file}: not a sound safetensors file ({exc})")
        return
    ranks.outputs.add(f)
    ranks.claims.evidence(f, len(prefix), size - len(prefix), None, "its tensors")
    sources = _Expected(plan, job, partial)
    for name in places:
        s = job.sources.get(name, 0)
        dtype, shape, a, b = places[name]
        if s in changed:  # what was taken, as recorded (an older record: the base's kept tensors not among them)
            if s or not older:
                _taken(ranks, job, out_file, name, s, taken, f, a, b - a)
            continue
        if plan.sources[s].saved.masters_only:  # a cast of its fp32 master (claimed; by torch: `_compare_cast`)
            if (a - len(prefix)) % 2 or not _claim_cast(ranks, job, f, name, s, dtype, a, b,
                                                                  sources.slot(s, job.params.get(name, name))):
                _compare_cast(ranks, job, out_file, name, s, sources)
            continue
        theirs = sources.place(s, name)
        if theirs is None or theirs[1:3] != (dtype, shape) or theirs[4] - theirs[3] != b - a:
            _differs(plan, job, report, name, s)
            continue
        path, _dtype, _shape, c, d = theirs
        g = ranks.claims.file(path)
        ranks.claims.evidence(g, c, d - c, None, f"tensor {name}")
        ranks.claim(Tag("weight", -1, job.rows.get(name) or None, _differing(plan, job, name, s), s, g), f, a, b - a,
                    g, c)


def _claim_cast(ranks: RankClaims, job, f: int, name: str, s: int, dtype: str, a: int, b: int, slot) -> bool:
    """Claim tensor `name` (bytes [a, b) of output file `f`, of `dtype`) on the fp32 master source `s` holds of it
    (a partial save's slice in each rank's rows file: `slot`, its parameter's, None for one it keeps in its
    model_states, `_claim_kept`; a DCP checkpoint's chunks), cast to `dtype` as it is read (`streamed`); False
    where none can be claimed so, or the tensor is no 16-bit or fp32 one (`_compare_cast` loads it)."""
    if dtype not in ("BF16", "F16", "F32"):
        return False
    plan, param, size = ranks.plan, job.params.get(name, name), 4 if dtype == "F32" else 2
    source, cast = plan.sources[s], "" if dtype == "F32" else dtype
    problem, row = _differing(plan, job, name, s), job.rows.get(name) or None
    if is_dcp_rank(source.ranks[0]):
        files = source.ranks[0]
        entry = files.metadata.state_dict_metadata.get(f"model.{param}")
        if entry is None or not hasattr(entry, "chunks") or entry.dtype not in ("float32", float_name(dtype)):
            return False
        cast = "" if entry.dtype == float_name(dtype) else cast
        if math.prod(entry.size) * size != b - a:
            ranks.report.add(row, problem)
            return True
        for chunk in entry.chunks:
            info = files.metadata.storage_data[MetadataIndex(f"model.{param}", chunk.offsets)]
            g, located = claimed_chunk(ranks.claims, files.folder, entry, chunk, info)
            first, count = chunk_range(tuple(entry.size), tuple(chunk.offsets), tuple(chunk.sizes), files.folder,
                                       f"model.{param}")
            ranks.file_source[g] = s
            if located.numel != count or located.record.size < count * (4 if cast else size):
                ranks.report.add(row, problem)
                continue
            ranks.claim(Tag("weight", -1, row, problem, s, g), f, a + first * size, count * size, g,
                        located.record.data_offset, cast=cast)
        return True
    if slot is None:  # a frozen parameter or a buffer: what the source's model_states keep of it
        return _claim_kept(ranks, f, name, s, dtype, a, b, problem, row, param)
    if slot.numel * size != b - a:
        ranks.report.add(row, problem)
        return True
    held = {rank: ranks.slices_file(s, files.state_file) for rank, files in enumerate(source.ranks)
            if slot.valid(rank)}
    if None in held.values():  # (one that fails the checks the composition passed: `_compare_cast` says so)
        return False
    for rank, found in held.items():
        valid = slot.valid(rank)
        ranks.claim(Tag("weight", -1, row, problem, s, found.f), f, a + rank * slot.part * size, valid * size,
                    found.f, found.slice(f"{MASTERS}/{param}", valid), cast=cast)
    return True


def _claim_kept(ranks: RankClaims, f: int, name: str, s: int, dtype: str, a: int, b: int, problem: str,
                row: str | None, param: str) -> bool:
    """Tensor `name` of a partial save's model_states (read torch-free: `TorchFile`): a frozen parameter, each
    rank's fragment of it (ZeRO-3 keeps each rank's part, padded), or a buffer, rank 0's; claimed as it is kept or
    cast from fp32 to the file's 16 bits. False where it has none of them that can be claimed so (`_compare_cast`
    loads it)."""
    source, size = ranks.plan.sources[s], SAFETENSORS_ITEMSIZE[dtype]
    states = [ranks.torch_file(s, files.model_states) for files in source.ranks]
    if any(state is None or not isinstance(state.obj, dict) for state in states):
        return False
    shapes = dict(source.layout.frozen)
    if param in shapes:
        parts = [(state, (state.obj.get(FROZEN_PARAM_FRAGMENTS) or {}).get(param)) for state in states]
        numel = math.prod(shapes[param])
    else:
        parts = [(states[0], (states[0].obj.get(MODULE) or {}).get(param))]
        numel = (b - a) // size
    if numel * size != b - a or not all(isinstance(ref, TensorRef) for _state, ref in parts):
        return False
    claims, done = [], 0
    for state, ref in parts:
        try:
            at, length, kept, itemsize = state.place(ref)
        except CheckpointError:  # (a view torch-free reading cannot place: loaded and compared instead)
            return False
        kept = STORAGE_DTYPE.get(kept, kept)
        cast = "" if kept == float_name(dtype) else dtype if kept == "float32" and size == 2 else None
        count = min(length // itemsize, numel - done)
        if cast is None:
            return False
        claims.append((state.f, at, count, cast))
        done += count
    if done != numel:
        ranks.report.add(row, problem)
        return True
    out = a
    for g, at, count, cast in claims:
        if count:
            ranks.claim(Tag("weight", -1, row, problem, s, g), f, out, count * size, g, at, cast=cast)
            out += count * size
    return True


def _compare_cast(ranks: RankClaims, job, out_file: Path, name: str, s: int, sources) -> None:
    """A tensor of a source that saves no 16-bit weights, and has no fp32 master of it (a frozen parameter, a
    buffer) or one in a file laid out so that its elements cannot be claimed: cast by torch, compared at once."""
    from safetensors import SafetensorError, safe_open

    try:
        with open_binary(out_file):  # not a FIFO or a device: safetensors would wait on it
            pass
        got = safe_open(str(out_file), "pt").get_tensor(name)
    except (SafetensorError, OSError) as exc:
        ranks.report.add(None, f"{out_file}: not a readable safetensors file ({str(exc)[:200]})")
        return
    want = sources.tensor(s, name, got)
    if want is None or not same_bytes(got, want):
        _differs(ranks.plan, job, ranks.report, name, s)


def _taken(ranks: RankClaims, job, out_file: Path, name: str, s: int, taken: dict | None, f: int, at: int,
           n: int) -> None:
    """Tensor `name` of a weight file, from source `s` that changed since the composition: its bytes (a
    torch-format file's storage's), at `at` in output file `f`, must have the CRC-32 the composition recorded it
    took."""
    plan = ranks.plan
    if taken is None or name not in taken:
        ranks.report.unproven.append(f"{out_file}: {name} not compared: {plan.sources[s].name} changed since the "
                                     "composition, and the output's provenance record holds no CRC-32 of it")
        return
    row = job.rows.get(name) or None
    ranks.claim(Tag("taken", -1, row, f"{job.name}: {name}{f' (row {row})' if row else ''} differs from what the "
                                      f"composition took from {plan.sources[s].name} (its provenance record)", s,
                    expected=taken[name]), f, at, n)


class _Expected:
    """The tensors an output weight file's tensors must equal, from each source, read as needed."""

    def __init__(self, plan, job, partial: RowsFiles):
        self.plan, self.job, self.partial = plan, job, partial
        self.files: dict[Path, object] = {}  # full sources' safetensors files, opened
        self.states: dict[int, list] = {}  # partial sources: every rank's model_states, loaded
        self.slots: dict[int, dict] = {}  # partial sources: each trainable parameter's slot
        self.dcp = DcpTensors()  # DCP sources' tensors
        self.places: dict[Path, dict] = {}  # full sources' safetensors files: where each tensor lies

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

    def place(self, s: int, name: str) -> tuple[Path, str, tuple, int, int] | None:
        """(file, dtype, shape, first byte, end byte) of tensor `name` in full source `s`'s files (None: none holds
        it), from each file's header (`formats.safetensors_in`, read once)."""
        for path in self.job.weights[s].files if s in self.job.weights else ():
            if path not in self.places:
                self.places[path] = safetensors_tensors(path)
            if name in self.places[path]:
                return (path, *self.places[path][name])
        return None

    def _open(self, path: Path):
        from safetensors import safe_open

        if path not in self.files:
            with open_binary(path):  # not a FIFO or a device: safetensors would wait on it
                pass
            self.files[path] = safe_open(str(path), "pt")
        return self.files[path]

    def slot(self, s: int, param: str):
        """The slot of trainable parameter `param` in source `s`'s layout; None for a frozen parameter or a
        buffer."""
        if s not in self.slots:
            self.slots[s] = {slot.name: slot for slot in self.plan.sources[s].layout.slots}
        return self.slots[s].get(param)

    def _partial(self, s: int, name: str):
        """A partial checkpoint's parameter `name`, flattened: the fp32 master from every rank's
        slice, or a frozen parameter's fragments or a buffer from its ranks' model_states."""
        import torch

        source = self.plan.sources[s]
        if is_dcp_rank(source.ranks[0]):  # a PyTorch Distributed Checkpoint: its `model.<name>`, whole
            return self.dcp.tensor(source.ranks[0], f"model.{name}")
        slot = self.slot(s, name)
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
