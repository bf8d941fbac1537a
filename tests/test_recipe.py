"""Recipe files: strict parsing with errors that point at file:line:col."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import tailor

from tailor_tui.errors import RecipeError
from tailor_tui.planning.recipe import HEADER, OLD_HEADERS, Recipe, as_tailor_wrote_it, parse_recipe
from tailor_tui.planning.recipe_file import load_recipe, save_recipe

ROOT = Path(__file__).resolve().parent.parent


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


# YAML integers tailor-tui does not read as whole numbers (issue 58): each one line naming the key,
# never int()'s ValueError; a long one cut
@pytest.mark.parametrize("value", ['!!int "\\u00b2"', '!!int "\\u0663"', "9" * 5000, str(1 << 63), "0x10", "0b10",
                                   "010", "1_000", "+4", "-2", "1:30", '!!int "4 "'],
                         ids=lambda v: v if len(v) < 30 else f"{len(v):,} digits")
def test_world_sizes_yaml_reads_as_integers_but_are_no_plain_whole_number_are_one_line(value):
    with pytest.raises(RecipeError) as err:
        parse(f"version: 1\nbase: b\nworld_size: {value}\n")
    message = str(err.value)
    assert message.startswith("r.yaml:3:13: `world_size` must be a whole number of at least 1")
    assert "plain decimal digits 0-9" in message and "\n" not in message and len(message) < 400, message


@pytest.mark.parametrize("value, size", [("1", 1), ('!!int "4"', 4), (str((1 << 63) - 1), (1 << 63) - 1)])
def test_a_world_size_in_plain_digits_is_read(value, size):
    assert parse(f"version: 1\nbase: b\nworld_size: {value}\n").world_size == size


def test_save_and_load_round_trip(tmp_path):
    runs = tmp_path / "runs"
    r = Recipe(base=runs / "checkpoint-6", output=runs / "out",
               layers={"embed_tokens": runs / "checkpoint-2", "layers.1": runs / "checkpoint-4"})
    (tmp_path / "recipes").mkdir()
    path = save_recipe(r, tmp_path / "recipes" / "fix.yaml")
    text = path.read_text()
    assert "../runs/checkpoint-6" in text  # written relative to the recipe's folder
    again = load_recipe(path)
    assert again.base.resolve() == r.base.resolve()
    assert again.output.resolve() == r.output.resolve()
    assert {k: v.resolve() for k, v in again.layers.items()} == {k: v.resolve() for k, v in r.layers.items()}


def test_missing_recipe_file(tmp_path):
    with pytest.raises(RecipeError, match="no such recipe file"):
        load_recipe(tmp_path / "nope.yaml")


# A recipe a person wrote: comments of every kind, blank lines, their own key order, quoting and indentation
HAND = """\
# Merge notes: the loss spiked after step 600.
#   (see the wandb run)
---
version: 1    # always 1

# the newest checkpoint is the base
output: "../runs/out"   # beside the runs
base: '../runs/checkpoint-6'   # newest
world_size: 2

layers:   # rows taken from elsewhere
    # early layers: from before the spike
    embed_tokens: ../runs/checkpoint-2   # embeddings
    layers.1: ../runs/checkpoint-4

    # between rows
    layers.3: "../runs/checkpoint-4"  # three
# the end
"""


def hand_recipe(tmp_path) -> Path:
    (tmp_path / "recipes").mkdir()
    path = tmp_path / "recipes" / "mine.yaml"
    path.write_text(HAND)
    return path


def test_a_recipe_with_comments_is_saved_byte_for_byte(tmp_path):
    path = hand_recipe(tmp_path)
    save_recipe(load_recipe(path), path)
    assert path.read_bytes() == HAND.encode()
    assert not as_tailor_wrote_it(path)


def test_a_changed_source_changes_that_value_only(tmp_path):
    path = hand_recipe(tmp_path)
    recipe = load_recipe(path)
    recipe.layers["layers.3"] = tmp_path / "runs" / "checkpoint-2"
    recipe.base = tmp_path / "runs" / "checkpoint-4"
    save_recipe(recipe, path)
    assert path.read_text() == (HAND.replace('layers.3: "../runs/checkpoint-4"', 'layers.3: "../runs/checkpoint-2"')
                                .replace("base: '../runs/checkpoint-6'", "base: '../runs/checkpoint-4'"))


def test_added_and_removed_rows_and_keys(tmp_path):
    path = hand_recipe(tmp_path)
    recipe = load_recipe(path)
    runs = tmp_path / "runs"
    recipe.layers = {"embed_tokens": recipe.layers["embed_tokens"], "layers.0": runs / "checkpoint-2",  # added
                     "layers.2": runs / "checkpoint-2", "layers.3": recipe.layers["layers.3"],  # layers.1: removed
                     "norm": runs / "checkpoint-4"}
    recipe.world_size = None
    save_recipe(recipe, path)
    assert path.read_text() == HAND.replace("world_size: 2\n", "").replace(
        "    layers.1: ../runs/checkpoint-4\n",
        "    layers.0: ../runs/checkpoint-2\n    layers.2: ../runs/checkpoint-2\n").replace(
        '  # three\n', '  # three\n    norm: "../runs/checkpoint-4"\n')  # quoted as its neighbour
    recipe.layers, recipe.world_size = {}, 4
    save_recipe(recipe, path)
    assert path.read_text() == (
        HAND.split("---\n")[0] + "---\nversion: 1    # always 1\n\n# the newest checkpoint is the base\n"
        "output: \"../runs/out\"   # beside the runs\nbase: '../runs/checkpoint-6'   # newest\nworld_size: 4\n\n"
        "layers:   # rows taken from elsewhere\n    # early layers: from before the spike\n\n    # between rows\n"
        "# the end\n")
    assert load_recipe(path).layers == {}
    recipe.layers = {"lm_head": runs / "checkpoint-2"}
    save_recipe(recipe, path)
    assert "layers:   # rows taken from elsewhere\n  lm_head: ../runs/checkpoint-2\n" in path.read_text()


def test_a_missing_key_goes_where_a_recipe_has_it(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("# mine\nversion: 1\nbase: a  # the base\nlayers: {x: b}  # flow\n")
    recipe = load_recipe(path)
    recipe.output, recipe.layers = tmp_path / "out", {"x": tmp_path / "b", "y": tmp_path / "c"}
    save_recipe(recipe, path)
    assert path.read_text() == "# mine\nversion: 1\nbase: a  # the base\noutput: out\nlayers: {x: b, y: c}  # flow\n"


def test_a_recipe_tailor_tui_wrote_is_written_anew(tmp_path):
    """Its own recipe (under this header or an earlier one) stays its own: --heal may write it again."""
    runs = tmp_path / "runs"
    recipe = Recipe(base=runs / "checkpoint-6", layers={"layers.1": runs / "checkpoint-4"})
    path = save_recipe(recipe, tmp_path / "fix.yaml")
    assert path.read_text().startswith(HEADER) and as_tailor_wrote_it(path)
    path.write_text(path.read_text().replace(HEADER, OLD_HEADERS[0]))
    assert as_tailor_wrote_it(path)
    recipe.layers = {"layers.0": runs / "checkpoint-2"}
    save_recipe(recipe, path)
    assert path.read_text() == recipe.fresh_text(tmp_path) and as_tailor_wrote_it(path)


@pytest.mark.parametrize("text", ["models:\n  - model: x\n", "version: 1\nbase: [oops\n", "- a\n", "base: {a: b}\n"])
def test_over_a_file_that_is_no_recipe_the_recipe_is_written_anew(tmp_path, text):
    path = tmp_path / "r.yaml"
    path.write_text(text)
    recipe = Recipe(base=tmp_path / "b")
    save_recipe(recipe, path)
    assert path.read_text() == recipe.fresh_text(tmp_path)


@pytest.mark.parametrize("name, folders", [
    ("parity-recovery.yaml", {"checkpoint-550": "checkpoint-1", "checkpoint-600": "checkpoint-2"}),
    ("rollback-bad-layers.yaml", {"global_step500": "checkpoint-1/global_step1",
                                  "global_step600": "checkpoint-2/global_step2"}),
])
def test_the_example_recipes_shipped_in_recipes_plan_as_written(real_run, tmp_path, name, folders):
    """recipes/'s examples, copied unchanged beside a `run/` laid out as they expect (a real 32-layer run's saves
    under the names they use; demo.yaml is the README's sample, run by test_readme): each plans, row for row."""
    import shutil

    run, _spec = real_run("hf_32_layers")
    for mine, theirs in folders.items():
        shutil.copytree(run / theirs, tmp_path / "run" / mine)
    (tmp_path / "recipes").mkdir()
    recipe = tmp_path / "recipes" / name
    shutil.copyfile(ROOT / "recipes" / name, recipe)
    result = tailor("--apply", recipe, "--dry-run")
    assert result.returncode == 0, result.stderr
    picked = load_recipe(recipe).layers
    assert picked and f"rows from other checkpoints ({len(picked)} of " in result.stdout, result.stdout
    assert not (tmp_path / "run-recovered").exists() and sorted(p.name for p in (tmp_path / "run").iterdir()) == \
        sorted(folders)
