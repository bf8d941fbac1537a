"""A recipe whose base is a PyTorch Distributed Checkpoint, planned: which archive of which source goes
where in the output (`plan_dcp`), decided once.

Every key of the base's state dict is in the output: a key of a row's tensors (`model.<name>`, a
parameter's optimizer state but its `step`) from the checkpoint picked for its row; every other (the
param groups, each parameter's `step`: the base's, as in ZeRO-3 compositions) from the base. A key's
entry (its chunks) is its source's, so sources saved at other world sizes mix: DCP loads any chunking; and
sources of either layout (one folder, or the HF Trainer's two) mix: a source's optimizer keys are read under
its own first part (`optim.`, `optimizer.`), written under the base's. Each of its archives (a chunk, a value
saved as bytes) is copied byte for byte into an output file of its source file's name (`__N_0.distcp`; one
of another source: `__tailor_S_N_0.distcp`) in the base's folder for that key, the archives of one file in
their order there; each folder's `.metadata` says where each now lies. The base's files beside its DCP
folders (the HF Trainer's run-level files) are copied. Torch-free.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from tailor_tui import __version__
from tailor_tui.checkpoints.checkpoint import Checkpoint, open_checkpoint
from tailor_tui.checkpoints.dcp_checkpoint import (
    MODEL,
    STEP,
    DcpCheckpoint,
    dcp_incompatibility,
    is_dcp,
    open_dcp,
    translated,
)
from tailor_tui.checkpoints.weight_files import describe_run_level
from tailor_tui.dcp.metadata import Metadata, MetadataIndex, StorageInfo, StorageMeta, TensorStorageMetadata
from tailor_tui.dcp.reading import read_value
from tailor_tui.errors import CheckpointError, IncompatibleError, RecipeError
from tailor_tui.events import JobCost
from tailor_tui.formats.ds_format import OPTIMIZER_STATE_DICT, PARAM_GROUPS, STATE, describe_state
from tailor_tui.formats.ptfile import read_structure
from tailor_tui.kinds.base import rank_reader
from tailor_tui.kinds.dcp_rows import DcpRankFiles
from tailor_tui.planning.dcp_layout import MODEL as LAYOUT_MODEL
from tailor_tui.planning.dcp_layout import DcpJob, Entries, ModelShapes, rank_job
from tailor_tui.planning.output import check_output, default_output, recipe_output
from tailor_tui.planning.recipe import Recipe

MAX_COMPARED = 256  # param group values compared between a source and the base


@dataclass(frozen=True)
class Copy:
    """One archive: `length` bytes from byte `at` of the source file to byte `to` of the output file; `key` the
    entry it holds in the source (a chunk of it, or its value), `chunk` its offsets (None: a value)."""

    key: str
    chunk: tuple[int, ...] | None
    at: int
    length: int
    to: int


@dataclass(frozen=True)
class DcpFileJob(JobCost):
    """One output file: the archives copied into it from one source file (picklable)."""

    task: str
    source: Path  # the source checkpoint's folder
    source_file: str
    out_file: str
    copies: tuple[Copy, ...]
    entries: tuple[tuple[str, TensorStorageMetadata | None], ...]  # each key's entry (None: a value)
    rows: tuple[tuple[str, str], ...]  # (source key, its row) of the keys a row holds, for what is said of them
    in_place: bool  # a base file: each archive where it lies there (the output file may start as its clone)
    allow_nonfinite: bool  # copy a chunk holding NaN/Inf (else the composition is refused: nothing published)
    read_bytes: int
    write_bytes: int

    def files_read(self) -> tuple[Path, ...]:
        return (self.source / self.source_file,)


@dataclass(frozen=True)
class DcpComposePlan:
    recipe: Recipe
    base: DcpCheckpoint
    sources: tuple[DcpCheckpoint | Checkpoint, ...]  # sources[0] is the base; a ZeRO-3 checkpoint gives rows too
    picks: dict[str, int]  # every non-tied row -> index into sources
    output: Path
    force: bool
    jobs: tuple[DcpFileJob | DcpJob, ...]  # archives copied from a DCP source; a ZeRO-3 source's rows, rank by rank
    metadata: Metadata
    taken: dict[str, int]  # every key of the output -> the index of the source it is taken from
    warnings: tuple[str, ...] = ()
    copied: tuple[str, ...] = ()  # the base's run-level files (`DcpCheckpoint.run_files`), copied as they are

    def source_key(self, key: str) -> str:
        """The key of the source `taken[key]` holding the output's `key` (its optimizer's keys under its own
        first part)."""
        return translated(key, self.base, self.sources[self.taken[key]])

    def bytes_to_write(self) -> int:
        return sum(job.write_bytes for job in self.jobs)

    def identities_of(self, paths) -> dict:
        known = {p: i for s in self.sources for p, i in s.identities.items()}
        return {p: known[p] for p in paths}

    def describe(self, show=str, every_file: bool = True) -> list[str]:
        """The plan in lines (`show`: how a path is written; `every_file`: the copied files named, else counted)."""
        width = max(len(r.name) for r in self.base.rows)
        lines = [f"output: {show(self.output)} (a PyTorch Distributed Checkpoint, as its base)"]
        for row in self.base.rows:
            source = "tied to its parameter's row" if row.tied else self.sources[self.picks[row.name]].name
            lines.append(f"  {row.name:<{width}}  {source}")
        copies = [job for job in self.jobs if isinstance(job, DcpFileJob)]
        lines.append(f"{len(copies)} file(s), {sum(j.write_bytes for j in copies):,} bytes, copied archive by archive "
                     "(each checked against its CRC-32s); the param groups and every step count: the base's")
        if len(copies) < len(self.jobs):
            rows = [job for job in self.jobs if not isinstance(job, DcpFileJob)]
            lines.append(f"{len(rows)} file(s), {sum(j.write_bytes for j in rows):,} bytes, of rows from ZeRO-3 "
                         "checkpoints: each rank's fp32 masters and per-element state chunk by chunk (their records "
                         "checked against their CRC-32s)")
        if self.copied:
            named = ", ".join(self.copied) if every_file else f"{len(self.copied)} run-level file(s)"
            lines.append(f"copied from the base: {named}")
            lines += [f"  {name}: {why}" for name in self.copied
                      if "not known" in (why := describe_run_level(Path(name)))]
        return lines + [f"warning: {w}" for w in self.warnings]


def dcp_provenance(plan: DcpComposePlan) -> dict:
    """The provenance record of an output of `plan` (a DCP composition, or its HF export): the recipe, each row's
    source, the checkpoints read."""
    rows = {row.name: (f"tied to {row.aliases[0][1]}" if row.tied else str(plan.sources[plan.picks[row.name]].path))
            for row in plan.base.rows}
    return {"tool": f"tailor-tui {__version__}", "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "recipe": plan.recipe.to_yaml(),
            "recipe_file": str(plan.recipe.source_file.resolve()) if plan.recipe.source_file else None,
            "rows": rows, "base": str(plan.base.path.resolve()),
            "sources": [str(s.path.resolve()) for s in plan.sources[1:]]}


def plan_dcp(recipe: Recipe, *, output: Path | None = None, force: bool = False, preview: bool = False,
             allow_nonfinite: bool = False, check: bool = True) -> DcpComposePlan:
    """The plan of `recipe` (its base a DCP checkpoint); a TailorError naming the first problem. `check=False`:
    the output is not checked to be writable (`--verify` of one written)."""
    base = open_dcp(recipe.base)
    paths = [recipe.base.resolve()]
    sources: list[DcpCheckpoint | Checkpoint] = [base]
    picks = {row.name: 0 for row in base.rows if not row.tied}
    for written, path in recipe.layers.items():
        row = base.recipe_row(written, recipe.location(written))
        if row.tied:
            raise RecipeError(f"{recipe.location(written)}: {row.name} has no weights of its own (it is tied to "
                              f"{row.aliases[0][1]}); pick that parameter's row")
        if path.resolve() not in paths:
            paths.append(path.resolve())
            sources.append(open_dcp(path) if is_dcp(path) or not path.is_dir()
                           else _open_zero(base, path, recipe.location(written)))
        picks[row.name] = paths.index(path.resolve())
    out = Path(output) if output is not None else recipe_output(recipe, written=not check) or default_output(recipe.base)
    warnings = []
    note = check_output(out, sources, force, preview=preview) if check else None
    if note:
        warnings.append(note)
    owner = base.row_of_key()
    entries = base.metadata.state_dict_metadata
    from_source: dict[str, int] = {}
    for key in entries:
        holder = owner.get(key)  # (a parameter's step: the base's, with the param groups)
        from_source[key] = 0 if holder is None or key.endswith("." + STEP) and not key.startswith("model.") \
            else picks.get(holder, 0)
    for s, src in enumerate(sources[1:], start=1):
        rows = [row for row, i in picks.items() if i == s]
        if isinstance(src, Checkpoint):  # rows from a ZeRO-3 checkpoint: written as a DCP export writes them
            _check_zero_rows(base, src, rows)
            warnings += _zero_source_differences(base, src, [p for row in rows for p in base.row(row).params])
            continue
        if (why := dcp_incompatibility(base, src)) is not None:
            raise IncompatibleError(f"{src.path}: cannot be combined with the base {base.path}: {why}")
        warnings += _differences(base, src)
    dcp_sources = [src if isinstance(src, DcpCheckpoint) else None for src in sources]
    jobs, storage = _jobs(base, dcp_sources, from_source, owner, allow_nonfinite)
    chosen = {key: src.metadata.state_dict_metadata[translated(key, base, src)] for key, s in from_source.items()
              if isinstance(src := sources[s], DcpCheckpoint)}
    laid = _zero_rows(base, sources, picks, out)
    for s, (rank_jobs, found) in laid.items():
        jobs += rank_jobs
        for key, s_key in from_source.items():
            if s_key == s:
                if key not in found.state_dict_metadata:
                    raise IncompatibleError(f"{sources[s].path}: holds nothing for {key}, which the base "
                                            f"{base.path} has; it is another model, or another optimizer's state")
                chosen[key] = found.state_dict_metadata[key]
        storage |= found.storage_data
    metadata = Metadata({key: chosen[key] for key in entries}, dict(base.metadata.planner_data), storage,
                        StorageMeta(str(out)))
    return DcpComposePlan(recipe, base, tuple(sources), picks, out, force, tuple(jobs), metadata, from_source,
                          tuple(warnings), base.run_files())


def _differences(base: DcpCheckpoint, src: DcpCheckpoint) -> list[str]:
    """What differs between the runs of two checkpoints that a composition keeps the base's of: the param
    groups' keys, and the step (by their folders' names)."""
    said = []
    groups = {k for k in base.metadata.state_dict_metadata if k.startswith(base.optim + "param_groups.")}
    theirs = {translated(k, src, base) for k in src.metadata.state_dict_metadata
              if k.startswith(src.optim + "param_groups.")}
    if groups != theirs:
        said.append(f"{src.name}'s param groups are not the base's ({len(theirs)} entries, the base {len(groups)}); "
                    "the base's are kept")
    else:
        differ = {}
        for key in sorted(k for k in groups if not k.endswith(".params"))[:MAX_COMPARED]:
            mine = read_value(base.path, base.metadata, key)
            other = read_value(src.path, src.metadata, translated(key, base, src))
            if mine != other:
                differ[key.removeprefix(base.optim + "param_groups.")] = (other, mine)
        said += _hyperparameters_said(src.name, differ)
    return said + step_said(src.name, src.step, base.step)


def step_said(name: str, step: int | None, base_step: int | None) -> list[str]:
    """What is said of rows taken from a save of another step than the base's (nothing where either is unknown)."""
    if step is None or base_step is None or step == base_step:
        return []
    return [f"rows from {name} (step {step}) keep their weights and moments with the base's step count "
            f"({base_step}), as AdamW's bias correction then reads them"]


COMPARED = ("lr", "betas", "eps", "weight_decay")  # the hyperparameters compared between a ZeRO-3 base and a DCP source


def zero_base_differences(base: Checkpoint, src: Checkpoint, params: list[str], step: int | None) -> list[str]:
    """What differs between a ZeRO-3 base's run and the PyTorch Distributed Checkpoint `src` (read as a ZeRO-3 source,
    `kinds.dcp_rows`; saved at `step`) giving the output `params`: the hyperparameters (COMPARED) of the param group
    holding each in `src` against those of the base's sub-group holding it, and the step. The base's are kept."""
    files = src.ranks[0]
    assert isinstance(files, DcpRankFiles) and files.metadata is not None, "a DCP checkpoint's rank"
    differ = _hyperparameters(files.folder, files.metadata, files.optim, base, params)
    return _hyperparameters_said(src.name, differ) + step_said(src.name, step, base.step)


def _zero_source_differences(base: DcpCheckpoint, src: Checkpoint, params: list[str]) -> list[str]:
    """`zero_base_differences` the other way: a ZeRO-3 checkpoint giving a DCP base `params`."""
    found = _hyperparameters(base.path, base.metadata, base.optim, src, params)  # (the base's, the source's)
    differ = {key: (zero, dcp) for key, (dcp, zero) in found.items()}
    return _hyperparameters_said(src.name, differ) + step_said(src.name, src.step, base.step)


def _hyperparameters_said(name: str, differ: dict[str, tuple]) -> list[str]:
    """What is said of a source `name` whose hyperparameters differ from the base's ({key: (its value, the base's)}),
    nothing where none do."""
    if not differ:
        return []
    return [f"{name}'s hyperparameters differ from the base's, whose are kept: "
            + ", ".join(f"{key} {theirs!r:.40} (the base {mine!r:.40})" for key, (theirs, mine) in differ.items())]


def _hyperparameters(folder: Path, metadata: Metadata, optim: str, zero: Checkpoint,
                     params: list[str]) -> dict[str, tuple]:
    """{hyperparameter: (the DCP checkpoint's value, the ZeRO-3 checkpoint's)} of each of COMPARED that differs
    between the param group holding one of `params` in the DCP checkpoint (`folder`, its `metadata`, its optimizer's
    keys under `optim`) and the ZeRO-3 checkpoint `zero`'s sub-group holding it."""
    obj, _records, _prefix = read_structure(zero.ranks[0].structure_file)
    try:
        theirs_groups = obj[OPTIMIZER_STATE_DICT][OPTIMIZER_STATE_DICT][PARAM_GROUPS]
    except (KeyError, TypeError):
        theirs_groups = []
    entries = metadata.state_dict_metadata
    prefix = optim + "param_groups."
    count = len({k[len(prefix):].split(".")[0] for k in entries if k.startswith(prefix)})
    group_of: dict[str, int] = {}
    for i in range(min(count, MAX_COMPARED)):
        names = read_value(folder, metadata, f"{prefix}{i}.params") if f"{prefix}{i}.params" in entries else []
        group_of |= {n: i for n in names if isinstance(n, str)} if isinstance(names, list) else {}
    sub_group = {slot.name: slot.group for slot in zero.layout.slots}
    differ: dict[str, tuple] = {}
    for name in params:
        held, g = group_of.get(name), sub_group.get(name)
        if held is None or g is None or g >= len(theirs_groups) or not isinstance(theirs_groups[g], dict):
            continue
        for key in COMPARED:
            if f"{prefix}{held}.{key}" not in entries or key not in theirs_groups[g] or key in differ:
                continue
            dcp, mine = _plain(read_value(folder, metadata, f"{prefix}{held}.{key}")), _plain(theirs_groups[g][key])
            if dcp != mine:
                differ[key] = (dcp, mine)
    return differ


def _plain(value):
    return tuple(value) if isinstance(value, (list, tuple)) else value


def _jobs(base: DcpCheckpoint, sources: list[DcpCheckpoint | None], from_source: dict[str, int],
          owner: dict[str, str], allow_nonfinite: bool) -> tuple[list[DcpFileJob | DcpJob], dict]:
    """One job per output file copied from a DCP checkpoint (`sources`: None for another kind), and every archive's
    new place (`storage_data`, by the base's keys)."""
    per_file: dict[tuple[int, str, str], list[tuple[str, MetadataIndex, StorageInfo]]] = {}
    for s, src in enumerate(sources):
        if src is None:
            continue
        for index, info in src.metadata.storage_data.items():
            key = translated(index.fqn, src, base)
            if from_source.get(key) == s:  # (into the base's folder for the key: a source's file may feed two)
                per_file.setdefault((s, info.relative_path, base.part_of(key)), []).append((key, index, info))
    jobs: list[DcpFileJob | DcpJob] = []
    storage = {}
    for (s, name, part), items in sorted(per_file.items()):
        src = sources[s]
        assert src is not None, "a DCP checkpoint's file"
        folder, _, leaf = name.rpartition("/")
        out_name = name if s == 0 else "/".join(filter(None, (
            part, f"__tailor_{s}_{folder + '_' if folder != part else ''}{leaf.removeprefix('__')}")))
        copies, to = [], 0
        for key, index, info in sorted(items, key=lambda item: item[2].offset):
            if s == 0:  # where it lies in the base's file: a clone of that file shares its blocks, the archives
                to = info.offset  # of rows taken elsewhere left out (a hole)
            copies.append(Copy(index.fqn, index.offset, info.offset, info.length, to))
            storage[MetadataIndex(key, index.offset)] = StorageInfo(out_name, to, info.length)
            to += info.length
        entries = tuple((key, e if isinstance(e := src.metadata.state_dict_metadata[key], TensorStorageMetadata)
                         else None) for key in dict.fromkeys(c.key for c in copies))
        label = f"{src.name}{' (base)' if s == 0 else ''} {name}"
        rows = tuple((key, owner[base_key]) for key, _entry in entries
                     if (base_key := translated(key, src, base)) in owner)
        total = sum(c.length for c in copies)
        jobs.append(DcpFileJob(label, src.path, name, out_name, tuple(copies), entries, rows, s == 0, allow_nonfinite,
                               total, total))
    return jobs, storage


def _open_zero(base: DcpCheckpoint, path: Path, where: str) -> Checkpoint:
    """A ZeRO-3 checkpoint giving rows to a DCP composition (whole: its files' archives complete)."""
    try:
        ckpt = open_checkpoint(path)
        ckpt.check_complete()
    except CheckpointError as exc:
        raise type(exc)(f"{where}: {exc}") from None
    return ckpt


def _check_zero_rows(base: DcpCheckpoint, src: Checkpoint, rows: list[str]) -> None:
    """Refuse a ZeRO-3 checkpoint whose rows `rows` cannot be the DCP base's: a parameter it lacks or holds in
    another shape, a base entry that is no fp32 tensor (FSDP2's masters are), another optimizer's state kept per
    element, a frozen parameter or buffer (ZeRO-3 keeps those in model_states, in 16 bits)."""
    shapes = {name: shape for group in src.layout.groups for name, shape in group}
    frozen = dict(src.layout.frozen)
    entries = base.metadata.state_dict_metadata
    keys = rank_reader(src.ranks[0], tuple(src.layout.group_sizes())).keys()[1:]
    for row in rows:
        r = base.row(row)
        for name in (*r.params, *r.buffers):
            if name in frozen or name in r.buffers or name not in base.trainable:
                raise IncompatibleError(f"{src.path}: row {row} holds {name}, a frozen parameter or a buffer, which "
                                        "a ZeRO-3 checkpoint keeps in model_states; take that row from a DCP "
                                        "checkpoint")
            entry = entries.get(MODEL + name)
            if name not in shapes or not isinstance(entry, TensorStorageMetadata) or tuple(entry.size) != shapes[name]:
                said = f"{list(shapes[name])}" if name in shapes else "nothing"
                raise IncompatibleError(f"{src.path}: holds {said} for {name} of row {row}, the base {base.path} "
                                        f"{list(entry.size) if isinstance(entry, TensorStorageMetadata) else 'nothing'}"
                                        "; it is another model")
            if entry.dtype != "float32":
                raise IncompatibleError(f"{base.path}: holds {name} as {entry.dtype}; tailor-tui writes a ZeRO-3 "
                                        "checkpoint's fp32 masters into fp32 DCP entries only")
            theirs = tuple(sorted(k.rpartition(".")[2] for k, e in entries.items()
                                  if k.startswith(f"{base.optim}state.{name}.") and isinstance(e, TensorStorageMetadata)
                                  and tuple(e.size) == shapes[name]))
            if theirs != tuple(sorted(keys)):
                raise IncompatibleError(f"{src.path}: keeps {describe_state(tuple(keys))} per element, the base "
                                        f"{base.path} {describe_state(theirs)}: checkpoints of different optimizers "
                                        "cannot be combined")


def _zero_rows(base: DcpCheckpoint, sources: list, picks: dict[str, int],
               out: Path) -> dict[int, tuple[list[DcpJob], Metadata]]:
    """For each ZeRO-3 source: the jobs writing its rows' chunks (a file per rank, `__tailor_S_R_0.distcp`, as a DCP
    export lays a rank's share out: `dcp_layout.rank_job`; in the HF Trainer's layout, one in each of its DCP folders:
    the weights in the model's, the state in the optimizer's), and their entries and places."""
    laid = {}
    aliases = {alias: target for row in base.rows for alias, target in row.aliases}
    for s, src in enumerate(sources):
        if not isinstance(src, Checkpoint):
            continue
        params = sorted(p for row, i in picks.items() if i == s for p in base.row(row).params)
        tied = sorted((a, t) for a, t in aliases.items() if t in params)
        shapes = {name: shape for group in src.layout.groups for name, shape in group if name in params}
        state_keys = rank_reader(src.ranks[0], tuple(src.layout.group_sizes())).keys()[1:]
        found, optim = Entries(), base.optim.rstrip(".")
        for name in (*params, *(a for a, _t in tied)):
            found.tensor(f"{LAYOUT_MODEL}.{name}", (LAYOUT_MODEL, name), "float32", shapes[aliases.get(name, name)])
        for name in params:
            for key in state_keys:
                found.tensor(f"{optim}.{STATE}.{name}.{key}", (optim, STATE, name, key), "float32", shapes[name])
        if base.parts == ("",):
            layouts = [("", ModelShapes(shapes, {}, {}, state_keys, found))]
        else:  # the weights in the model's folder, the state in the optimizer's
            layouts = [(base.parts[0] + "/", ModelShapes(shapes, {}, {}, (), found)),
                       (base.parts[-1] + "/", ModelShapes(shapes, {}, {}, state_keys, found, masters=False,
                                                          optim=optim))]
        jobs = [job for folder, model in layouts for rank, files in enumerate(src.ranks)
                if (job := rank_job(model, src, rank, files, name=f"{folder}__tailor_{s}_{rank}_0.distcp",
                                    label=f"{src.name} {folder}".rstrip(" /"), mine=params,
                                    tied=tied if model.masters else [], cold=[],
                                    held=[])) is not None]
        laid[s] = (jobs, found.metadata(str(out)))
    return laid
