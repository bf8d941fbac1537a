"""Which training run a checkpoint belongs to.

Checkpoints of one run hold one model (the same parameters, names and shapes, whatever the world
size) and, where the HF Trainer saved them, one past: a checkpoint's log history up to its step
is where every later checkpoint's of the same run starts (a restored copy or a resumed run keeps
it). Two trainings side by side in one folder differ in one or the other; a scan that finds
several runs is refused (`check_one_run`), so the grid, the statistics' Δ and healing never
cross runs. Where nothing tells runs apart (DeepSpeed's own layout holds no history), the run
folder does, as a warning for recipes (`other_run`).
"""

from __future__ import annotations

import os
from pathlib import Path

from tailor_tui.checkpoints.checkpoint import Checkpoint, distinct_names, log_history
from tailor_tui.errors import UsageError


def model_of(ckpt: Checkpoint) -> frozenset:
    """The parameters a checkpoint holds: (name, shape) of each, trainable or frozen."""
    return frozenset((*(p for group in ckpt.layout.groups for p in group), *ckpt.layout.frozen))


def history(ckpt: Checkpoint) -> tuple | None:
    """The HF Trainer's log history up to the checkpoint's step, as (step, entry) pairs; None
    where there is none to read (DeepSpeed's layout, a partial save without one, an unreadable file)."""
    entries = log_history(Path(ckpt.path))
    if entries is None:
        return None
    kept = [(e["step"], tuple(sorted((k, repr(v)) for k, v in e.items())))
            for e in entries if isinstance(e, dict) and isinstance(e.get("step"), int) and e["step"] <= ckpt.step]
    return tuple(kept)


class Lineage:
    """What tells the runs of a set of checkpoints apart, each read once."""

    def __init__(self) -> None:
        self._models: dict[Path, frozenset] = {}
        self._histories: dict[Path, tuple | None] = {}

    def model(self, ckpt: Checkpoint) -> frozenset:
        if ckpt.path not in self._models:
            self._models[ckpt.path] = model_of(ckpt)
        return self._models[ckpt.path]

    def history(self, ckpt: Checkpoint) -> tuple | None:
        if ckpt.path not in self._histories:
            self._histories[ckpt.path] = history(ckpt)
        return self._histories[ckpt.path]

    def apart(self, a: Checkpoint, b: Checkpoint) -> str | None:
        """Why `a` and `b` are of different runs (a phrase), or None when nothing says so."""
        if self.model(a) != self.model(b):
            return "they hold different models (parameter names or shapes)"
        ha, hb = self.history(a), self.history(b)
        if ha is None or hb is None:
            return None
        older, newer = (ha, hb) if a.step <= b.step else (hb, ha)
        shared = min(a.step, b.step)
        start = tuple(entry for entry in newer if entry[0] <= shared)
        if older != start:
            step = next((x[0] for x, y in zip(older, start) if x != y), None)
            where = f" at step {step}" if step is not None else ""
            return f"their training logs (trainer_state.json) differ{where}"
        return None


def split_runs(checkpoints: tuple[Checkpoint, ...] | list[Checkpoint],
               lineage: Lineage | None = None) -> list[list[Checkpoint]]:
    """The checkpoints (ordered by step) grouped by run, each group in the given order: a
    checkpoint joins the first run it is not told apart from. Holding the same model and
    starting a history are both transitive, so it is compared with the run's newest checkpoint
    and the newest that has a history, not with every one (a run of 100 checkpoints)."""
    lineage = lineage or Lineage()
    runs: list[list[Checkpoint]] = []
    logged: list[Checkpoint | None] = []  # per run: its newest checkpoint with a history
    for ckpt in checkpoints:
        for i, run in enumerate(runs):
            if all(other is None or lineage.apart(ckpt, other) is None for other in (run[-1], logged[i])):
                run.append(ckpt)
                if lineage.history(ckpt) is not None:
                    logged[i] = ckpt
                break
        else:
            runs.append([ckpt])
            logged.append(ckpt if lineage.history(ckpt) is not None else None)
    return runs


def check_one_run(root: Path, checkpoints: tuple[Checkpoint, ...]) -> None:
    """UsageError (one line) when the checkpoints found under `root` are of several training runs:
    a grid, its Δ and healing compare checkpoints of one run only."""
    lineage = Lineage()
    runs = split_runs(checkpoints, lineage)
    if len(runs) < 2:
        return
    labels = dict(zip((c.path for c in checkpoints), distinct_names([c.path for c in checkpoints])))
    named = "; ".join(", ".join(labels[c.path] for c in run) if len(run) <= 3
                      else f"{labels[run[0].path]} … {labels[run[-1].path]} ({len(run)} checkpoints)" for run in runs)
    why = lineage.apart(runs[0][0], runs[1][0]) or "nothing ties them together"
    folders = [os.path.commonpath([str(c.path.parent) for c in run]) for run in runs]
    hint = (f"; open one run's folder, e.g. tailor-tui {folders[0]}" if len(set(folders)) == len(folders)
            else "; move each run's checkpoints into a folder of its own and open one")
    raise UsageError(f"{root}: holds checkpoints of {len(runs)} training runs ({named}): {why}. "
                     f"They are never compared or combined{hint}")


def other_run(base: Checkpoint, other: Checkpoint) -> str | None:
    """Why `other` may come from another training run than `base` (one phrase), or None: its
    lineage says so, or it lies in another run folder (compared by identity) with nothing to
    say it is the same run."""
    if (why := Lineage().apart(base, other)) is not None:
        return f"it is of another training run than the base: {why}"
    mine, theirs = base.path.parent, other.path.parent
    try:
        if os.path.samefile(mine, theirs):
            return None
    except OSError:
        pass
    return f"it lies in another run folder ({theirs}) than the base ({mine})"
