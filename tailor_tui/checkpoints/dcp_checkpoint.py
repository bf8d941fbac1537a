"""A PyTorch Distributed Checkpoint (FSDP2's `dcp.save` of `get_state_dict(model, optimizer)`: torchtitan's
`step-N`, or any folder holding `.metadata`) as tailor-tui composes it: its tensors, its rows, and which of
its files hold what.

Its keys are those of the state dict as saved: `model.<name>` (every tensor of the model), `optim.state.
<name>.<key>` (a trainable parameter's optimizer state), `optim.param_groups.<i>.<key>`. A parameter is
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
from tailor_tui.checkpoints.rows import Row, model_rows
from tailor_tui.dcp.metadata import METADATA, Metadata, MetadataIndex, TensorStorageMetadata
from tailor_tui.dcp.reading import archive_records, read_metadata
from tailor_tui.errors import CheckpointError

MODEL, OPTIM_STATE, STEP = "model.", "optim.state.", "step"
_STEP = re.compile(r"(?:step|checkpoint)[-_](\d+)")


@dataclass(frozen=True)
class DcpCheckpoint:
    path: Path
    metadata: Metadata
    rows: tuple[Row, ...]
    trainable: frozenset[str]  # parameters the optimizer keeps state for
    step: int | None  # from its folder's name (`step-N`, `checkpoint-N`); None: not named so
    identities: dict[Path, FileIdentity] = field(compare=False, hash=False)  # each file, as opened

    @property
    def name(self) -> str:
        return self.path.name

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
            name = _tensor_name(key)
            if name is not None and name in owner:
                found[key] = owner[name]
        return found


def is_dcp(path: Path) -> bool:
    """Whether `path` is a DCP checkpoint's folder (it holds `.metadata`)."""
    return (path / METADATA).is_file()


def _tensor_name(key: str) -> str | None:
    """The model tensor a key is of (`model.X` -> X; `optim.state.X.k` -> X), else None."""
    if key.startswith(MODEL):
        return key[len(MODEL):]
    if key.startswith(OPTIM_STATE):
        return key[len(OPTIM_STATE):].rpartition(".")[0] or None
    return None


def open_dcp(path: Path) -> DcpCheckpoint:
    """The DCP checkpoint at `path` (CheckpointError naming what is wrong with it)."""
    metadata = read_metadata(path)
    entries = metadata.state_dict_metadata
    model = [key[len(MODEL):] for key in entries if key.startswith(MODEL)]
    if not model:
        raise CheckpointError(f"{path}: a PyTorch Distributed Checkpoint without `model.` tensors; tailor-tui "
                              "composes checkpoints saved as dcp.save({'model': …, 'optim': …})")
    state_of = {key[len(OPTIM_STATE):].rpartition(".")[0] for key in entries if key.startswith(OPTIM_STATE)}
    trainable = frozenset(name for name in model if name in state_of)
    identities: dict[Path, FileIdentity] = {}
    for info in metadata.storage_data.values():
        file = path / info.relative_path
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
    return DcpCheckpoint(path, metadata, rows, trainable, int(found.group(1)) if found else None, identities)


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


def _kind(entry: TensorStorageMetadata) -> tuple:
    return entry.dtype, entry.size, tuple(c.offsets for c in entry.chunks)


MAX_CHECKPOINTS = 10_000  # folders of a run looked at


def scan_dcp(run_dir: Path) -> list[DcpCheckpoint]:
    """The DCP checkpoints of a run folder, oldest first (by the step their folders' names say, then by name): the
    folder itself where it holds `.metadata`, else each folder in it that does; tailor-tui's own outputs (they
    hold its provenance record) are not training saves. [] where it holds none. The checkpoints must be of
    one model (CheckpointError naming the first that is not)."""
    from tailor_tui.checkpoints.checkpoint import PROVENANCE

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
