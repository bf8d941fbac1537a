"""An LLMTailor recipe (`mergekit.parse`) as a tailor-tui `Recipe`: its model paths found, checked
against the run it names (its layer count, tied embeddings, dtype), every row given one checkpoint.

Model paths. LLMTailor's recipes hold absolute paths of the machine they were written on, and LLMTailor
knows a checkpoint by its folder's last name, `checkpoint-N` (merge.py:225-234 and 326 read the step
from it). So a `model:` path is found by one rule:

- with a run folder (`--run RUN_DIR`, or the run the composer has open): RUN_DIR/<its last name>;
- otherwise the path as written, if it is a folder (a relative one from the recipe's folder, as
  tailor-tui's own recipes), else <the recipe's folder>/<its last name>: a recipe copied into its
  run folder works as it is.

The base (what supplies the trainer state, scheduler, RNG states and every file no row owns) is the
newest of the slices' checkpoints, as LLMTailor copies those from the slice model with the highest
checkpoint number (merge.py:323-355). The output is `<base>-tailored` beside it (`-2`, `-3`, … past an existing
one: `output.default_output`) unless --output says.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from tailor_tui.checkpoints.cache import ROOT, Where, chosen
from tailor_tui.checkpoints.checkpoint import Checkpoint, open_checkpoint
from tailor_tui.errors import CheckpointError, RecipeError
from tailor_tui.planning.mergekit import LLMTailorRecipe, ModelRef, parse, row_sources
from tailor_tui.planning.recipe import Recipe

FORMAT = "LLMTailor"
_LAYER = re.compile(r"layers\.\d+", re.ASCII)


class _Paths:
    """Each `model:` text's folder, by the rule above, found once."""

    def __init__(self, folder: Path, run: Path | None):
        self.folder, self.run = folder, run
        self.found: dict[str, Path] = {}

    def __call__(self, src: ModelRef) -> Path:
        if src.model not in self.found:
            self.found[src.model] = self._find(src)
        return self.found[src.model]

    def _find(self, src: ModelRef) -> Path:
        written = Path(os.path.expanduser(src.model))
        name = written.name
        if self.run is not None:
            if (self.run / name).is_dir():
                return self.run / name
            raise RecipeError(f"{src.at}: {src.what}: model {src.model}: run folder {self.run} has no {name or '?'} "
                              f"(--run reads each model path as RUN_DIR/<its last name>)")
        as_written = written if written.is_absolute() else self.folder / written
        if as_written.is_dir():
            return as_written
        if name and (self.folder / name).is_dir():
            return self.folder / name
        raise RecipeError(f"{src.at}: {src.what}: model {src.model}: no such folder, nor a {name or '?'} beside the "
                          f"recipe; pass --run RUN_DIR (the run folder holding {name or 'it'}) or copy the recipe "
                          "into the run folder")


def _open(path: Path, src: ModelRef, cache: Path | None) -> Checkpoint:
    try:
        return open_checkpoint(path, cache=cache)
    except CheckpointError as exc:
        raise type(exc)(f"{src.at}: {src.what}: {exc}") from None


def load_llmtailor(text: str, path: Path, run: Path | None = None, *, cache: Path | None | Where = ROOT) -> Recipe:
    """The tailor-tui recipe an LLMTailor recipe means, every row listed: RecipeError (or the
    CheckpointError of a source) names the first thing that cannot be composed as LLMTailor would."""
    source = str(path)
    recipe = parse(text, source)
    where = _Paths(path.parent, run)
    known = chosen(cache)
    opened: dict[Path, Checkpoint] = {}
    for s in recipe.slices:
        folder = where(s.source)
        if folder not in opened:
            opened[folder] = _open(folder, s.source, known)
    base_folder = max(opened, key=lambda folder: opened[folder].step)
    base = opened[base_folder]
    base_src = next(s.source for s in recipe.slices if where(s.source) == base_folder)
    shown = {s.source: f"{s.source.what} [{s.start}, {s.end}]" for s in recipe.slices}
    rows = [r for r in base.rows if not r.tied]
    tied = not any(r.name == "lm_head" for r in rows)
    layers = sum(1 for r in rows if _LAYER.fullmatch(r.name))
    _check_dtype(recipe, base)
    picks: dict[str, Path] = {}
    spots = {"base": base_src.at}
    for row, sources in row_sources(recipe, layers, tied).items():
        first = sources[0]
        for other in sources[1:]:
            if where(other).resolve() != where(first).resolve():
                raise RecipeError(
                    f"{other.at}: {other.what} takes {row} from {where(other).name}, {first.what} (at {first.at}) from "
                    f"{where(first).name}: LLMTailor takes a row's weights and its optimizer state apart, tailor-tui "
                    "takes a row whole from one checkpoint: name the same checkpoint in both")
        picks[row], spots[f"row:{row}"] = where(first), first.at
        spots[f"from:{row}"] = ", ".join(shown.get(src, src.what) for src in sources)
    unnamed = [r.name for r in rows if r.name not in picks]
    if unnamed:
        raise RecipeError(f"{source}: {base.name} has rows an LLMTailor recipe cannot name ({', '.join(unnamed[:4])}"
                          f"{' …' if len(unnamed) > 4 else ''}); it names layers.N, embed_tokens, norm and lm_head: "
                          "compose this run with a tailor-tui recipe")
    order = {r.name: i for i, r in enumerate(base.rows)}
    layers_picked = {row: picks[row] for row in sorted(picks, key=lambda r: order.get(r, len(order)))}
    return Recipe(base=base_folder, output=None, layers=layers_picked,  # (its output: `output.default_output`)
                  source_file=path, where=spots, converted_from=FORMAT)


def _check_dtype(recipe: LLMTailorRecipe, base: Checkpoint) -> None:
    """mergekit casts every weight to `dtype`: the same output as tailor-tui's only in the run's own."""
    if recipe.dtype is not None and recipe.dtype[1] != base.dtype:
        written, _ours, at = recipe.dtype
        raise RecipeError(f"{at}: dtype {written} would cast the weights, which {base.name} holds in {base.dtype}; "
                          "tailor-tui keeps the training dtype: remove `dtype` (--export --dtype casts an export)")


def sources_of(recipe: Recipe) -> list[tuple[str, str, str]]:
    """(row, checkpoint, what in the LLMTailor recipe says so) for each row, for `--import` to show."""
    return [(row, path.name, recipe.where.get(f"from:{row}", "")) for row, path in recipe.layers.items()]
