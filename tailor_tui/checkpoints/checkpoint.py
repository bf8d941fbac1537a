"""Finding ZeRO-3 checkpoints and describing them from their small metadata.

A checkpoint is named by its folder: an HF Trainer `checkpoint-N` folder (holding
`latest` and the tag folder) or a DeepSpeed tag folder (`save_dir/global_stepN`).
Opening one reads only rank 0's model_states file (memory-mapped); the multi-GB
optim files are only stat()ed here.
"""

from __future__ import annotations

import difflib
import os
from dataclasses import dataclass, field
from pathlib import Path

from tailor_tui.checked.files import FileIdentity, confine, confined
from tailor_tui.checkpoints import scan_cache
from tailor_tui.checkpoints.layout import ZeroLayout
from tailor_tui.checkpoints.model_states import check_version, read_model_states
from tailor_tui.checkpoints.rows import PEFT_PREFIX, Row, RowsByName, find_row, row_index
from tailor_tui.checkpoints.scan_cache import ModelStates
from tailor_tui.checkpoints.side_files import MAX_RECORD, load_json, read_small
from tailor_tui.checkpoints.weight_files import weight_file_names, weight_kinds
from tailor_tui.errors import RECOPY, CheckpointError
from tailor_tui.formats.ds_format import (
    MODEL_STATES,
    OPTIM_STATES,
)
from tailor_tui.formats.ptfile import check_complete
from tailor_tui.formats.safetensors_in import safetensors_header
from tailor_tui.kinds.base import RankFiles, SaveKind
from tailor_tui.kinds.folders import DEEPSPEED, FOLDER_KINDS, HF, MODEL_CONFIG, TRAINER_STATE, FolderKind, folder_kind
from tailor_tui.kinds.partial import (
    PARTIAL_MANIFEST,
    PARTIAL_MODEL_FILES,
    PARTIAL_ROWS,
    PARTIAL_SKELETON,
    PartialRankFiles,
    PartialSave,
)
from tailor_tui.kinds.zero import FULL_SAVE, ZeroRankFiles

MODEL_FILE_INDEX = "model.safetensors.index.json"
PROVENANCE = "tailor_provenance.json"  # in every folder tailor-tui composed: its recipe and sources
OUTPUT_FILES = "files"  # provenance key: every file tailor-tui wrote (relative path -> [bytes, mtime_ns])
# provenance key: what each rank's files took, {rank: {row: {tensor: CRC-32}}}, the CRC-32 of the row's real
# elements of that flat tensor (fp32, exp_avg, exp_avg_sq; "frozen": its frozen parameters' fragments) on that
# rank, its parameters in the output's order (sub-group, then offset), padding left out
TAKEN = "taken"
TAKEN_FROZEN = "frozen"  # the tensor name, in `taken`, of a row's frozen parameters' fragments
# provenance key: what each composed weight file took, {file: {tensor: CRC-32}}: of a safetensors file, the CRC-32
# of each tensor's bytes as written (read from a source's file, the base's kept ones too, or cast from a partial
# save's masters; older records leave the base's out); of a torch-format file, each storage
# taken from a source (its archive's listing, in ARCHIVES, proves the rest)
TAKEN_WEIGHTS = "taken_weights"
# provenance key: each composed safetensors file's header as written, {file: CRC-32 of its 8-byte length and JSON}
WEIGHT_HEADERS = "weight_headers"
# provenance key: what was copied from the base, {path in the output: CRC-32 of its bytes}, each run-level file
# (`latest`, the scheduler, RNG states, trainer_state.json, configs) as it passed through the copy
COPIED = "copied"
# provenance key: each rank file's (and torch-format weight file's) records as written, {path in the output: the
# CRC-32 of its listing}, the listing being, for each record in the archive's order, its name (UTF-8), a zero byte
# and the CRC-32 its directory entry stores (4 bytes, little-endian): one number proves which records, each by
# its own CRC-32
ARCHIVES = "archives"


@dataclass(frozen=True)
class Checkpoint(RowsByName):
    path: Path  # how recipes name it: the HF checkpoint-N folder, or the tag folder
    folder: FolderKind  # the layout of the folder it lies in (`kinds.folders`): HF, ACCELERATE or DEEPSPEED
    tag: str
    tag_dir: Path
    save_dir: Path  # the folder holding `latest` and the recovery scripts
    step: int
    world_size: int
    dtype: str  # "bf16", "fp16" or "fp32"
    layout: ZeroLayout
    rows: tuple[Row, ...]
    ranks: tuple[RankFiles, ...]
    model_files: tuple[Path, ...] = ()  # 16-bit safetensors files of an HF checkpoint
    ds_version: str = ""
    sizes: dict = field(default_factory=dict, compare=False, hash=False)  # file -> bytes
    # file -> its identity when the checkpoint was opened (`checked.files.FileIdentity`): what a composition's
    # tasks check the files they read against (`checked.files.PlannedFiles`)
    identities: dict = field(default_factory=dict, compare=False, hash=False)
    saved: SaveKind = FULL_SAVE  # what it saved, as its kind (`kinds`): every row, or a partial save's
    composed: bool = False  # tailor-tui composed it (it has tailor_provenance.json): not a training save
    weight_files: tuple[str, ...] = ()  # a checkpoint folder's weight files (model, adapter, .bin), relative
    # deleted since an output's composition, which its provenance record names: planned from that record for
    # `--verify` (`planning.provenance.stand_in`), nothing of it read
    gone: bool = False

    @property
    def kind(self) -> str:
        """Its folder's kind by name: "hf" (HF Trainer checkpoint-N), "accelerate" (save_state's checkpoint_N)
        or "deepspeed" (a tag folder of a save_dir)."""
        return self.folder.name

    @property
    def in_folder(self) -> bool:
        """Named by a checkpoint folder that holds the tag folder beside the training loop's other
        files (HF Trainer, Accelerate): composed as a whole folder; else a DeepSpeed tag folder."""
        return self.folder.in_folder

    @property
    def peft(self) -> bool:
        """A PEFT model's checkpoint (its parameters under PEFT's `base_model.model.` prefix)."""
        return any(r.module_path.startswith(PEFT_PREFIX) for r in self.rows)

    def holds(self, row: str) -> bool:
        """Whether this checkpoint saved row `row` (rows without weights of their own: always)."""
        return self.saved.holds(row) or self.row(row).tied

    @property
    def name(self) -> str:
        return self.path.name

    def param_to_row(self) -> dict[str, str]:
        return {p: r.name for r in self.rows for p in (*r.params, *r.buffers)}

    def rank_bytes(self, rank: int) -> int:
        return sum(self.sizes[f] for f in self.ranks[rank].existing())

    def total_bytes(self) -> int:
        return sum(self.sizes.values())

    def check_complete(self) -> None:
        """Every rank file is a whole archive: reads only each zip's central directory,
        so truncated copies are refused before anything is written."""
        for files in self.ranks:
            for f in files.existing():
                if f.suffix == ".safetensors":
                    safetensors_header(f)
                else:
                    check_complete(f)


def distinct_names(paths: list[Path]) -> list[str]:
    """A label per checkpoint folder: its name, or where several share that name (two DeepSpeed
    save_dirs each with a `global_step2`), as many trailing path parts as tell them apart."""
    labels = []
    for path in paths:
        twins = [p for p in paths if p.name == path.name and p != path]
        depth = 1
        while depth < len(path.parts) and any(p.parts[-depth:] == path.parts[-depth:] for p in twins):
            depth += 1
        labels.append(str(Path(*path.parts[-depth:])))
    return labels


def incompatibility(base: Checkpoint, other: Checkpoint, *, repartitioned: bool = False) -> str | None:
    """Why `other` cannot be combined with `base` (a phrase: "it has …"), or None. The one rule
    the planner and the composer both apply. `repartitioned`: the output is resharded, so every
    source is re-partitioned and may have any world size and sub-groups."""
    diff = base.layout.describe_difference(other.layout, repartitioned=repartitioned)
    if diff:
        return f"it has {diff}"
    if other.dtype != base.dtype:
        return f"it was trained in {other.dtype}, the base in {base.dtype}"
    if other.saved.masters_only:  # its rows are refused by the plan where a weight file it lacks needs them
        return None
    if base.model_files and not other.model_files:
        return ("it has no model.safetensors (16-bit weights) while the base has; save it with "
                "stage3_gather_16bit_weights_on_model_save or pick a base without one")
    lacking = sorted(weight_kinds(base.weight_files) - weight_kinds(other.weight_files) - {"model.safetensors"})
    if lacking:
        return f"it has no {lacking[0]} while the base has; pick a base saved the same way"
    return None


def read_latest(folder: Path, *, strict: bool = False, run: Path | None = None) -> str | None:
    """The tag `folder/latest` names; None if there is none, or one that cannot be read (not a
    small regular file: a FIFO, /dev/zero), which is a CheckpointError instead when `strict`.
    `run`: the run folder it lies in; a link on the way that leaves it is a CheckpointError."""
    latest = folder / "latest"
    if not os.path.lexists(latest):
        return None
    try:
        return read_small(latest, 4096, within=run).decode(errors="replace").strip() or None  # a tag's name
    except (OSError, ValueError) as exc:
        if strict:
            raise CheckpointError(f"{latest}: unreadable ({exc}); it names the checkpoint's tag folder, "
                                  f"{RECOPY}") from None
        return None


def is_tag_dir(folder: Path) -> bool:
    return (folder / MODEL_STATES.format(rank=0)).is_file()


MAX_SIBLINGS = 10_000  # folders beside a missing checkpoint looked at for the one meant


def _closest_folder(path: Path) -> str:
    """"did you mean 'checkpoint-6'? " where a folder beside the missing `path` has a close name; else ""."""
    try:
        with os.scandir(path.parent) as entries:
            names = [e.name for _, e in zip(range(MAX_SIBLINGS), entries) if e.is_dir(follow_symlinks=False)]
    except OSError:
        return ""
    close = difflib.get_close_matches(path.name, names, n=1, cutoff=0.8)
    return f"did you mean '{close[0]}'? " if close else ""


def _locate(path: Path) -> tuple[FolderKind, Path, Path, Path]:
    """(kind, named path, tag_dir, save_dir) for whatever folder the user named."""
    if not path.exists():
        raise CheckpointError(f"{path}: no such checkpoint folder; {_closest_folder(path)}check the path")
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a folder; name a checkpoint-N or tag folder")
    if is_tag_dir(path):
        parent = path.parent
        kind = folder_kind(parent, path.name) if read_latest(parent, run=parent) == path.name else None
        if kind is not None:
            return kind, parent, path, parent
        return DEEPSPEED, path, path, parent
    tag = read_latest(path, strict=True, run=path.parent)
    if tag is not None:
        tag_dir = path / tag
        if not is_tag_dir(tag_dir):
            raise CheckpointError(
                f"{path}/latest names tag '{tag}', but {tag_dir} holds no "
                f"{MODEL_STATES.format(rank=0)}; the checkpoint is incomplete"
            )
        kind = folder_kind(path, tag)
        if kind is not None:
            return kind, path, tag_dir, path
        return DEEPSPEED, tag_dir, tag_dir, path
    raise CheckpointError(
        f"{path}: not a DeepSpeed ZeRO-3 checkpoint (no `latest` file and no "
        f"{MODEL_STATES.format(rank=0)}); name a checkpoint-N folder or a tag folder"
    )


def _saved_rows(names, rows: tuple[Row, ...]) -> frozenset:
    """A partial save's rows, by their names now: a save of an earlier tailor-tui recorded the names it
    gave then (a multimodal model's `vision_tower.encoder.layers.3`, now `vision.layers.3`), which find
    their row as a recipe's do (`find_row`: a module path or an unambiguous end of it)."""
    known = {r.name for r in rows}
    found = set()
    for name in names:
        row = find_row(rows, name) if isinstance(name, str) and name not in known else None
        found.add(row.name if row is not None else name)
    return frozenset(found)


def read_manifest(folder: Path) -> dict:
    """A partial checkpoint's manifest, checked."""
    path = folder / PARTIAL_MANIFEST
    try:
        manifest = load_json(path, limit=MAX_RECORD, within=folder.parent)
        if manifest.get("format") != "tailor-partial":
            raise ValueError("not a tailor-partial manifest")
        if manifest.get("version") != 1:
            raise ValueError(f"version {manifest.get('version')}; this tailor-tui reads version 1, upgrade it")
        if manifest.get("layout") not in (HF.name, DEEPSPEED.name):
            raise ValueError(f"unknown layout {manifest.get('layout')!r}")
        manifest["tag"], manifest["rows"], manifest["dtype"]  # noqa: B018 (must be there)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"{path}: unreadable partial-checkpoint manifest ({exc}); re-copy it") from None
    return manifest


def _dtype(tag_dir: Path, states: ModelStates) -> tuple[str, str]:
    """(dtype, optim file prefix): a bf16 run's optim files are named so, else model_states tells."""
    if (tag_dir / OPTIM_STATES.format(prefix="bf16_", rank=0)).is_file():
        return "bf16", "bf16_"
    return states.precision, ""


def hf_model_files(folder: Path) -> tuple[Path, ...]:
    index = folder / MODEL_FILE_INDEX
    if os.path.lexists(index):  # a FIFO or a link to /dev/zero in its place is refused, not passed over
        try:
            weight_map = load_json(index, limit=MAX_RECORD, within=folder.parent)["weight_map"]
            if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
                raise ValueError("its weight_map is not a table of tensor names to file names")
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index}: unreadable index ({exc}); re-copy it") from None
        shards = sorted(set(weight_map.values()))
        _check_shards_beside(index, shards)
        return tuple(folder / f for f in shards)
    single = folder / "model.safetensors"
    return (single,) if single.is_file() else ()


def _check_shards_beside(index: Path, shards: list[str]) -> None:
    """The shards an index names are files beside it, as save_pretrained saves them (an output
    holds them so, one file of each name): two of one name in different folders, or one in another
    folder (absolute, `..`), are refused, naming them."""
    by_name: dict[str, list[str]] = {}
    for shard in shards:
        by_name.setdefault(shard.rsplit("/", 1)[-1], []).append(shard)
    clash = next((named for named in by_name.values() if len(named) > 1), None)
    if clash:
        raise CheckpointError(f"{index}: maps tensors to {len(clash)} shards of one name in different folders "
                              f"({', '.join(map(repr, clash[:3]))}); an output holds one file of each name beside "
                              "its index: give the shards distinct names (or re-copy the checkpoint)")
    elsewhere = [s for s in shards if "/" in s or s in ("", ".", "..") or "\0" in s]
    if elsewhere:
        raise CheckpointError(f"{index}: maps tensors to shard {elsewhere[0]!r}, not a file beside the index; a "
                              "checkpoint's shards lie beside its index (as save_pretrained saves them): move "
                              "them there and name them so in the index (or re-copy the checkpoint)")


def written_by_tailor(named: Path, tag_dir: Path, save_dir: Path, *, record: dict | None = None) -> bool:
    """tailor-tui wrote it: its folder holds a provenance record or, where a checkpoint is a
    DeepSpeed tag folder, the folder holding the tag has one that lists the tag's files (a run
    resumed with that folder as its save_dir adds tags that are its own). `record`: that record as the caller
    read it (a wide run's is megabytes), else read here."""
    if (named / PROVENANCE).is_file():
        return True
    path = save_dir / PROVENANCE
    if named != tag_dir or not path.is_file():
        return False
    try:
        files = (record if record is not None else load_json(path, MAX_RECORD)).get(OUTPUT_FILES)
    except (OSError, ValueError, AttributeError):
        return True  # unreadable: still a folder tailor-tui wrote
    return not isinstance(files, dict) or any(f.startswith(tag_dir.name + "/") for f in files)


def open_checkpoint(path: str | Path, *, cache: Path | None = None, record: dict | None = None) -> Checkpoint:
    """Describe the checkpoint at `path` or raise CheckpointError saying why not. What rank 0's
    model_states file says is taken from `cache` (`scan_cache`) when it holds it; None: read. `record`: the
    provenance record in `path` as the caller read it (`--verify` of an output has), not read again."""
    path = Path(path)
    manifest = read_manifest(path) if os.path.lexists(path / PARTIAL_MANIFEST) else None
    if manifest:  # a partial checkpoint (tailor_tui.selective): its manifest names the tag
        kind, named, tag_dir, save_dir = FOLDER_KINDS[manifest["layout"]], path, path / manifest["tag"], path
    else:
        kind, named, tag_dir, save_dir = _locate(path)
    model_states = tag_dir / MODEL_STATES.format(rank=0)
    run = named.parent  # no link inside the checkpoint leads out of it (`checked.files.confine`)
    for f in (model_states, *(save_dir / n for n in (PROVENANCE, "latest")),
              *(named / n for n in (TRAINER_STATE, MODEL_CONFIG, PARTIAL_MODEL_FILES))):
        confine(f, run)
    states = scan_cache.cached(model_states, read_model_states, cache=cache)
    check_version(model_states, states.ds_version)  # a cached entry too: the releases read may change
    layout = states.layout
    if manifest:
        dtype, prefix = manifest["dtype"], ("bf16_" if manifest["dtype"] == "bf16" else "")
    else:
        dtype, prefix = _dtype(tag_dir, states)
    ranks: tuple[RankFiles, ...] = tuple(
        PartialRankFiles(r, tag_dir / MODEL_STATES.format(rank=r), tag_dir / OPTIM_STATES.format(prefix=prefix, rank=r),
                         tag_dir / PARTIAL_ROWS.format(rank=r), tag_dir / PARTIAL_SKELETON.format(rank=r))
        if manifest else
        ZeroRankFiles(r, tag_dir / MODEL_STATES.format(rank=r), tag_dir / OPTIM_STATES.format(prefix=prefix, rank=r))
        for r in range(layout.world_size)
    )
    sizes: dict[Path, int] = {}
    identities: dict[Path, FileIdentity] = {}
    for files in ranks:
        for f in files.existing():
            try:
                st = confined(f, run) or f.stat()  # (stat again only where it saw nothing: says why)
            except FileNotFoundError:
                raise CheckpointError(
                    f"{f}: missing; the checkpoint {named} was written by "
                    f"{layout.world_size} ranks and is incomplete"
                ) from None
            sizes[f], identities[f] = st.st_size, FileIdentity.of(st)
    model_files = hf_model_files(named) if kind.weights_per_row and not manifest else ()
    for f in model_files:
        confine(f, run)
        if not f.is_file():
            raise CheckpointError(f"{f}: listed in {MODEL_FILE_INDEX} but missing")
        st = f.stat()
        sizes[f], identities[f] = st.st_size, FileIdentity.of(st)
    return Checkpoint(
        path=named,
        folder=kind,
        tag=tag_dir.name,
        tag_dir=tag_dir,
        save_dir=save_dir,
        step=states.step,
        world_size=layout.world_size,
        dtype=dtype,
        layout=layout,
        rows=states.rows,
        ranks=ranks,
        model_files=model_files,
        ds_version=states.ds_version,
        sizes=sizes,
        identities=identities,
        saved=PartialSave(_saved_rows(manifest["rows"], states.rows),
                           path / PARTIAL_MODEL_FILES if (path / PARTIAL_MODEL_FILES).is_file() else None)
        if manifest else FULL_SAVE,
        composed=written_by_tailor(named, tag_dir, save_dir, record=record if save_dir == path else None),
        weight_files=weight_file_names(named, tag_dir) if kind.in_folder and not manifest else (),
    )


def tied_partner(ckpt: Checkpoint, row) -> str:
    """Which row a storage-less row shares its weight with: the row of the parameter DeepSpeed
    recorded it as tied to, else by the usual naming."""
    partner = row_index(ckpt.rows).tied_to(row.name)
    if partner is not None:
        return partner
    for candidate in ckpt.rows:
        if not candidate.tied and ("embed" in candidate.name or candidate.name == "wte"):
            return candidate.name
    return "another row"


def tied_members(ckpt: Checkpoint, row) -> list[tuple[str, str, str]]:
    """(name, the parameter it is tied to, that parameter's row) for each name of a row with
    weights of its own that is tied to another row's parameter (BERT's cls.predictions.decoder)."""
    if row.tied:
        return []
    index = row_index(ckpt.rows)
    return [(alias, target, owner) for alias, target in row.aliases
            if (owner := index.row_of(target)) is not None and owner != row.name]
