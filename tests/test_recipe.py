"""Recipe files: strict parsing with errors that point at file:line:col."""

from __future__ import annotations

from pathlib import Path

import pytest

from tailor_tui.errors import RecipeError
from tailor_tui.planning.recipe import Recipe, load_recipe, parse_recipe


def parse(text: str) -> Recipe:
    return parse_recipe(text, source="r.yaml", folder=Path("/runs"))


def test_relative_paths_resolve_against_the_recipe_folder():
    r = parse("version: 1\nbase: a/checkpoint-6\noutput: out\nlayers:\n  layers.1: /abs/checkpoint-4\n")
    assert r.base == Path("/runs/a/checkpoint-6")
    assert r.output == Path("/runs/out")
    assert r.layers == {"layers.1": Path("/abs/checkpoint-4")}


def test_layers_and_output_are_optional():
    r = parse("version: 1\nbase: b\nlayers:\n")
    assert r.layers == {} and r.output is None


@pytest.mark.parametrize(
    "text, message",
    [
        ("version: 1\nbase: [oops\n", "r.yaml:3:1: malformed YAML"),
        ("version: 1\nbase: b\nlayer:\n  x: y\n", "r.yaml:3:1: unknown key 'layer'"),
        ("version: 1\noutput: o\n", "missing `base:`"),
        ("base: b\n", "missing `version: 1`"),
        ("version: 2\nbase: b\n", "r.yaml:1:10: unsupported recipe version '2'"),
        ("version: 1\nbase: b\nlayers: [a, b]\n", "r.yaml:3:9: `layers` maps row names"),
        ("version: 1\nbase: b\nlayers:\n  layers.1: a\n  layers.1: b\n", "r.yaml:5:3: row 'layers.1' is given twice"),
        ("version: 1\nbase: 3\n", "r.yaml:2:7: `base` must be a checkpoint folder path"),
        ("- a\n- b\n", "a recipe is a mapping"),
        ("", "the recipe is empty"),
    ],
)
def test_malformed_recipes_are_one_clear_error(text, message):
    with pytest.raises(RecipeError) as err:
        parse(text)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_save_and_load_round_trip(tmp_path):
    runs = tmp_path / "runs"
    r = Recipe(base=runs / "checkpoint-6", output=runs / "out",
               layers={"embed_tokens": runs / "checkpoint-2", "layers.1": runs / "checkpoint-4"})
    (tmp_path / "recipes").mkdir()
    path = r.save(tmp_path / "recipes" / "fix.yaml")
    text = path.read_text()
    assert "../runs/checkpoint-6" in text  # written relative to the recipe's folder
    again = load_recipe(path)
    assert again.base.resolve() == r.base.resolve()
    assert again.output.resolve() == r.output.resolve()
    assert {k: v.resolve() for k, v in again.layers.items()} == {k: v.resolve() for k, v in r.layers.items()}


def test_missing_recipe_file(tmp_path):
    with pytest.raises(RecipeError, match="no such recipe file"):
        load_recipe(tmp_path / "nope.yaml")
