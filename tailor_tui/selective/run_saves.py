"""The saves in one training run's folder, as selective checkpointing leaves them.

A run folder (the HF Trainer's `output_dir`) holds full saves (the Trainer's own
`checkpoint-N`, and `resume-stepN`: a composition written by `resume_point`) and partial
saves (`partial-stepN`, `tailor_tui.selective`). Here: which save holds the newest copy
of each row, which saves are newer than the state training starts from, which may go
when `save_total_limit` is set, and what to resume from.

    trainer.train(resume_from_checkpoint=resume_point(args.output_dir))
"""

from __future__ import annotations

import json
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import AbstractSet

from tailor_tui.checkpoints.checkpoint import PROVENANCE, read_manifest
from tailor_tui.checkpoints.scan import find_checkpoint_dirs, scan
from tailor_tui.errors import CheckpointError
from tailor_tui.health.guard import newest_finite
from tailor_tui.kinds.folders import TRAINER_STATE
from tailor_tui.kinds.partial import PARTIAL_MANIFEST

RESUME_PREFIX = "resume-step"


@dataclass(frozen=True)
class Save:
    path: Path
    step: int
    rows: frozenset[str] | None  # a partial save's rows; None: every row (a full save)

    @property
    def partial(self) -> bool:
        return self.rows is not None


def run_saves(output_dir: str | Path) -> list[Save]:
    """The saves directly in `output_dir`, oldest first (reads manifests and trainer states only)."""
    output_dir = Path(output_dir)
    if not output_dir.is_dir():
        return []
    saves = []
    for folder in find_checkpoint_dirs(output_dir):
        if folder.parent != output_dir:
            continue  # set aside, or in a subfolder: not this run's own
        if (folder / PARTIAL_MANIFEST).is_file():
            manifest = read_manifest(folder)
            saves.append(Save(folder, int(manifest["step"]), frozenset(manifest["rows"])))
        else:
            saves.append(Save(folder, _step(folder), None))
    return sorted(saves, key=lambda s: (s.step, s.partial, s.path.name))


def _step(folder: Path) -> int:
    try:
        return int(json.loads((folder / TRAINER_STATE).read_text())["global_step"])
    except (OSError, ValueError, KeyError, TypeError):
        found = re.search(r"(\d+)$", folder.name, re.ASCII)
        return int(found.group(1)) if found else 0


def newest_holders(saves: list[Save]) -> set[Path]:
    """The saves that hold the newest copy of some row: what a newest-per-row composition
    needs (a full save holds every row, so nothing older than the newest full one is needed)."""
    holders: set[Path] = set()
    covered: set[str] = set()
    for save in sorted(saves, key=lambda s: (s.step, not s.partial), reverse=True):
        if save.rows is not None:  # partial
            if save.rows - covered:
                holders.add(save.path)
                covered |= save.rows
        else:
            holders.add(save.path)  # it holds every row some newer partial did not save
            break
    return holders


def removable(saves: list[Save], keep_newest: int, protect: AbstractSet[Path] = frozenset()) -> list[Save]:
    """Saves `save_total_limit=keep_newest` lets go: not among the newest `keep_newest`, not
    holding the newest copy of any row, not the newest full save (which the partials after it
    depend on, for their model-file layout too), not in `protect` (the best model)."""
    newest = {s.path for s in sorted(saves, key=lambda s: s.step)[-keep_newest:]} if keep_newest else set()
    fulls = [s for s in saves if not s.partial]
    keep = newest | newest_holders(saves) | set(protect) | ({max(fulls, key=lambda s: s.step).path} if fulls else set())
    return [s for s in saves if s.path not in keep]


def newer_than(saves: list[Save], step: int) -> list[Save]:
    return [s for s in saves if s.step > step]


def set_aside(output_dir: Path, saves: list[Save]) -> Path:
    """Move `saves` into `output_dir/set-aside-TIME/` (kept, out of the run's way)."""
    folder = Path(output_dir) / time.strftime("set-aside-%Y%m%d-%H%M%S")
    folder.mkdir()
    for save in saves:
        save.path.rename(folder / save.path.name)
    return folder


def resume_point(output_dir: str | Path, *, workers: int | None = 1) -> str | None:
    """The checkpoint that resumes the newest state saved in `output_dir`, for
    `trainer.train(resume_from_checkpoint=resume_point(args.output_dir))`.

    The newest full checkpoint when no partial save is newer; otherwise every row's newest
    copy composed (as the composer's default) into `output_dir/resume-stepN`, a full HF
    checkpoint, written once and reused. None when `output_dir` holds no save yet (a fresh
    start). Call it on every process of the training job: the main process composes, the
    others wait for it (torch.distributed, when it is initialised)."""
    output_dir = Path(output_dir)
    saves = run_saves(output_dir)
    barrier()  # every process has looked before the main one writes the resume point
    if not saves:
        return None
    newest = max(saves, key=lambda s: (s.step, not s.partial))
    if not newest.partial:
        return str(newest.path)
    target = output_dir / f"{RESUME_PREFIX}{newest.step}"
    if _is_main_process() and not _complete(target):
        _compose_newest(output_dir, target, workers)
    barrier()
    if not _complete(target):
        raise CheckpointError(f"{target}: the resume point was not written (see the main process's error)")
    return str(target)


def _compose_newest(output_dir: Path, target: Path, workers: int | None) -> None:
    from tailor_tui.compose.compose_run import run_compose
    from tailor_tui.planning.build import build_plan
    from tailor_tui.planning.recipe_draft import RecipeDraft

    found = scan(output_dir)
    own = [c for c in found.checkpoints if c.path.parent == output_dir and not c.path.name.startswith(RESUME_PREFIX)]
    composition = RecipeDraft.start(own)
    missing = composition.missing_rows()
    if missing:
        raise CheckpointError(f"{output_dir}: no save holds rows {', '.join(missing)}; cannot resume the newest state")
    composition.output = target
    if target.exists():
        shutil.rmtree(target)  # an incomplete earlier attempt (no provenance)
    run_compose(build_plan(composition.to_recipe()), workers=workers, newest_finite=newest_finite)


def _complete(folder: Path) -> bool:
    return (folder / PROVENANCE).is_file() and (folder / "latest").is_file()


def _is_main_process() -> bool:
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def barrier() -> None:
    """Wait for every process of the training job (torch.distributed), if there are several."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
