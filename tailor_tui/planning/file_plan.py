"""The plan for every file of the base folder but its rank files: which are composed per row
(one job each), which are copied from the base, and which refuse the recipe.

Computed once, with the plan (`plan.ComposePlan`), from the base, the sources and the picks; the
writers take the jobs as they are (`model_files.compose_model_file`, `bin_files.compose_bin_file`).
What each kind of file is: `weight_files`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import cast

from tailor_tui.checked.files import confine
from tailor_tui.checkpoints.checkpoint import Checkpoint
from tailor_tui.checkpoints.model_layout import ModelFileLayout
from tailor_tui.checkpoints.rows import list_rows
from tailor_tui.checkpoints.weight_files import (
    COMPOSED,
    COPIED,
    FileFate,
    composable,
    describe_run_level,
    family,
    folder_files,
    is_bin_weights,
    is_safetensors,
    tensor_names,
    tensor_params,
    tensor_rows,
    unplaced_error,
)
from tailor_tui.errors import IncompatibleError
from tailor_tui.formats.ds_format import RECOVERY_SCRIPTS
from tailor_tui.formats.safetensors_in import parse_prefix, safetensors_header
from tailor_tui.kinds.base import WeightSource
from tailor_tui.kinds.dcp_rows import DcpMasterWeights, DcpRankFiles
from tailor_tui.kinds.hf_weights import BinWeights, FileWeights
from tailor_tui.kinds.partial import MasterWeights, PartialRankFiles
from tailor_tui.planning.jobs import BinFileJob, ModelFileJob, WeightJob


def _check_headers(files) -> None:
    """Each source safetensors file a job takes tensors from has a sound header (bounded, whole):
    a damaged or crafted one refuses the plan now, not a worker mid-composition."""
    for f in set(files):
        safetensors_header(f)


def weight_jobs(base: Checkpoint, sources: tuple[Checkpoint, ...], picks: dict[str, int],
                layout: ModelFileLayout | None) -> tuple[WeightJob, ...]:
    """One job per weight file of the output: the 16-bit model files (`layout`), every other
    safetensors file of an HF base (a PEFT adapter) and its torch-format weight files, each tensor
    from the source picked for its row."""
    names = {i: str(src.path) for i, src in enumerate(sources)}
    full = {i: src.model_files for i, src in enumerate(sources) if src.model_files}
    masters = {i: _masters(src) for i, src in enumerate(sources) if src.saved.masters_only}
    base_files = {f.name: f for f in base.model_files}
    jobs: list[WeightJob] = []
    for name, prefix in (layout.files if layout else ()):
        rows, chosen = _tensor_sources(base, picks, list(parse_prefix(prefix)), base.path / name)
        used = set(chosen.values()) | ({0} if 0 in masters else set())  # (a partial base: every tensor written)
        lacking = [i for i in used if i and i not in full and i not in masters]
        if lacking:
            raise IncompatibleError(f"{sources[lacking[0]].path}: has no {name} (16-bit model weights) while the "
                                    "base has; pick its rows from a checkpoint that has one")
        _check_headers(f for i in used if i in full and not sources[i].gone for f in full[i])
        params = tensor_params(list(rows), base.rows, base.path) if masters else {}
        weights: dict[int, WeightSource] = {i: masters[i] if i in masters else FileWeights(names[i], full[i])
                                            for i in sorted(used) if i in masters or i in full}
        jobs.append(ModelFileJob(name, prefix, base_files.get(name), chosen, rows, weights, names, params))
    for rel in _weight_files(base):
        base_file = base.path / rel
        prefix = ModelFileLayout.of_files((base_file,)).files[0][1]
        rows, chosen = _tensor_sources(base, picks, list(parse_prefix(prefix)), base_file)
        own = {i: _same_file(sources[i], rel, rows, chosen, i) for i in sorted(set(chosen.values()))}
        _check_headers(f for i, files in own.items() if not sources[i].gone for f in files)
        jobs.append(ModelFileJob(str(rel), prefix, base_file, chosen, rows,
                                 {i: FileWeights(names[i], files) for i, files in own.items()}, names))
    for rel in _bin_files(base):
        base_file = base.path / rel
        rows, chosen = _tensor_sources(base, picks, tensor_names(base_file), base_file)
        own = {}
        for i in sorted(set(chosen.values()) - {0}):
            own[i] = (sources[i].path / rel,) if sources[i].gone else family(sources[i].path, rel)
            if not own[i]:
                raise _lacks(sources[i], rel, rows, chosen, i)
        jobs.append(BinFileJob(str(rel), base_file, chosen, rows, {i: BinWeights(names[i], files) for i, files in own.items()},
                               names, base_file.stat().st_size))
    return tuple(jobs)


def _masters(src: Checkpoint) -> WeightSource:
    """A partial save's fp32 masters as the source of model-file tensors: each trainable parameter's elements
    per rank and its valid elements on each rank (`layout.Slot`); a PyTorch Distributed Checkpoint's, chunk by
    chunk."""
    if isinstance(src.ranks[0], DcpRankFiles):
        return DcpMasterWeights(str(src.path), src.ranks[0])
    ranks = cast(tuple[PartialRankFiles, ...], src.ranks)
    parts = {slot.name: (slot.part, tuple(slot.valid(r) for r in range(len(ranks)))) for slot in src.layout.slots}
    return MasterWeights(str(src.path), ranks, parts)


def _same_file(src: Checkpoint, rel: Path, rows: dict, chosen: dict, i: int) -> tuple[Path, ...]:
    theirs = src.path / rel
    if not theirs.is_file() and not src.gone:
        raise _lacks(src, rel, rows, chosen, i)
    return (theirs,)


def _lacks(src: Checkpoint, rel: Path, rows: dict, chosen: dict, i: int) -> IncompatibleError:
    picked = sorted({rows[n] for n, s in chosen.items() if s == i and rows[n]})
    return IncompatibleError(f"{src.path}: has no {rel} while the base has (rows {list_rows(picked)} are picked "
                             f"from it); pick those rows from a checkpoint that has {rel.name}")


def _tensor_sources(base: Checkpoint, picks: dict[str, int], tensors: list[str],
                    file: Path) -> tuple[dict[str, str], dict[str, int]]:
    """(tensor -> row, tensor -> source index) of a weight file's tensors; a tensor no row holds
    is refused (IncompatibleError) unless every row comes from the base."""
    found = tensor_rows(tensors, base.rows, base.path)
    unplaced = [n for n, row in found.items() if row is None]
    if unplaced and any(picks.values()):  # (a partial save's model file is a header its record holds)
        raise unplaced_error(file if file.is_file() or base.saved.model_layout is None else base.saved.model_layout,
                             unplaced, base.rows)
    return ({n: row or "" for n, row in found.items()},
            {n: picks.get(row, 0) if row else 0 for n, row in found.items()})


def _weight_files(base: Checkpoint) -> list[Path]:
    """An HF base's safetensors files other than its 16-bit model files (a PEFT adapter, …), from
    the weight files its opening listed."""
    if not base.folder.weights_per_row:
        return []
    model = {f.relative_to(base.path) for f in base.model_files}
    return [rel for rel in map(Path, base.weight_files) if is_safetensors(rel) and rel not in model]


def _bin_files(base: Checkpoint) -> list[Path]:
    """An HF base's torch-format weight files (`pytorch_model*.bin`, `adapter_model.bin`) in torch's
    zip format, which the torch-free writer composes."""
    if not base.folder.weights_per_row:
        return []
    return [rel for rel in map(Path, base.weight_files) if is_bin_weights(rel) and composable(base.path / rel)]


def copied_files(base: Checkpoint, picks: dict[str, int]) -> list[Path]:
    """The base's files copied into the output unchanged (relative to `root_of(base)`): a folder
    base's every file but its rank files and composed weight files (tailor-tui's own records of a
    partial save aside); a DeepSpeed tag's recovery scripts. A weight file that cannot be composed
    refuses the recipe when a row moves."""
    if not base.in_folder:
        scripts = [Path(s) for s in RECOVERY_SCRIPTS if os.path.lexists(base.save_dir / s)]
        for rel in scripts:
            confine(base.save_dir / rel, base.path.parent)  # a link out of the run, or nowhere: refused
        return [rel for rel in scripts if (base.save_dir / rel).is_file()]
    skip = set(base.model_files) | {base.path / rel for rel in (*_weight_files(base), *_bin_files(base))}
    found = [p.relative_to(base.path) for p in folder_files(base.path, base.tag_dir)
             if p not in skip and not (p.parent == base.path and p.name in base.saved.own_files)]
    moved = sorted({row for row, s in picks.items() if s})
    for rel in found:  # a torch-format weight file left among them is one that is not composed
        if is_bin_weights(rel) and moved:
            raise IncompatibleError(
                f"{base.path / rel}: holds weights in torch's legacy (non-zip) format, which tailor-tui does not "
                f"compose; rows {list_rows(moved)} are picked from other checkpoints, so copying the base's would "
                "be wrong: re-save it with torch.save's default format or safetensors, or pick every row from "
                "the base")
    return found


def root_of(base: Checkpoint) -> Path:
    """Where `copied_files` lie: the checkpoint folder, or a DeepSpeed tag's save_dir."""
    return base.path if base.in_folder else base.save_dir


def file_fates(jobs: tuple[WeightJob, ...], copied: tuple[tuple[Path, Path], ...]) -> tuple[FileFate, ...]:
    """What happens to every file of the base folder but its rank files: composed per row (weight
    files) or copied from the base (run-level, or weights whose rows all come from the base)."""
    fates = [FileFate(Path(job.name), COMPOSED, "weights, per row") for job in jobs]
    for rel, _to in copied:
        why = ("weights; every row they hold comes from the base" if is_bin_weights(rel)
               else describe_run_level(rel))
        fates.append(FileFate(rel, COPIED, why))
    return tuple(fates)


def describe_files(fates: tuple[FileFate, ...], ranks: int, every_file: bool = True) -> list[str]:
    """The fates as text lines: rank files counted, weight files named; copied files named
    (`every_file`) or counted, those tailor-tui does not know named either way."""
    composed = [str(f.path) for f in fates if f.fate == COMPOSED]
    lines = [f"composed per row: {2 * ranks} rank files" + "".join(f", {f}" for f in composed)]
    copied = [f for f in fates if f.fate == COPIED]
    odd = [f for f in copied if "not known" in f.why]
    if copied and every_file:
        lines.append(f"copied from the base: {', '.join(str(f.path) for f in copied)}")
    elif copied:
        lines.append(f"copied from the base: {len(copied)} run-level file(s)"
                     + (f", {len(odd)} unknown to tailor-tui" if odd else ""))
    lines += [f"  {f.path}: {f.why}" for f in odd]
    return lines
