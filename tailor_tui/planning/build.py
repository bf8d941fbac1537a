"""Building a plan: a recipe checked against the checkpoints it names, raising a TailorError that
names the first problem (a missing checkpoint, an unknown or tied row, a source that cannot be
combined with the base, a partial source without the row, an output that would clobber
something) before anything is written; the work itself is `plan.ComposePlan`'s.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

from tailor_tui.checkpoints.cache import ROOT, Where, chosen
from tailor_tui.checkpoints.checkpoint import (
    Checkpoint,
    incompatibility,
    open_checkpoint,
    tied_partner,
)
from tailor_tui.checkpoints.dcp_checkpoint import is_dcp, open_dcp, zero_source
from tailor_tui.checkpoints.lineage import other_folder, other_run
from tailor_tui.errors import CheckpointError, IncompatibleError, RecipeError, UsageError
from tailor_tui.formats.ds_format import describe_state
from tailor_tui.kinds.base import rank_reader
from tailor_tui.kinds.dcp_rows import DcpSave
from tailor_tui.planning.dcp_plan import zero_base_differences
from tailor_tui.planning.output import check_output as check_writable
from tailor_tui.planning.output import recipe_output
from tailor_tui.planning.plan import ComposePlan
from tailor_tui.planning.recipe import Recipe
from tailor_tui.resharding.partition import check_world_size, plan_reshard


def _open(path: Path, where: str, what: str, cache: Path | None) -> Checkpoint:
    try:
        ckpt = open_checkpoint(path, cache=cache)
        ckpt.check_complete()
        return ckpt
    except CheckpointError as exc:
        raise type(exc)(f"{where}: {what}: {exc}") from None


def _resolve_row(base: Checkpoint, name: str, where: str) -> str:
    row = base.recipe_row(name, where)
    if row.tied:
        raise RecipeError(
            f"{where}: row '{name}' is tied to {tied_partner(base, row)} (it has no weights of its "
            f"own); pick {tied_partner(base, row)} instead"
        )
    return row.name


def build_plan(recipe: Recipe, *, output: str | Path | None = None, force: bool = False,
               check_output: bool = True, preview: bool = False, world_size: int | None = None,
               cache: Path | None | Where = ROOT,
               stand_in: Callable[[Path, Checkpoint], Checkpoint | None] | None = None) -> ComposePlan:
    """Check `recipe` against its checkpoints; raise a TailorError naming the first problem.

    `check_output=False` is for verifying a finished output, which exists by then;
    `preview=True` (`--dry-run`) turns what only writing would refuse into a warning;
    `world_size` (`--world-size`) overrides the recipe's. What each checkpoint's rank-0
    model_states file says comes from `cache` as a scan's does (`scan_cache`; None: read). `stand_in(path,
    base)`: what to plan a source deleted since by (`--verify`: `provenance.stand_in`), or None."""
    cache = chosen(cache)
    base = _open(recipe.base, recipe.location("base"), "base", cache)
    target = world_size or recipe.world_size
    if target is not None:
        why = check_world_size(base, target)
        if why:
            if world_size:
                raise UsageError(f"--world-size {target}: {why}; choose a smaller one")
            raise RecipeError(f"{recipe.location('world_size')}: {why}; choose a smaller one")
    out = Path(output) if output is not None else recipe_output(recipe, written=not check_output)
    if out is None:
        raise RecipeError(
            f"{recipe.location('base')}: no output folder: add `output:` to the recipe or pass --output DIR"
        )

    sources: list[Checkpoint] = [base]
    picks = {row.name: 0 for row in base.rows if not row.tied}
    by_path: dict[Path, int] = {base.path.resolve(): 0}
    spelled: dict[str, str] = {}  # row -> how the recipe named it
    for name, path in recipe.layers.items():
        where = recipe.location(f"row:{name}")
        row = _resolve_row(base, name, where)
        if row in spelled:
            raise RecipeError(f"{where}: row '{row}' is given twice (as '{spelled[row]}' and '{name}')")
        spelled[row] = name
        ckpt_index = by_path.get(_resolved(path))
        if ckpt_index is None:
            gone = stand_in(Path(path), base) if stand_in is not None and not os.path.lexists(path) else None
            src = gone or _open_source(path, base, where, f"row '{row}'", cache)
            ckpt_index = by_path.get(src.path.resolve())
            if ckpt_index is None:
                # (a DCP checkpoint's rows are cut from its chunks: every source located by its own layout)
                _check_compatible(base, src, where, row,
                                  resharding=target is not None or isinstance(src.saved, DcpSave))
                sources.append(src)
                ckpt_index = len(sources) - 1
                by_path[src.path.resolve()] = ckpt_index
            by_path[_resolved(path)] = ckpt_index
        picks[row] = ckpt_index

    _check_rows_held(recipe, sources, picks)
    _check_dcp_rows(recipe, base, sources, picks)
    keys = _flat_keys(recipe, sources, picks)
    reshard = None
    dcp = any(isinstance(s.saved, DcpSave) for s in sources)  # (its rows are cut from its chunks: as resharding)
    if dcp or target is not None and (target != base.world_size or any(s.world_size != target for s in sources)):
        reshard = plan_reshard(base, target or base.world_size)
    warnings = _other_runs(base, sources, picks)
    for s, src in enumerate(sources):  # a DCP checkpoint's rows: its optimizer's hyperparameters and step
        if isinstance(src.saved, DcpSave):
            params = [p for row, i in picks.items() if i == s for p in base.row(row).params]
            warnings += zero_base_differences(base, src, params, src.step or None)
    if check_output:
        note = check_writable(out, sources, force, preview=preview)
        warnings += [note] if note else []
    return ComposePlan(recipe=recipe, base=base, sources=tuple(sources), picks=picks, output=out, force=force,
                     warnings=tuple(warnings), reshard=reshard, keys=keys)


def _open_source(path: Path, base: Checkpoint, where: str, what: str, cache: Path | None) -> Checkpoint:
    """The checkpoint a row is taken from: a ZeRO-3 one, or a PyTorch Distributed Checkpoint read as one
    (`dcp_checkpoint.zero_source`)."""
    if not is_dcp(Path(path)):
        return _open(path, where, what, cache)
    try:
        return zero_source(open_dcp(Path(path)), base)
    except CheckpointError as exc:
        raise type(exc)(f"{where}: {what}: {exc}") from None


def _check_dcp_rows(recipe: Recipe, base: Checkpoint, sources: list[Checkpoint], picks: dict[str, int]) -> None:
    """A row taken from a PyTorch Distributed Checkpoint holds trainable parameters only: a frozen parameter's
    fragment and a buffer lie in ZeRO-3's model_states, which such a checkpoint has none of."""
    frozen = {name for name, _shape in base.layout.frozen}
    for row, s in picks.items():
        if s and isinstance(sources[s].saved, DcpSave):
            r = base.row(row)
            held = [p for p in r.params if p in frozen] + list(r.buffers)
            if held:
                raise IncompatibleError(
                    f"{recipe.location(f'row:{row}')}: row '{row}' holds {held[0]} (a frozen parameter or a buffer), "
                    f"which {sources[s].path.name}, a PyTorch Distributed Checkpoint, cannot give a ZeRO-3 "
                    "checkpoint; take that row from a ZeRO-3 checkpoint")


def _flat_keys(recipe: Recipe, sources: list[Checkpoint], picks: dict[str, int]) -> tuple[str, ...]:
    """The flat tensors every rank's slices lie in (`RankReader.keys`: the fp32 masters and the optimizer's state
    kept per element), the base's; read before anything is read for the output (--dry-run too). Refused: a state
    that cannot be taken apart by row, and a source whose optimizer keeps other states than the base's (the
    output would pair one optimizer's state with another's, or keep the base's in silence)."""
    base = sources[0]
    found = [None if src.gone else rank_reader(src.ranks[0], tuple(src.layout.group_sizes())).keys()
             for src in sources]
    mine = found[0]
    assert mine is not None, "a base is never gone"
    for s, (src, theirs) in enumerate(zip(sources, found)):
        if theirs is not None and theirs != mine:
            row = next(row for row, i in picks.items() if i == s)
            raise IncompatibleError(
                f"{recipe.location(f'row:{row}')}: row '{row}': checkpoint {src.path} keeps "
                f"{describe_state(theirs[1:])} per element, base {base.path} {describe_state(mine[1:])}: "
                "checkpoints of different optimizers cannot be combined (the output would pair one's state with "
                "the other's); pick checkpoints of the run's optimizer")
    return mine


def _other_runs(base: Checkpoint, sources: list[Checkpoint], picks: dict[str, int]) -> list[str]:
    """A warning for each source that lies in another run folder than the base."""
    found = []
    for s, src in enumerate(sources[1:], start=1):
        why = None if src.gone else (other_folder if isinstance(src.saved, DcpSave) else other_run)(base, src)
        if why:
            rows = [row for row, i in picks.items() if i == s]
            found.append(f"{_list(rows)} come(s) from {src.path}: {why}; make sure it is the same training run")
    return found


def _check_rows_held(recipe: Recipe, sources: list[Checkpoint], picks: dict[str, int]) -> None:
    """Every row must come from a checkpoint that saved it (partial checkpoints hold some rows)."""
    base = sources[0]
    for row, s in picks.items():
        if s and not sources[s].holds(row):
            src = sources[s]
            raise RecipeError(
                f"{recipe.location(f'row:{row}')}: row '{row}' picks {src.path.name}, a {src.saved.kind} checkpoint "
                f"that did not save it (it holds {_list([r for r in base.row_names() if src.saved.holds(r)])}); "
                "pick a checkpoint that has it"
            )
    lacking = [row for row, s in picks.items() if s == 0 and not base.holds(row)]
    if lacking:
        raise RecipeError(
            f"{recipe.location('base')}: base {base.path.name} is a {base.saved.kind} checkpoint without rows "
            f"{_list(lacking)}; pick a source for each of them under `layers:`"
        )


def _list(names: list[str], most: int = 6) -> str:
    return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")


def _resolved(path: Path) -> Path:
    try:
        return Path(path).resolve()
    except OSError:
        return Path(path).absolute()


def _check_compatible(base: Checkpoint, src: Checkpoint, where: str, row: str, resharding: bool) -> None:
    why = incompatibility(base, src, repartitioned=resharding)
    if why:
        hint = ("; add `world_size:` to the recipe (or --world-size) to reshard every source"
                if src.world_size != base.world_size and not resharding else "")
        raise IncompatibleError(f"{where}: row '{row}': checkpoint {src.path} cannot be combined with "
                                f"base {base.path}: {why}{hint}")
