"""A recipe file read and written: tailor-tui's own YAML (`recipe`), or LLMTailor's (`mergekit`,
told by its keys) converted on reading; saved atomically, over a person's file with only what
changed edited (`recipe_text`). Above the modules of each format, so none of them imports another
back."""

from __future__ import annotations

import os
from pathlib import Path

from tailor_tui.checkpoints.side_files import read_small
from tailor_tui.errors import RecipeError
from tailor_tui.fileio import create, first_free
from tailor_tui.planning.mergekit import looks_like as looks_like_mergekit
from tailor_tui.planning.recipe import Recipe, check_size, parse_recipe
from tailor_tui.planning.recipe_text import Sameness, text_to_save

__all__ = ["converted_path", "load_recipe", "save_recipe"]


def load_recipe(path: str | Path, run: Path | None = None) -> Recipe:
    """The recipe at `path`: tailor-tui's, or LLMTailor's (mergekit's YAML, told by its keys), whose
    model paths are found in the run folder `run` by their last names when it is given."""
    path = Path(path)
    if path.is_dir():
        from tailor_tui.checkpoints.scan import run_of_checkpoint  # (scanning imports torch's readers)

        run = run_of_checkpoint(path)  # advice that works when followed: a checkpoint's run, not the checkpoint
        what = f"is a checkpoint of the run {run}" if run is not None else "is a folder"
        run = run if run is not None else path
        raise RecipeError(f"{path}: {what}, not a recipe (a .yaml file); open the run with `tailor-tui {run}`, "
                          f"or write a recipe for it with `tailor-tui --heal {run} --recipe fix.yaml`")
    try:
        text = read_small(path).decode()
    except FileNotFoundError:
        raise RecipeError(f"{path}: no such recipe file") from None
    except OSError as exc:
        raise RecipeError(f"{path}: cannot read the recipe ({exc.strerror or exc})") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise RecipeError(f"{path}: not a recipe ({exc})") from None
    check_size(text, str(path))
    if looks_like_mergekit(text):
        from tailor_tui.planning.mergekit_recipe import load_llmtailor  # (it opens checkpoints: torch)

        return load_llmtailor(text, path, run)
    recipe = parse_recipe(text, source=str(path), folder=path.parent)
    recipe.source_file = path
    return recipe


def converted_path(source: Path) -> Path:
    """Where the tailor-tui recipe an LLMTailor recipe `source` means is written unless told otherwise (`--import`,
    the composer's ctrl+s): beside it, `NAME.tailor-tui.yaml`, then `-2`, `-3`, … never an existing file, never the
    LLMTailor file itself."""
    stem = source.name.removesuffix(".yaml").removesuffix(".yml")
    found = first_free(lambda n: source.with_name(f"{stem}.tailor-tui{'' if n == 1 else f'-{n}'}.yaml"), 10_000)
    if found is not None:
        return found
    raise RecipeError(f"{source.parent}: holds {stem}.tailor-tui.yaml to -9999; name the recipe to write")


def save_recipe(recipe: Recipe, path: str | Path, same: Sameness | None = None) -> Path:
    """Write `recipe` to `path` (atomically: a crash never leaves half a recipe); over a recipe a
    person wrote, their file with only what changed edited (`recipe_text`; `same`: when two
    spellings of a row or checkpoint mean the same). Sets the recipe's `source_file`."""
    path = Path(path)
    text = text_to_save(recipe, path, same)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    made = False
    try:
        with open(create(tmp), "w") as f:  # new, never through a link left at its name
            made = True
            f.write(text)
        os.replace(tmp, path)
    except OSError as exc:
        if made:
            tmp.unlink(missing_ok=True)
        raise RecipeError(f"{path}: cannot write the recipe ({exc.strerror})") from None
    recipe.source_file = path
    return path
