"""A run's training logs (trainer_state.json's `log_history`) as hostile input (issue 58): a number
past 64 bits is taken for absent, with a note, by `--stats`, `--heal` and the composer's curve —
never an internal error (a 401-digit loss overflowed `float()`) nor a log dropped without a word
(past 4,300 digits `int()` refuses to read one at all); and three long logs are compared, entry
for entry, in bounded memory (the run-lineage check kept a repr() of every entry of every
checkpoint: 2 GB and a minute for three logs of 64 MiB). On copies of a real HF Trainer run."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
from helpers import assert_one_line_error, tailor, tailor_peak
from refusal_cases import log_numbers

from tailor_tui.health.healing import training_curve
from tailor_tui.kinds.folders import HF

WIDE = "9" * 401  # a 401-digit integer
WIDER = "1" + "0" * 4_999  # past the 4,300 digits Python's int() reads


@pytest.fixture
def run(real_run, tmp_path) -> Path:
    """A copy of an HF run (checkpoint-2, -4, -6; a log entry every step) with its own statistics cache."""
    source, _ = real_run("hf_bf16_2")
    shutil.copytree(source, tmp_path / "run")
    return tmp_path / "run"


def logged(run: Path) -> dict[int, dict]:
    return {e["step"]: e for e in json.loads((run / "checkpoint-6" / "trainer_state.json").read_text())["log_history"]}


def test_integers_past_64_bits_in_the_log_are_ignored_with_a_note(run, tmp_path):
    """In every checkpoint's log alike (one run still): the loss logged at step 2 and the step of the
    entry at step 4 are 401-digit integers, a grad norm at step 5 has 5,000 digits, a learning rate
    at step 1 is 1e999 and an epoch at step 3 NaN. `--stats` and `--heal` take each integer for
    absent — checkpoint-2's loss is the one logged at step 1, checkpoint-4's the one at step 3,
    checkpoint-6's its own (the log is still read) — and say so in one note per file; the floats
    (inf, nan) are read as floats."""
    before = logged(run)
    log_numbers(run, {1: {"learning_rate": "1e999"}, 2: {"loss": WIDE}, 3: {"epoch": "NaN"}, 4: {"step": WIDE},
                      5: {"grad_norm": WIDER}})
    env = {"TAILOR_TUI_CACHE": str(tmp_path / "cache")}
    result = tailor("--stats", run, "--json", env=env)
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
    checkpoints = {c["name"]: c for c in json.loads(result.stdout)["checkpoints"]}
    for name, step in (("checkpoint-2", 1), ("checkpoint-4", 3), ("checkpoint-6", 6)):
        assert (checkpoints[name]["loss"], checkpoints[name]["grad_norm"]) == \
            (before[step]["loss"], before[step]["grad_norm"]), name
    notes = [line for line in result.stderr.splitlines() if line.startswith("note: ")]
    assert notes == [
        f"note: {run}/checkpoint-2/trainer_state.json: 1 integer past 64 bits ignored, read as absent "
        "(the first: 'loss' of the log entry at step 2, 401 digits)",
        f"note: {run}/checkpoint-4/trainer_state.json: 2 integers past 64 bits ignored, read as absent "
        "(the first: 'loss' of the log entry at step 2, 401 digits)",
        f"note: {run}/checkpoint-6/trainer_state.json: 3 integers past 64 bits ignored, read as absent "
        "(the first: 'loss' of the log entry at step 2, 401 digits)"], result.stderr
    recipe = tmp_path / "healed.yaml"
    result = tailor("--heal", run, "--recipe", recipe, env=env)
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
    assert recipe.is_file() and sum(line.startswith("note: ") for line in result.stderr.splitlines()) == 3


async def test_the_composer_opens_a_run_whose_log_holds_them_and_says_so(run):
    """The composer, which stopped on an internal error opening such a run: its grid, each
    checkpoint's loss as `--stats` reads it, one notice for the logs' notes."""
    from pilot_helpers import scan_notices, scanned

    from tailor_tui.ui.app import make_app

    before = logged(run)
    log_numbers(run, {2: {"loss": WIDE}, 4: {"step": WIDE}})
    app = make_app(run, workers=1)
    async with app.run_test(size=(130, 32), notifications=True) as pilot:
        notices = await scan_notices(pilot)
        assert [n.title for n in notices] == ["Training log"], notices
        assert notices[0].message == (f"{run}/checkpoint-2/trainer_state.json: 1 integer past 64 bits ignored, read as "
                                      "absent (the first: 'loss' of the log entry at step 2, 401 digits) (and 2 more "
                                      "such logs)")
        await scanned(pilot)
        assert [log.loss for log in app.home.health_pane.health.logs.values()] == [before[s]["loss"] for s in (1, 3, 6)]


def test_the_curve_leaves_out_what_is_past_64_bits(tmp_path):
    """The composer's curve (read in the scan's worker): an entry whose step or loss is past 64
    bits is left out, one whose grad norm is keeps its loss; 1e999 is an infinite loss, left out
    as every non-finite one is."""
    folder = tmp_path / "checkpoint-6"
    folder.mkdir()
    entries = ['{"step": 1, "loss": 3.0}', f'{{"step": {WIDE}, "loss": 2.9}}', f'{{"step": 3, "loss": -{WIDE}}}',
               f'{{"step": 4, "loss": 2.5, "grad_norm": {WIDER}}}', '{"step": 5, "loss": 1e999}',
               '{"step": 6, "loss": 2.0, "grad_norm": 18446744073709551615}']
    (folder / "trainer_state.json").write_text('{"log_history": [' + ", ".join(entries) + "]}")
    curve = training_curve([SimpleNamespace(path=folder, step=6, folder=HF)])
    assert (curve.steps, curve.losses) == ((1, 4, 6), (3.0, 2.5, 2.0))
    assert (curve.grad_steps, curve.grad_norms) == ((6,), (float(2**64 - 1),))


ENTRIES = 100_000  # per log: 14 MB as the Trainer writes it (indented); before issue 58, --stats peaked at 316 MiB (608
# MiB at 200,000: a repr() string per entry per checkpoint)
PEAK = 160 << 20  # measured on a 2-core machine at 200,000 entries: 113 MiB, 114 MiB where two logs are read again


def long_log(run: Path, entries: int, seed: int = 0) -> list[dict]:
    """Every checkpoint's trainer_state.json holding the same log of `entries` entries, all at or
    before step 2 (so every checkpoint's history is compared whole), as the Trainer writes it."""
    rng = random.Random(seed)
    history = [{"epoch": i / 64, "grad_norm": round(rng.random() * 2, 6), "learning_rate": round(rng.random() / 1e3, 8),
                "loss": round(4 + rng.random(), 4), "step": i * 3 // entries} for i in range(entries)]
    for state in sorted(run.glob("checkpoint-*/trainer_state.json")):
        doc = json.loads(state.read_text())
        doc["log_history"] = history
        state.write_text(json.dumps(doc, indent=2, sort_keys=True))
    return history


def test_three_long_logs_are_compared_in_bounded_memory(run, tmp_path):
    """Three checkpoints' logs of 100,000 entries each: `--stats` compares them whole (one run) under
    160 MiB at its peak (each entry read one at a time and kept as its step and a digest); the same
    logs with one value changed deep in checkpoint-4's are two runs, the line naming the step where
    they part; with checkpoint-4's rewritten in another layout, keys in another order and its
    numbers spelled otherwise (the same values), one run again."""
    history = long_log(run, ENTRIES)
    env = {"TAILOR_TUI_CACHE": str(tmp_path / "cache")}
    result, peak = tailor_peak("--stats", run, env=env)
    assert result.returncode == 0 and "note:" not in result.stderr, result.stderr
    assert peak < PEAK, f"{peak >> 20} MiB"
    state = run / "checkpoint-4" / "trainer_state.json"
    doc = json.loads(state.read_text())
    doc["log_history"][ENTRIES * 3 // 4]["loss"] += 1  # an entry at step 2
    state.write_text(json.dumps(doc, indent=2, sort_keys=True))
    result, peak = tailor_peak("--stats", run, env=env)
    assert_one_line_error(result, 2, "holds checkpoints of 2 training runs", "checkpoint-2, checkpoint-6; checkpoint-4",
                          "their training logs (trainer_state.json) differ at step 2")
    assert peak < PEAK + (32 << 20), f"{peak >> 20} MiB"  # two logs read again side by side
    doc["log_history"] = [dict(reversed(entry.items())) for entry in history]
    state.write_text(json.dumps(doc).replace('"epoch": 0.0,', '"epoch": 0.000e5,'))
    result = tailor("--stats", run, env=env)
    assert result.returncode == 0, result.stderr
