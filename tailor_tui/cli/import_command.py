"""`tailor-tui --import LLMTAILOR.yaml [--recipe OUT.yaml] [--run RUN_DIR] [--force]`: an LLMTailor
(mergekit passthrough) recipe written as the tailor-tui recipe it means, each row's source shown with
what in the LLMTailor recipe says so. `load_for` is how every command reads a recipe it is given."""

from __future__ import annotations

from pathlib import Path

from tailor_tui.errors import ExitCode, UsageError
from tailor_tui.units import shown


def load_for(args, path: Path):
    """The recipe at `path`, an LLMTailor recipe's model paths found in `--run` when given."""
    from tailor_tui.planning.recipe_file import load_recipe

    recipe = load_recipe(path, run=args.run)
    if args.run is not None and recipe.converted_from is None:
        raise UsageError(f"--run {args.run}: {path} is a tailor-tui recipe, whose paths are its own (from its "
                         "folder); --run goes with an LLMTailor recipe")
    return recipe


def import_command(args) -> int:
    from tailor_tui.planning.build import build_plan
    from tailor_tui.planning.mergekit_recipe import sources_of
    from tailor_tui.planning.output import default_output
    from tailor_tui.planning.recipe import Recipe, check_recipe_target
    from tailor_tui.planning.recipe_file import converted_path, save_recipe

    source: Path = getattr(args, "import")
    recipe = load_for(args, source)
    if recipe.converted_from is None:
        raise UsageError(f"{source}: is a tailor-tui recipe already; compose it with: tailor-tui --apply {source}")
    out: Path = args.recipe or converted_path(source)
    check_recipe_target(out, args.force)
    build_plan(recipe, output=args.output, preview=True)  # what --apply would refuse is not written
    base = recipe.base.resolve()
    ours = Recipe(base=recipe.base, output=args.output or recipe.output or default_output(recipe.base),
                  layers={row: p for row, p in recipe.layers.items() if p.resolve() != base})
    rows = sources_of(recipe)
    width = max(len(row) for row, _, _ in rows)
    named = max(len(name) for _, name, _ in rows)
    print(shown(f"base: {recipe.base.name} (the newest of the slices' checkpoints); output: {ours.output}"))
    for row, name, said in rows:
        print(shown(f"{row:<{width}}  {name:<{named}}  {said}"))
    saved = save_recipe(ours, out)
    print(shown(f"wrote {saved}; compose it with: tailor-tui --apply {saved}"))
    return ExitCode.OK
