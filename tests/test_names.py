"""Names are data (issue 43): folder names holding markup, terminal control sequences, newlines
and bidi overrides are shown as what they are — in the composer (never markup: no MarkupError)
and in every headless command (escaped as repr writes them: nothing reaches the terminal, a
one-line refusal stays one line) — and thousands of broken checkpoint-like folders give one
notice while the composer stays responsive."""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import unicodedata
from pathlib import Path

import pytest
from helpers import TAILOR, assert_one_line_error, tailor
from pilot_helpers import compose_finished, private_copy, scan_notices, scanned, start_composing, wait_for

from tailor_tui.cli.composer_command import ended
from tailor_tui.ui.app import make_app
from tailor_tui.ui.composer import ComposerScreen
from tailor_tui.ui.dialogs import Confirm, ErrorDialog
from tailor_tui.units import shown

# What a downloaded run's folder may be named: erase the screen, retitle the terminal (OSC … BEL),
# Textual markup (a link, a style, an action), a newline that would forge a
# line, a carriage return, a bidi override that reads the rest backwards.
HOSTILE = "\x1b[2J\x1b]0;pwned\x07[link=a:b][bold]x[@click=quit]\nerror: forged\r\u202e"
CONTROLS = {chr(c) for c in [*range(0x20), *range(0x7F, 0xA0), 0x202E]} - {"\n"}
SIZE = (130, 32)


def junk_checkpoint(folder: Path, step: int) -> Path:
    """A folder that looks like an HF checkpoint (`latest` naming a tag of rank files) and holds junk."""
    tag = folder / f"global_step{step}"
    tag.mkdir(parents=True)
    (folder / "latest").write_text(tag.name)
    (tag / "zero_pp_rank_0_mp_rank_00_model_states.pt").write_bytes(b"junk")
    return folder


def hostile_run(real_run, tmp_path: Path, run_name: str = "run") -> tuple[Path, Path, Path]:
    """A copy of a real HF run whose middle checkpoint has a hostile name, beside a broken
    checkpoint-like folder with one too: (run, the hostile checkpoint, the newest checkpoint)."""
    run, ckpts = private_copy(real_run, tmp_path, "hf_bf16_2", folder=run_name)
    named = ckpts[1].rename(run / f"checkpoint-{HOSTILE}-4")
    junk_checkpoint(run / f"checkpoint-7{HOSTILE}", 7)
    return run, named, ckpts[2]


def assert_no_control_codes(*texts: str) -> None:
    for text in texts:
        assert not CONTROLS & set(text), repr(text)


def recipe(folder: Path, base: Path, layers: dict[str, Path], output: Path) -> Path:
    """A recipe naming paths that YAML writes only escaped (JSON's strings are YAML's)."""
    path = folder / "recipe.yaml"
    path.write_text("\n".join(["version: 1", f"base: {json.dumps(str(base))}", f"output: {json.dumps(str(output))}",
                               "layers:", *(f"  {row}: {json.dumps(str(src))}" for row, src in layers.items())]) + "\n")
    return path


# --- the headless commands ----------------------------------------------------------------------


def test_stats_prints_hostile_names_escaped(real_run, tmp_path):
    run, named, _newest = hostile_run(real_run, tmp_path)
    result = tailor("--stats", run)
    assert result.returncode == 0, result.stderr
    assert_no_control_codes(result.stdout, result.stderr)
    assert shown(named.name) in result.stdout.splitlines()[0]  # the table's header names it, escaped
    assert "\\x1b[2J\\x1b]0;pwned\\x07[link=a:b]" in result.stdout
    table = result.stdout.split("\n\n")[0].splitlines()  # its columns aligned as printed, escapes and all
    assert len(table) > 3 and len({len(line) for line in table}) == 1, table
    skipped = [line for line in result.stderr.splitlines() if line.startswith("warning: skipped")]
    assert len(skipped) == 1 and "checkpoint-7\\x1b[2J" in skipped[0]
    assert not any(line.startswith("error: forged") for line in (result.stdout + result.stderr).splitlines())


def test_dry_run_apply_and_verify_print_hostile_names_escaped(real_run, tmp_path):
    run, named, newest = hostile_run(real_run, tmp_path)
    path = recipe(tmp_path, named, {"layers.0": newest}, output=tmp_path / f"out{HOSTILE}")
    planned = tailor("--apply", path, "--dry-run")
    assert planned.returncode == 0, planned.stderr
    assert_no_control_codes(planned.stdout, planned.stderr)
    assert "dry run: nothing written" in planned.stdout and shown(named.name) in planned.stdout
    applied = tailor("--apply", path, "--progress", "lines")
    assert applied.returncode == 0, applied.stderr
    assert_no_control_codes(applied.stdout, applied.stderr)
    assert applied.stdout.startswith("done: ") and len(applied.stdout.splitlines()) == 1
    verified = tailor("--verify", path)
    assert verified.returncode == 0, verified.stdout + verified.stderr
    assert_no_control_codes(verified.stdout, verified.stderr)
    assert f"verified: every row of {shown(tmp_path / f'out{HOSTILE}')} matches" in verified.stdout


def test_a_refusal_stays_one_line_whatever_the_names_hold(real_run, tmp_path):
    run, named, newest = hostile_run(real_run, tmp_path)
    missing = run / f"checkpoint-6{HOSTILE}"  # no such folder: refused, naming it
    result = tailor("--apply", recipe(tmp_path, missing, {"layers.0": newest}, output=tmp_path / "out"))
    assert_one_line_error(result, 4, shown(missing.name))
    assert_no_control_codes(result.stdout, result.stderr)
    assert len(result.stderr.splitlines()) == 1


# --- names that pass for others (issue 58) ---------------------------------------------------------

# Format characters (Unicode category Cf), unseen in a terminal: a soft hyphen, a zero-width space,
# non-joiner and joiner, a word joiner, a BOM, an invisible operator, a tag
FORMAT = "\u00ad\u200b\u200c\u200d\u2060\ufeff\u2061\U000e0001"


def test_every_format_character_is_shown_escaped_and_other_names_as_they_are():
    cf = [chr(c) for c in range(sys.maxunicode + 1) if unicodedata.category(chr(c)) == "Cf"]
    assert len(cf) > 150 and set(FORMAT) <= set(cf)
    assert [c for c in cf if shown(f"a{c}b") != f"a{repr(c)[1:-1]}b" or "\\" not in shown(c)] == []
    assert shown("checkpoint-\u200b6\ufeff") == "checkpoint-\\u200b6\\ufeff"
    ordinary = "checkpoint-６ é 中文 ﬁ Ω 🙂 ~!@#$%^&*()[]{}"
    assert shown(ordinary) == ordinary


def test_stats_and_heal_show_format_characters_escaped(real_run, tmp_path):
    run, ckpts = private_copy(real_run, tmp_path, "hf_bf16_2")
    ckpts[0].rename(run / "checkpoint-\u00ad2\u2060")  # reads as checkpoint-2: no other checkpoint does
    ckpts[2].rename(run / "checkpoint-6\ufeff")
    stats = tailor("--stats", run)
    assert stats.returncode == 0, stats.stderr
    header = stats.stdout.splitlines()[0]
    assert "checkpoint-\\xad2\\u2060" in header and "checkpoint-6\\ufeff" in header, header
    healed = tailor("--heal", run, "--recipe", tmp_path / "fix.yaml")
    assert healed.returncode == 0, healed.stderr
    assert healed.stdout.startswith("base: checkpoint-6\\ufeff;"), healed.stdout
    assert not set(FORMAT) & set(stats.stdout + stats.stderr + healed.stdout + healed.stderr)


@pytest.mark.parametrize("twin", ["checkpoint-6\u200b", "checkpoint-\u20606", "\ufeffcheckpoint-6",
                                  "checkpoint-\uff16", "checkpoint\u00ad-6"])
def test_a_checkpoint_whose_name_reads_as_another_is_refused_naming_both(real_run, tmp_path, twin):
    """A copy of checkpoint-6 named with an invisible character, or a fullwidth `６`, would be a second
    `checkpoint-6` in the table, the recipe and the healing lines: the scan refuses the run."""
    run, ckpts = private_copy(real_run, tmp_path, "hf_bf16_2")
    shutil.copytree(ckpts[2], run / twin)
    for args in (("--stats", run), ("--heal", run, "--recipe", tmp_path / "fix.yaml")):
        result = tailor(*args)
        assert_one_line_error(result, 4, f"checkpoint folders checkpoint-6 and {shown(twin)} read as one name "
                              "(checkpoint-6)", "rename or remove one")
        assert not set(FORMAT) & set(result.stderr), result.stderr
    assert not (tmp_path / "fix.yaml").exists()


async def test_the_composer_refuses_a_run_whose_checkpoint_names_read_as_one(real_run, tmp_path):
    run, ckpts = private_copy(real_run, tmp_path, "hf_bf16_2")
    shutil.copytree(ckpts[2], run / "checkpoint-6\u200b")
    app = make_app(run, workers=1)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: isinstance(app.screen, ErrorDialog))
        assert "read as one name (checkpoint-6)" in app.screen.message
        await pilot.pause()
        body = app.screen.query_one(".dialog-body").render().plain
        assert "checkpoint-6 and checkpoint-6\\u200b read as one name" in body and "\u200b" not in body


# --- the composer ---------------------------------------------------------------------------------


async def test_hostile_names_show_as_text_in_every_part_of_the_composer(real_run, tmp_path):
    # the run's own folder is hostile too, and long: its checkpoints' paths are over 300 characters
    run_name = f"run{HOSTILE}{'[' * 8}{'y' * 150}"
    run, named, _newest = hostile_run(real_run, tmp_path, run_name)
    assert len(str(named)) > 300
    app = make_app(run, workers=1)
    async with app.run_test(size=SIZE, notifications=True) as pilot:
        notices = await scan_notices(pilot)
        assert len(notices) == 1 and notices[0].title.startswith("Skipped checkpoint-7\\x1b[2J")
        await scanned(pilot)
        assert [c.path for c in app.home.draft.checkpoints][1] == named
        grid = app.query_one("#grid")
        header = grid.render_line(0).text  # scrolled to the base: the long name's end in view
        assert "[bold]x[@click=quit]\\nerror: forged\\r\\u202e-4" in header  # as written, escaped
        title = app.query_one("#title").render().plain
        assert title.startswith("tailor-tui · ") and "y" * 8 in title
        await pilot.press("left")  # the hostile checkpoint's column: its name and path in the details
        await pilot.pause()
        details = app.query_one("#details").render().plain
        assert shown(named.name) in details and shown(run_name) in details
        await pilot.press("space", "ctrl+r")  # a row from it: the plan names it
        await wait_for(pilot, lambda: isinstance(app.screen, Confirm))
        body = app.screen.query_one(".dialog-body").render().plain
        assert shown(named.name) in body
        await pilot.press("escape")
        progress = await start_composing(pilot)
        await wait_for(pilot, lambda: not progress.running, tries=2400)
        assert shown(run_name) in progress.query_one("#compose-status").render().plain  # "Done: <its path>"
        await compose_finished(pilot)
        await pilot.pause()
        texts = [grid.render_line(y).text for y in range(grid.size.height)]
        texts += [app.query_one("#title").render().plain, app.query_one("#details").render().plain]
        texts += [n.message + n.title for n in notices]
        assert_no_control_codes(*texts)
    assert (run / "checkpoint-6-tailored" / "latest").is_file()


async def test_an_error_that_ends_the_composer_is_one_line_and_a_logged_traceback(run_copy_hf, tmp_path, capsys,
                                                                                  monkeypatch):
    monkeypatch.setenv("TAILOR_TUI_CACHE", str(tmp_path / "cache"))

    def broken(self) -> None:
        raise RuntimeError(f"a bug, quoting {HOSTILE}")

    monkeypatch.setattr(ComposerScreen, "action_pick", broken)
    app = make_app(run_copy_hf)
    with pytest.raises(RuntimeError, match="a bug"):  # the pilot raises what ended the app
        async with app.run_test(size=SIZE) as pilot:
            await scanned(pilot)
            await pilot.press("space")
            await pilot.pause()
    capsys.readouterr()
    assert ended(app) == 1
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith("error: the composer stopped on an internal error")
    assert "RuntimeError: a bug, quoting \\x1b[2J" in err
    assert_no_control_codes(err)
    log = Path(err.split("its traceback is in ")[1].split("; ")[0])
    assert log.parent == tmp_path / "cache" / "crashes"
    assert "Traceback" in log.read_text() and "in broken" in log.read_text()


# A bug injected into the real entry point (`apply` raising), run as its own process.
HEADLESS_BUG = ("import sys\nimport tailor_tui.cli.apply_command as command\nimport tailor_tui.cli.main as cli\n"
                "def apply(args):\n    raise RuntimeError('a bug, quoting ' + sys.argv[1])\n"
                "command.apply_command = apply\nsys.exit(cli.main(['--apply', 'recipe.yaml']))\n")


def test_an_error_that_ends_a_headless_command_is_one_line_and_a_logged_traceback(tmp_path):
    result = subprocess.run([sys.executable, "-c", HEADLESS_BUG, HOSTILE], capture_output=True, text=True,
                            env={**os.environ, "TAILOR_TUI_CACHE": str(tmp_path / "cache")})
    assert result.returncode == 1, result.stderr
    assert len(result.stderr.splitlines()) == 1, result.stderr
    assert result.stderr.startswith("error: tailor-tui --apply stopped on an internal error (RuntimeError: a bug, "
                                    "quoting \\x1b[2J")
    assert_no_control_codes(result.stderr)
    log = Path(result.stderr.split("its traceback is in ")[1].split("; ")[0])
    assert log.parent == tmp_path / "cache" / "crashes"
    assert "Traceback" in log.read_text() and "in apply" in log.read_text()


# A pipe of its own breaking (a worker's, multiprocessing's resource tracker gone), while stdout is fine.
OWN_PIPE_BROKEN = ("import sys\nimport tailor_tui.cli.apply_command as command\nimport tailor_tui.cli.main as cli\n"
                   "def apply(args):\n    raise BrokenPipeError(32, 'Broken pipe')\n"
                   "command.apply_command = apply\nsys.exit(cli.main(['--apply', 'recipe.yaml']))\n")


def test_a_broken_pipe_of_its_own_is_an_error_only_a_gone_reader_is_not(real_run, tmp_path):
    """`tailor-tui --stats RUN | true` (a reader that has seen enough before anything was written) ends
    quietly with 0; a pipe of its own that breaks is an error, one line, exit 1. It used to end with 0,
    silently, as if done."""
    result = subprocess.run([sys.executable, "-c", OWN_PIPE_BROKEN], capture_output=True, text=True,
                            env={**os.environ, "TAILOR_TUI_CACHE": str(tmp_path / "cache")})
    assert result.returncode == 1 and result.stderr.startswith(
        "error: tailor-tui --apply stopped on an internal error (BrokenPipeError"), result.stderr
    run, _spec = real_run("hf_bf16_2")
    piped = subprocess.run(f"set -o pipefail; {TAILOR} --stats {run} | true", shell=True, capture_output=True,
                           text=True, executable="/bin/bash", env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert piped.returncode == 0 and "error" not in piped.stderr, piped.stderr


@pytest.fixture
def run_copy_hf(real_run, tmp_path) -> Path:
    return private_copy(real_run, tmp_path, "hf_bf16_2")[0]


# --- thousands of broken checkpoint-like folders --------------------------------------------------

BROKEN = 3000


async def key_round_trips(pilot, presses: int = 8) -> float:
    """The median time from a key press until the app has handled it and redrawn."""
    times = []
    for key in ["down", "up"] * (presses // 2):
        started = time.perf_counter()
        await pilot.press(key)
        await pilot.pause()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


async def test_thousands_of_broken_folders_give_one_notice_and_keys_stay_quick(real_run, tmp_path):
    clean, _ckpts = private_copy(real_run, tmp_path, "hf_bf16_2", folder="clean")
    run = tmp_path / "run"
    shutil.copytree(clean, run)
    for i in range(BROKEN):
        junk_checkpoint(run / f"checkpoint-{100 + i}", 100 + i)
    app = make_app(clean, workers=1)
    async with app.run_test(size=SIZE, notifications=True) as pilot:
        await scanned(pilot)
        baseline = await key_round_trips(pilot)
    app = make_app(run, workers=1)
    async with app.run_test(size=SIZE, notifications=True) as pilot:
        notices = await scan_notices(pilot)
        await scanned(pilot)
        assert len(app.home.scan_result.problems) == BROKEN
        assert len(notices) == 1 and notices[0].title == f"Skipped {BROKEN:,} folders"
        first = ", ".join(f"checkpoint-{n}/global_step{n}" for n in (100, 1000, 1001))  # the tags of junk
        assert notices[0].message.startswith(f"{first} and 2,997 more: they look like checkpoints")
        details = app.query_one("#details").render().plain
        assert f"skipped while scanning ({BROKEN}):" in details and "… and 2,980 more" in details
        hostile = await key_round_trips(pilot)
    # a key under 100 ms, or (a loaded CI machine) no slower than twice the same key on a clean run
    assert hostile < max(0.1, 2 * baseline + 0.02), (hostile, baseline)
