"""LLMTailor's recipes (mergekit's YAML, passthrough) as they are in its repository: read, checked, composed.

Llama_cut.yaml and Qwen_cut.yaml are LLMTailor's examples/ files, byte for byte (tests/llmtailor/, with
where they came from). The run `hf_32_layers` is a real 32-layer Llama trained by DeepSpeed ZeRO-3
through the HF Trainer, saving checkpoint-1 and checkpoint-2: the names Llama_cut.yaml gives, so
`--run RUN_DIR` finds every one of its model paths (/lvs0/…/checkpoint-N) by the documented rule.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from helpers import assert_one_line_error, tailor, write_recipe
from pilot_helpers import scanned, wait_for
from textual.widgets import Input
from zero_reader import read_full_state

from tailor_tui.checkpoints.checkpoint import PROVENANCE
from tailor_tui.checkpoints.scan import scan
from tailor_tui.errors import ExitCode, RecipeError
from tailor_tui.planning.mergekit import looks_like, parse, row_sources
from tailor_tui.planning.recipe_draft import RecipeDraft
from tailor_tui.planning.recipe_file import load_recipe
from tailor_tui.ui.app import make_app
from tailor_tui.ui.dialogs import Confirm, PathPrompt

HERE = Path(__file__).parent / "llmtailor"
LLAMA = (HERE / "Llama_cut.yaml").read_text()
QWEN = (HERE / "Qwen_cut.yaml").read_text()
OLD = "/lvs0/rccs-hpbdrt/minqiu/Model_output/Llama3.1-8B-pubmed-merge_group2"


def sources(text: str, layers: int) -> dict[str, set[str]]:
    """row -> the checkpoint names its sources give."""
    return {row: {s.model.rsplit("/", 1)[-1] for s in found}
            for row, found in row_sources(parse(text, "r.yaml"), layers).items()}


def test_the_qwen_example_is_read_as_28_layers_and_three_magic_rows():
    assert looks_like(QWEN) and parse(QWEN, "q.yaml").layers() == 28
    rows = sources(QWEN, 28)
    assert len(rows) == 28 + 3 and all(len(names) == 1 for names in rows.values())  # magic slices agree
    assert rows["layers.0"] == {"checkpoint-160"} and rows["layers.27"] == {"checkpoint-151"}
    assert all(rows[f"layers.{i}"] == {"checkpoint-100"} for i in (*range(6, 9), *range(11, 21)))
    assert rows["layers.3"] == rows["layers.4"] == {"checkpoint-154"}  # [3, 5] is half-open: 3 and 4
    # [0, 0]: norm, [29, 29]: lm_head, [30, 30]: embed_tokens (merge.py:535-548), as post/pre_weights say
    assert (rows["norm"], rows["lm_head"], rows["embed_tokens"]) == ({"checkpoint-116"}, {"checkpoint-144"},
                                                                      {"checkpoint-147"})


def test_the_llama_example_is_read_as_32_layers():
    rows = sources(LLAMA, 32)
    assert {rows[f"layers.{i}"].pop() for i in range(16)} == {"checkpoint-1"}
    assert {rows[f"layers.{i}"].pop() for i in range(16, 32)} == {"checkpoint-2"}
    assert (rows["norm"], rows["lm_head"], rows["embed_tokens"]) == ({"checkpoint-1"}, {"checkpoint-2"},
                                                                      {"checkpoint-1"})


def test_a_tailor_tui_recipe_is_not_taken_for_llmtailors():
    assert not looks_like("version: 1\nbase: b\nlayers:\n  layers.1: a\n")


@pytest.mark.parametrize("change, layers, message", [
    (lambda t: t.replace("layer_range: [16, 32]", "layer_range: [15, 32]"), 32, "overlaps the slices before it"),
    (lambda t: t.replace("layer_range: [16, 32]", "layer_range: [17, 32]"), 32, "leaves layers 16..16 out"),
    (lambda t: t.replace("layer_range: [16, 32]", "layer_range: [16, 31]"), 32, "layers 31..31 of the model's 32"),
    (lambda t: t.replace("[33, 33]", "[5, 5]"), 32, "none of LLMTailor's magic slices"),
    (lambda t: t, 4, "reaches past the model's 4 layers"),
    (lambda t: t.replace("name: lm_head.weight", "name: model.layers.3.mlp.up_proj.weight"), 32,
     "none of the weights LLMTailor's post_weights name"),
    (lambda t: t.replace("dtype: bfloat16", "parameters: {weight: 0.5}"), 32, "`parameters` sets mixing weights"),
    (lambda t: t.replace("dtype: bfloat16", "tokenizer_source: union"), 32, "`tokenizer_source` builds a tokenizer"),
    (lambda t: t.replace("        layer_range: [0, 16]\n", "        layer_range: [0, 16]\n        weight: 1\n"), 32,
     "unknown key 'weight'"),
])
def test_what_llmtailor_would_not_compose_as_tailor_tui_does_is_one_line(change, layers, message):
    with pytest.raises(RecipeError) as err:
        row_sources(parse(change(LLAMA), "r.yaml"), layers)
    assert message in str(err.value) and "\n" not in str(err.value) and str(err.value).startswith("r.yaml")


@pytest.mark.parametrize("end", ['!!int "\\u00b2"', '!!int "\\u0663"', "3" * 5000, str(1 << 64), "0x20", "032"],
                         ids=lambda v: v if len(v) < 30 else f"{len(v):,} digits")
def test_a_layer_range_yaml_reads_as_an_integer_but_no_plain_whole_number_is_one_line(end):
    """`032` is 26 to mergekit's YAML 1.1 (LLMTailor's reading) and was 32 to tailor-tui: refused, never misread."""
    with pytest.raises(RecipeError) as err:
        parse(LLAMA.replace("layer_range: [16, 32]", f"layer_range: [16, {end}]"), "r.yaml")
    message = str(err.value)
    assert message.startswith("r.yaml:10:") and "slices[2]: `layer_range` must be [first, end]" in message
    assert "plain decimal digits 0-9" in message and "\n" not in message and len(message) < 400, message


@pytest.fixture(scope="module")
def llama(real_run):
    run, _spec = real_run("hf_32_layers")
    return run


def _by_hand(folder: Path, run: Path) -> Path:
    """The tailor-tui recipe Llama_cut.yaml means, written by hand."""
    old = {row: run / "checkpoint-1" for row in ("embed_tokens", "norm", *(f"layers.{i}" for i in range(16)))}
    return write_recipe(folder, run / "checkpoint-2", old, output="by-hand")


def _files(root: Path) -> dict[str, bytes]:
    return {str(f.relative_to(root)): f.read_bytes() for f in sorted(root.rglob("*"))
            if f.is_file() and f.name != PROVENANCE}


def test_llama_cut_composes_what_its_tailor_tui_recipe_does_bit_for_bit(llama, tmp_path):
    recipe = tmp_path / "Llama_cut.yaml"
    shutil.copy(HERE / "Llama_cut.yaml", recipe)  # as it is in LLMTailor's repository
    for args in (("--apply", recipe, "--run", llama, "--output", tmp_path / "llmtailor"),
                 ("--apply", _by_hand(tmp_path, llama))):
        done = tailor(*args)
        assert done.returncode == 0, done.stderr
    ours, theirs = _files(tmp_path / "by-hand"), _files(tmp_path / "llmtailor")
    assert ours.keys() == theirs.keys() and len(ours) > 10
    assert [name for name in ours if ours[name] != theirs[name]] == []
    verified = tailor("--verify", recipe, "--run", llama, "--output", tmp_path / "llmtailor")
    assert verified.returncode == 0, verified.stdout + verified.stderr
    lines = {line.split()[1]: line.split()[2] for line in verified.stdout.splitlines() if line.startswith("ok ")}
    assert lines["layers.15"] == lines["embed_tokens"] == lines["norm"] == "checkpoint-1"
    assert lines["layers.16"] == lines["lm_head"] == "checkpoint-2"
    state, one = read_full_state(tmp_path / "llmtailor"), read_full_state(llama / "checkpoint-1")
    for kind in ("fp32", "exp_avg", "exp_avg_sq"):  # the rows from checkpoint-1 hold its values, not the base's
        assert state[kind]["model.layers.3.mlp.up_proj.weight"].equal(one[kind]["model.layers.3.mlp.up_proj.weight"])


def test_import_writes_the_tailor_tui_recipe_and_shows_every_rows_source(llama, tmp_path):
    out = tmp_path / "fix.yaml"
    done = tailor("--import", HERE / "Llama_cut.yaml", "--run", llama, "--recipe", out)
    assert done.returncode == 0, done.stderr
    shown = {line.split()[0]: line.split(None, 2)[1:] for line in done.stdout.splitlines()[1:-1]}
    assert len(shown) == 35  # 32 layers, embed_tokens, norm, lm_head
    assert shown["layers.0"] == ["checkpoint-1", "slices[1] [0, 16]"]
    assert shown["lm_head"] == ["checkpoint-2", "slices[3] [33, 33], post_weights[0] (lm_head.weight)"]
    assert shown["norm"] == ["checkpoint-1", "slices[0] [0, 0], pre_weights[0] (model.norm.weight)"]
    imported, by_hand = load_recipe(out), load_recipe(_by_hand(tmp_path, llama))
    assert imported.base.resolve() == by_hand.base.resolve()
    assert {r: p.resolve() for r, p in imported.layers.items()} == {r: p.resolve() for r, p in by_hand.layers.items()}
    again = tailor("--import", HERE / "Llama_cut.yaml", "--run", llama, "--recipe", out)
    assert again.returncode == 0, again.stderr  # as tailor-tui wrote it, unchanged: written again
    out.write_text(out.read_text() + "# my note\n")  # a person's now: never replaced in silence
    assert_one_line_error(tailor("--import", HERE / "Llama_cut.yaml", "--run", llama, "--recipe", out),
                          ExitCode.OUTPUT, "not a recipe as tailor-tui wrote it", "--force")
    assert "# my note" in out.read_text()
    assert tailor("--import", HERE / "Llama_cut.yaml", "--run", llama, "--recipe", out, "--force").returncode == 0


def test_model_paths_are_found_beside_the_recipe_or_as_written(llama, tmp_path):
    for name in ("checkpoint-1", "checkpoint-2"):  # the run's checkpoints, with the recipe in their folder
        shutil.copytree(llama / name, tmp_path / name)
    shutil.copy(HERE / "Llama_cut.yaml", tmp_path / "beside.yaml")  # its paths' last names, beside it
    (tmp_path / "written.yaml").write_text(LLAMA.replace(OLD, str(llama)))  # the paths as written
    for name in ("beside.yaml", "written.yaml"):
        done = tailor("--apply", tmp_path / name, "--dry-run")
        assert done.returncode == 0, done.stderr
        assert "checkpoint-2" in done.stdout


@pytest.mark.parametrize("change, with_run, needles", [
    (lambda t: t.replace("        layer_range: [16, 32]\n", "        layer_range: [16, 32]\n      - model: "
                         f"{OLD}/checkpoint-1\n        layer_range: [16, 32]\n"), True, ("has 2 sources",)),
    (lambda t: t.replace("merge_method: passthrough", "merge_method: slerp"), True, ("merge_method 'slerp'",)),
    (lambda t: t.replace("layer_range: [16, 32]", "layer_range: [8, 32]"), True, ("overlaps",)),
    (lambda t: t.replace(f"name: lm_head.weight\n    model: {OLD}/checkpoint-2",
                         f"name: lm_head.weight\n    model: {OLD}/checkpoint-1"), True,
     ("post_weights[0] (lm_head.weight) takes lm_head from checkpoint-1, slices[3]", "from checkpoint-2")),
    (lambda t: t.replace("checkpoint-2\n        layer_range: [16, 32]", "checkpoint-9\n        layer_range: [16, 32]"),
     True, ("r.yaml:9:16: slices[2]", "has no checkpoint-9")),
    (lambda t: t, False, ("r.yaml:3:", f"model {OLD}/checkpoint-1: no such folder", "--run RUN_DIR")),
    (lambda t: t.replace("dtype: bfloat16", "dtype: float32"), True, ("dtype float32 would cast", "bf16")),
])
def test_refusals_are_one_line_with_the_recipe_exit_code(llama, tmp_path, change, with_run, needles):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(change(LLAMA))
    done = tailor("--apply", recipe, *(("--run", llama) if with_run else ()), "--output", tmp_path / "out")
    assert_one_line_error(done, ExitCode.RECIPE, *needles)
    assert not (tmp_path / "out").exists()


def test_run_goes_with_llmtailor_recipes_only(llama, tmp_path):
    done = tailor("--apply", _by_hand(tmp_path, llama), "--run", llama)
    assert_one_line_error(done, ExitCode.USAGE, "is a tailor-tui recipe", "--run goes with an LLMTailor recipe")


def test_the_composer_loads_llama_cut_with_its_paths_found_in_the_open_run(llama):
    """What ctrl+o does (ui.composer.ComposerScreen.adopt_recipe): the run it has open is where the paths are."""
    comp = RecipeDraft.start(list(scan(llama).checkpoints))
    recipe = load_recipe(HERE / "Llama_cut.yaml", run=llama)
    comp.load(recipe)
    names = {row: comp.checkpoints[column].name for row, column in comp.picks.items()}
    assert names == {row: "checkpoint-1" for row in ("embed_tokens", "norm", *(f"layers.{i}" for i in range(16)))}
    assert comp.base_checkpoint.name == "checkpoint-2" and recipe.converted_from == "LLMTailor"


def test_import_without_recipe_writes_beside_the_llmtailor_file_never_over_it(llama, tmp_path):
    recipe = tmp_path / "Llama_cut.yaml"
    shutil.copy(HERE / "Llama_cut.yaml", recipe)
    (tmp_path / "Llama_cut.tailor-tui.yaml").write_text("# mine\n")  # taken: the next name
    done = tailor("--import", recipe, "--run", llama)
    assert done.returncode == 0, done.stderr
    assert recipe.read_text() == LLAMA and (tmp_path / "Llama_cut.tailor-tui.yaml").read_text() == "# mine\n"
    written = tmp_path / "Llama_cut.tailor-tui-2.yaml"
    assert f"wrote {written}" in done.stdout
    assert load_recipe(written).layers.keys() == load_recipe(_by_hand(tmp_path, llama)).layers.keys()


async def test_the_composer_saves_an_llmtailor_recipes_picks_beside_it_and_asks_before_replacing_it(llama, tmp_path):
    """Issue 60 (4): ctrl+s on an opened LLMTailor recipe offers a tailor-tui recipe beside it; the LLMTailor file
    itself is replaced only when named and confirmed, the dialog saying what would be lost."""
    recipe = tmp_path / "Llama_cut.yaml"
    shutil.copy(HERE / "Llama_cut.yaml", recipe)
    app = make_app(llama, recipe=recipe)
    async with app.run_test(size=(130, 32)) as pilot:
        await scanned(pilot)
        assert len(app.home.draft.picks) == 18  # its picks, on screen
        await pilot.press("ctrl+s")
        await wait_for(pilot, lambda: isinstance(app.screen, PathPrompt))
        assert app.screen.query_one(Input).value == str(tmp_path / "Llama_cut.tailor-tui.yaml")
        assert "stays as it is" in app.screen.title_text
        await pilot.press("enter")
        await wait_for(pilot, lambda: len(app.screen_stack) == 1)
        saved = load_recipe(tmp_path / "Llama_cut.tailor-tui.yaml")
        by_hand = load_recipe(_by_hand(tmp_path, llama))
        assert {r: p.resolve() for r, p in saved.layers.items()} == {r: p.resolve() for r, p in by_hand.layers.items()}
        await pilot.press("S")  # save as the LLMTailor file: asked, saying what it would lose
        await wait_for(pilot, lambda: isinstance(app.screen, PathPrompt))
        app.screen.query_one(Input).value = str(recipe)
        await pilot.press("enter")
        await wait_for(pilot, lambda: isinstance(app.screen, Confirm))
        assert "LLMTailor" in app.screen.title_text and "slices" in app.screen.body
        await pilot.press("escape")
        await wait_for(pilot, lambda: len(app.screen_stack) == 1)
    assert recipe.read_text() == LLAMA


def test_an_llmtailor_recipe_whose_every_tailor_tui_name_is_taken_is_one_line(tmp_path):
    """`converted_path` never writes over a file: past `-9999` it asks for a name (RecipeError, one line)."""
    from tailor_tui.planning.recipe_file import converted_path

    source = tmp_path / "cut.yaml"
    for n in range(1, 10_000):
        (tmp_path / f"cut.tailor-tui{'' if n == 1 else f'-{n}'}.yaml").touch()
    with pytest.raises(RecipeError, match=r"holds cut\.tailor-tui\.yaml to -9999; name the recipe to write"):
        converted_path(source)
    (tmp_path / "cut.tailor-tui-17.yaml").unlink()
    assert converted_path(source) == tmp_path / "cut.tailor-tui-17.yaml"  # the first free one
