"""A PyTorch Distributed Checkpoint (FSDP2's `dcp.save` of `get_state_dict(model, optimizer)`) as tailor-tui
composes it: its tensors, its rows, and which of its files hold what.

It lies in one folder holding `.metadata` (torchtitan's `step-N`, or any), or in the two the HF Trainer's
FSDP checkpoints hold inside `checkpoint-N` (Accelerate's `save_fsdp_model` and `save_fsdp_optimizer`):
`pytorch_model_fsdp_0/` and `optimizer_0/`, each a DCP checkpoint of its own, beside the Trainer's run-level
files. Its parts (`parts`) are read as one: their entries side by side, each archive's file named from the
checkpoint's folder (`optimizer_0/__0_0.distcp`).

Its keys are those of the state dict as saved: `model.<name>` (every tensor of the model), `optim.state.
<name>.<key>` (a trainable parameter's optimizer state; `optimizer.` in the HF Trainer's),
`optim.param_groups.<i>.<key>`. A parameter is
trainable where the optimizer keeps state for it; every other model tensor (a frozen parameter, a buffer)
belongs to its module's row as well. A tied name (a tied `lm_head`) is saved again under its own key, with
no optimizer state: it is told by its bytes, which are its parameter's chunk for chunk (the CRC-32s its
archives store), and follows that parameter's row. Rows come by the rule every checkpoint's do
(`rows.model_rows`). Torch-free.
"""

from __future__ import annotations

import contextlib
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from tailor_tui.checked.files import FileIdentity, open_regular
from tailor_tui.checkpoints.checkpoint import PROVENANCE, Checkpoint
from tailor_tui.checkpoints.layout import ZeroLayout
from tailor_tui.checkpoints.rows import Row, RowsByName, model_rows
from tailor_tui.dcp.metadata import (
    METADATA,
    Metadata,
    MetadataIndex,
    StorageInfo,
    StorageMeta,
    TensorStorageMetadata,
)
from tailor_tui.dcp.reading import archive_records, read_metadata
from tailor_tui.errors import CheckpointError
from tailor_tui.kinds.dcp_rows import DcpRankFiles, DcpSave
from tailor_tui.kinds.folders import DCP, TRAINER_DCP, FolderKind

MODEL, STEP = "model.", "step"
OPTIM, HF_OPTIM = "optim.", "optimizer."  # the optimizer's keys: `dcp.save({"optim": …})`'s, the HF Trainer's
# the HF Trainer's FSDP checkpoint: the model's DCP folder and the optimizer's (Accelerate's FSDP_MODEL_NAME_0,
# OPTIMIZER_NAME_0), inside checkpoint-N
HF_MODEL_PART, HF_OPTIM_PART = "pytorch_model_fsdp_0", "optimizer_0"
_STEP = re.compile(r"(?:step|checkpoint)[-_](\d+)")
DCP_SAVE = DcpSave()


@dataclass(frozen=True)
class DcpCheckpoint(RowsByName):
    path: Path
    metadata: Metadata
    rows: tuple[Row, ...]
    trainable: frozenset[str]  # parameters the optimizer keeps state for
    step: int | None  # from its folder's name (`step-N`, `checkpoint-N`); None: not named so
    identities: dict[Path, FileIdentity] = field(compare=False, hash=False)  # each file, as opened
    # its DCP folders, relative to `path`: ("",) for one folder holding `.metadata`; the HF Trainer's
    # (HF_MODEL_PART, HF_OPTIM_PART); the first holds the model's keys, the second (if any) the optimizer's
    parts: tuple[str, ...] = ("",)

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def folder(self) -> FolderKind:
        """Its folder's layout: one DCP folder, or the HF Trainer's FSDP checkpoint."""
        return DCP if self.parts == ("",) else TRAINER_DCP

    def holds(self, row: str) -> bool:
        """Every DCP checkpoint holds every row (a tied row: its parameter's)."""
        return True

    def distcp_files(self) -> list[Path]:
        """The files its archives lie in (its `.metadata` files aside)."""
        return [p for p in self.identities if p.name != METADATA]

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """{name: shape} of every model tensor it holds."""
        return {key[len(MODEL):]: entry.size for key, entry in self.metadata.state_dict_metadata.items()
                if key.startswith(MODEL) and isinstance(entry, TensorStorageMetadata)}

    def total_bytes(self) -> int:
        """The bytes of its archives."""
        return sum(info.length for info in self.metadata.storage_data.values())

    def describe(self) -> str:
        """Its layout in a few words, for the composer's details: the files, the most chunks a tensor has (the
        world size it was saved at, as FSDP2 shards), the dtype of its weights."""
        entries = [e for k, e in self.metadata.state_dict_metadata.items()
                   if k.startswith(MODEL) and isinstance(e, TensorStorageMetadata)]
        chunks = max((len(e.chunks) for e in entries), default=0)
        dtypes = sorted({e.dtype for e in entries})
        return (f"{self.folder.label}, {len(self.distcp_files())} .distcp file(s), tensors in up to {chunks} chunk(s), "
                f"{'/'.join(dtypes) or 'no tensors'}")

    @property
    def optim(self) -> str:
        """The first part of its optimizer's keys: "optim." (`dcp.save({"optim": …})`), "optimizer." (the HF
        Trainer's)."""
        return OPTIM if self.parts == ("",) else HF_OPTIM

    def part_of(self, key: str) -> str:
        """The DCP folder (one of `parts`) holding the entry `key`."""
        return self.parts[0] if len(self.parts) == 1 or key.startswith(MODEL) else self.parts[1]

    def run_files(self) -> tuple[str, ...]:
        """Its files beside its DCP folders (the HF Trainer's run-level files: trainer_state.json, scheduler.pt,
        rng_state_R.pth, training_args.bin), relative to `path`; () for a checkpoint in one folder."""
        return () if self.parts == ("",) else _run_files(self.path)

    # what the output checks (`planning.output.check_output`) ask of a source
    @property
    def tag_dir(self) -> Path:
        return self.path

    @property
    def save_dir(self) -> Path:
        return self.path.parent

    in_folder = True

    def row_of_key(self) -> dict[str, str]:
        """{state-dict key: the row it belongs to} for every key of a model tensor or a parameter's optimizer state
        (a tied name's: its parameter's row); param groups belong to none."""
        owner = {p: row.name for row in self.rows for p in (*row.params, *row.buffers)}
        owner |= {alias: owner[target] for row in self.rows for alias, target in row.aliases if target in owner}
        found = {}
        for key in self.metadata.state_dict_metadata:
            name = _tensor_name(key, self.optim)
            if name is not None and name in owner:
                found[key] = owner[name]
        return found


def dcp_parts(path: Path) -> tuple[str, ...] | None:
    """The DCP folders of the checkpoint `path` (`DcpCheckpoint.parts`), None where it is not one."""
    if (path / METADATA).is_file():
        return ("",)
    if (path / HF_MODEL_PART / METADATA).is_file():
        return (HF_MODEL_PART, HF_OPTIM_PART) if (path / HF_OPTIM_PART / METADATA).is_file() else (HF_MODEL_PART,)
    return None


def is_dcp(path: Path) -> bool:
    """Whether `path` is a DCP checkpoint's folder (it holds `.metadata`, or the HF Trainer's FSDP folders)."""
    return dcp_parts(path) is not None


def _tensor_name(key: str, optim: str) -> str | None:
    """The model tensor a key is of (`model.X` -> X; `optim.state.X.k` -> X), else None."""
    if key.startswith(MODEL):
        return key[len(MODEL):]
    if key.startswith(optim + "state."):
        return key[len(optim) + len("state."):].rpartition(".")[0] or None
    return None


MAX_RUN_FILES = 10_000  # files beside the HF Trainer's DCP folders looked at


def _run_files(path: Path) -> tuple[str, ...]:
    try:
        with os.scandir(path) as found:
            names = [e.name for _, e in zip(range(MAX_RUN_FILES), found) if e.is_file(follow_symlinks=False)]
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot be listed ({exc.strerror or exc})") from None
    return tuple(sorted(n for n in names if n != PROVENANCE))


def read_parts(path: Path, parts: tuple[str, ...]) -> Metadata:
    """The `.metadata` of each of the checkpoint's DCP folders `parts`, read as one: every entry, and each
    archive's file named from `path`. The HF Trainer's model folder holds `model.` keys only, its optimizer's
    `optimizer.` keys only (CheckpointError naming the first that does not)."""
    if parts == ("",):
        return read_metadata(path)
    entries: dict = {}
    planner: dict = {}
    storage: dict = {}
    for part, prefix in zip(parts, (MODEL, HF_OPTIM)):
        found = read_metadata(path / part)
        stray = next((k for k in found.state_dict_metadata if not k.startswith(prefix)), None)
        if stray is not None:
            raise CheckpointError(f"{path / part}: holds {stray[:80]}, not a `{prefix}` key as the HF Trainer's "
                                  f"{part} does; tailor-tui does not know this layout")
        entries |= found.state_dict_metadata
        planner |= {k: v for k, v in found.planner_data.items() if k in found.state_dict_metadata}
        storage |= {index: StorageInfo(f"{part}/{info.relative_path}", info.offset, info.length)
                    for index, info in found.storage_data.items()}
    return Metadata(entries, planner, storage, StorageMeta(str(path)))


def part_metadata(metadata: Metadata, part: str, checkpoint_id: str) -> Metadata:
    """The `.metadata` of DCP folder `part` (`DcpCheckpoint.parts`) of a checkpoint whose parts read as one are
    `metadata`: its entries, each archive's file named from that folder."""
    if not part:
        return Metadata(metadata.state_dict_metadata, metadata.planner_data, metadata.storage_data,
                        StorageMeta(checkpoint_id))
    prefix = part + "/"
    storage = {index: StorageInfo(info.relative_path[len(prefix):], info.offset, info.length)
               for index, info in metadata.storage_data.items() if info.relative_path.startswith(prefix)}
    keys = {index.fqn for index in storage}
    return Metadata({k: e for k, e in metadata.state_dict_metadata.items() if k in keys},
                    {k: v for k, v in metadata.planner_data.items() if k in keys}, storage, StorageMeta(checkpoint_id))


def open_dcp(path: Path) -> DcpCheckpoint:
    """The DCP checkpoint at `path` (CheckpointError naming what is wrong with it)."""
    parts = dcp_parts(path) or ("",)  # (not one: read_metadata says what is missing)
    metadata = read_parts(path, parts)
    optim = OPTIM if parts == ("",) else HF_OPTIM
    entries = metadata.state_dict_metadata
    model = [key[len(MODEL):] for key in entries if key.startswith(MODEL)]
    if not model:
        raise CheckpointError(f"{path}: a PyTorch Distributed Checkpoint without `model.` tensors; tailor-tui "
                              "composes checkpoints saved as dcp.save({'model': …, 'optim': …})")
    state = optim + "state."
    state_of = {key[len(state):].rpartition(".")[0] for key in entries if key.startswith(state)}
    trainable = frozenset(name for name in model if name in state_of)
    identities: dict[Path, FileIdentity] = {}
    files = [path / part / METADATA for part in parts] + [path / info.relative_path
                                                          for info in metadata.storage_data.values()]
    for file in files:
        if file not in identities:
            try:
                fd = open_regular(file, follow=False)
            except OSError as exc:
                raise CheckpointError(f"{file}: cannot be read ({exc.strerror or exc}); the checkpoint is "
                                      "incomplete") from None
            identities[file] = FileIdentity.of(os.fstat(fd))
            os.close(fd)
    aliases = _tied(path, metadata, [n for n in model if n not in trainable], trainable)
    rows = model_rows([n for n in model if n not in aliases], (), aliases, order=model)
    found = _STEP.fullmatch(path.name)
    return DcpCheckpoint(path, metadata, rows, trainable, int(found.group(1)) if found else None, identities, parts)


def _tied(path: Path, metadata: Metadata, others: list[str], trainable: frozenset[str]) -> dict[str, str]:
    """{name: the trainable parameter it is tied to} of the model tensors without optimizer state whose chunks
    are a trainable parameter's, byte for byte as their archives' CRC-32s say."""
    entries = metadata.state_dict_metadata
    by_kind: dict[tuple, list[str]] = {}
    for name in sorted(trainable):
        entry = entries[MODEL + name]
        if isinstance(entry, TensorStorageMetadata):
            by_kind.setdefault(_kind(entry), []).append(name)
    found = {}
    with contextlib.ExitStack() as stack:
        opened: dict[str, int] = {}
        known: dict[str, tuple[int, ...]] = {}

        def crcs(name: str) -> tuple[int, ...]:
            if name in known:
                return known[name]
            entry = entries[MODEL + name]
            assert isinstance(entry, TensorStorageMetadata)
            values: list[int] = []
            for chunk in entry.chunks:
                info = metadata.storage_data[MetadataIndex(MODEL + name, chunk.offsets)]
                if info.relative_path not in opened:
                    opened[info.relative_path] = fd = open_regular(path / info.relative_path, follow=False)
                    stack.callback(os.close, fd)
                records = archive_records(path, opened[info.relative_path], info, f"the chunk of {MODEL + name}")
                values.append(records["data/0"].crc or 0 if "data/0" in records else -1)
            known[name] = tuple(values)
            return known[name]

        for name in others:
            entry = entries[MODEL + name]
            if not isinstance(entry, TensorStorageMetadata):
                continue
            candidates = by_kind.get(_kind(entry), [])
            if candidates:
                mine = crcs(name)
                partner = next((t for t in candidates if crcs(t) == mine), None)
                if partner is not None:
                    found[name] = partner
    return found


def translated(key: str, base: DcpCheckpoint, source) -> str:
    """The base's `key` as checkpoint `source` names it: an optimizer's key under its own first part (`optim.`,
    `optimizer.`); a ZeRO-3 source's rows are written under the base's names."""
    if not isinstance(source, DcpCheckpoint):
        return key
    return source.optim + key[len(base.optim):] if key.startswith(base.optim) else key


def dcp_incompatibility(base: DcpCheckpoint, other) -> str | None:
    """Why checkpoint `other` cannot give rows to a composition on the DCP checkpoint `base` (a phrase: "it has
    …"), or None: the one rule of the composer and the plan. It must be a DCP checkpoint (of either layout) of the
    same model: every model tensor and every trainable parameter's optimizer state of the same size and dtype."""
    if not isinstance(other, DcpCheckpoint):
        return ("it is a DeepSpeed ZeRO-3 checkpoint and the base a PyTorch Distributed Checkpoint: a recipe takes "
                "its rows (--apply), the composer shows one format's checkpoints")
    mine, theirs = base.metadata.state_dict_metadata, other.metadata.state_dict_metadata
    for key, entry in mine.items():
        if not key.startswith(MODEL) and not key.startswith(base.optim + "state."):
            continue
        named = translated(key, base, other)
        found = theirs.get(named)
        if found is None:
            return f"it has no {named}, which the base has: another model, or another optimizer's state"
        if isinstance(entry, TensorStorageMetadata) != isinstance(found, TensorStorageMetadata) or (
                isinstance(entry, TensorStorageMetadata) and isinstance(found, TensorStorageMetadata)
                and (entry.size, entry.dtype) != (found.size, found.dtype)):
            return f"it has {named} as {_said(found)}, the base {_said(entry)}: another model"
    return None


def _said(entry) -> str:
    return f"{list(entry.size)} {entry.dtype}" if isinstance(entry, TensorStorageMetadata) else "a value"


def _kind(entry: TensorStorageMetadata) -> tuple:
    return entry.dtype, entry.size, tuple(c.offsets for c in entry.chunks)


def zero_source(dcp: DcpCheckpoint, base: Checkpoint) -> Checkpoint:
    """`dcp` as a source of rows of a ZeRO-3 composition on `base` (`kinds.dcp_rows`): a checkpoint of one rank
    holding every trainable parameter whole, in `base`'s order, by the shapes `dcp` saved them in (another model's
    differ: `checkpoint.incompatibility` says how), its frozen parameters those of `base`'s it holds, its rows
    `base`'s; its fp32 masters and per-element state read chunk by chunk."""
    entries = dcp.metadata.state_dict_metadata
    shapes = {key[len(MODEL):]: tuple(e.size) for key, e in entries.items()
              if key.startswith(MODEL) and isinstance(e, TensorStorageMetadata)}
    order = [slot.name for slot in base.layout.slots]
    trainable = [n for n in order if n in dcp.trainable] + sorted(n for n in dcp.trainable if n not in order)
    frozen = tuple((n, shapes[n]) for n, _shape in base.layout.frozen if n in shapes and n not in dcp.trainable)
    layout = ZeroLayout(1, (tuple((n, shapes[n]) for n in trainable),), frozen)
    files = DcpRankFiles(0, dcp.path / dcp.parts[0] / METADATA, dcp.path / dcp.parts[-1] / METADATA, folder=dcp.path,
                         metadata=dcp.metadata, optim=dcp.optim, identities=dict(dcp.identities))
    return Checkpoint(dcp.path, dcp.folder, "", dcp.path, dcp.path.parent, dcp.step or 0, 1, base.dtype, layout,
                      base.rows, (files,), sizes={p: i.size for p, i in dcp.identities.items()},
                      identities=dict(dcp.identities), saved=DCP_SAVE)


MAX_CHECKPOINTS = 10_000  # folders of a run looked at


def scan_dcp(run_dir: Path) -> list[DcpCheckpoint]:
    """The DCP checkpoints of a run folder, oldest first (by the step their folders' names say, then by name): the
    folder itself where it holds `.metadata`, else each folder in it that does; tailor-tui's own outputs (they
    hold its provenance record) are not training saves. [] where it holds none. The checkpoints must be of
    one model (CheckpointError naming the first that is not)."""
    if is_dcp(run_dir):
        return [open_dcp(run_dir)]
    try:
        folders = sorted(p for p in run_dir.iterdir() if p.is_dir() and not p.is_symlink())[:MAX_CHECKPOINTS]
    except OSError:
        return []
    found = [open_dcp(p) for p in folders if is_dcp(p) and not (p / PROVENANCE).exists()]
    found.sort(key=lambda c: (c.step is None, c.step or 0, c.name))
    if found:
        rows = [r.name for r in found[-1].rows]
        for ckpt in found:
            if [r.name for r in ckpt.rows] != rows:
                raise CheckpointError(f"{ckpt.path}: its rows are not those of {found[-1].path}; a run folder holds "
                                      "the checkpoints of one model: open each run on its own")
    return found
