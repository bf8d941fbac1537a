"""The real `tailor-tui` entry point, run in a subprocess as a batch job would."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest
from conftest import checkpoints_of, tree_digest
from helpers import assert_one_line_error, finish, start_tailor, tailor, wait_for_line, write_recipe

from tailor_tui.units import size


def test_apply_composes_and_logs_plain_progress_lines(real_run, tmp_path):
    run, spec = real_run("hf_bf16_2")
    c2, c4, c6 = checkpoints_of(run, spec)
    recipe = write_recipe(tmp_path, c6, {"layers.1": c4, "embed_tokens": c2})
    before = tree_digest(run)
    result = tailor("--apply", recipe, "--workers", "2")
    assert result.returncode == 0, result.stderr
    out = tmp_path / "composed"  # relative output resolves against the recipe's folder
    assert (out / "global_step6" / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt").is_file()
    # progress counts one thing, bytes written: each task's total is the size of the file it writes
    tag = out / "global_step6"
    for task, written in (("rank 0", tag / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"),
                          ("rank 1", tag / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"),
                          ("model file", out / "model.safetensors")):
        assert f"{task}: done, " in result.stderr
        if task.startswith("rank"):  # a rank's task writes its optim and model_states files
            states = tag / f"zero_pp_rank_{task[-1]}_mp_rank_00_model_states.pt"
            expected = written.stat().st_size + states.stat().st_size
        else:
            expected = written.stat().st_size
        assert f"{task}: done, {size(expected)} written" in result.stderr
    total = sum(f.stat().st_size for f in out.rglob("*") if f.is_file() and f.name != "tailor_provenance.json")
    assert f"{size(total)} to write" in result.stderr and f"({size(total)} written in" in result.stdout
    assert "\x1b[" not in result.stderr  # no terminal codes in logs
    assert f"done: {out}" in result.stdout
    assert tree_digest(run) == before
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp folder left


def test_progress_auto_draws_bars_on_a_terminal_and_lines_in_a_log(real_run, tmp_path):
    """`--progress auto` (the default) picks by whether stderr is a terminal: a pty gets live bars (terminal codes),
    a pipe plain lines (the test above: no terminal code)."""
    import pty

    from helpers import TAILOR

    run, spec = real_run("hf_bf16_2")
    c2, c4, c6 = checkpoints_of(run, spec)
    recipe = write_recipe(tmp_path, c6, {"layers.1": c4})
    mine, theirs = pty.openpty()
    try:
        proc = subprocess.Popen([TAILOR, "--apply", str(recipe), "--progress", "auto"], stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=theirs, env=dict(os.environ, COLUMNS="100"))
        os.close(theirs)  # (its end: read to the end once the command exits)
        drawn = b""
        while chunk := _read_pty(mine):  # read as it is drawn: a full terminal would hold the command
            drawn += chunk
        code = proc.wait(timeout=300)
    finally:
        os.close(mine)
    assert code == 0, drawn.decode(errors="replace")
    assert b"\x1b[" in drawn and b"rank 1" in drawn, drawn  # bars, redrawn in place
    lines = tailor("--apply", recipe, "--progress", "auto", "--force")
    assert lines.returncode == 0 and "\x1b[" not in lines.stderr and "rank 1: done, " in lines.stderr, lines.stderr


def _read_pty(fd: int) -> bytes:
    try:
        return os.read(fd, 1 << 16)
    except OSError:  # (EIO: the other end closed, all read)
        return b""


def test_output_flag_overrides_the_recipe(real_run, tmp_path):
    run, spec = real_run("ds_bf16_3_subgroups")
    c2, _, c6 = checkpoints_of(run, spec)
    recipe = write_recipe(tmp_path, c6, {"layers.2": c2}, output=None)
    result = tailor("--apply", recipe, "--output", tmp_path / "elsewhere", "-j", "1")
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "elsewhere" / "latest").read_text() == "global_step6"
    assert (tmp_path / "elsewhere" / "zero_to_fp32.py").is_file()


def test_dry_run_prints_the_plan_and_writes_nothing(real_run, tmp_path):
    run, spec = real_run("hf_bf16_2")
    c2, c4, c6 = checkpoints_of(run, spec)
    recipe = write_recipe(tmp_path, c6, {"layers.1": c4})
    result = tailor("--apply", recipe, "--dry-run")
    assert result.returncode == 0, result.stderr
    assert "layers.1" in result.stdout and "checkpoint-4" in result.stdout and "(step 4)" in result.stdout
    assert "read:" in result.stdout and "write:" in result.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["recipe.yaml"]


@pytest.mark.parametrize(
    "mutate, code, needles",
    [
        (lambda r: r.write_text("version: 1\nbase: [x\n"), 3, ["recipe.yaml:3:1", "malformed YAML"]),
        (lambda r: r.write_text(r.read_text() + "extra: 1\n"), 3, ["unknown key 'extra'"]),
        (lambda r: r.write_text("version: 1\noutput: o\n"), 3, ["missing `base:`"]),
        (lambda r: r.write_text(r.read_text() + "  layers.9: x\n"), 3, ["unknown row 'layers.9'"]),
        (lambda r: r.write_text(r.read_text().replace("checkpoint-4", "checkpoint-44")), 4,
         ["row 'layers.1'", "checkpoint-44: no such checkpoint folder; did you mean 'checkpoint-4'? check the path"]),
        (lambda r: r.write_text(r.read_text().replace("checkpoint-4", "chekpoint-4")), 4,
         ["chekpoint-4: no such checkpoint folder; did you mean 'checkpoint-4'? check the path"]),
        (lambda r: r.write_text(r.read_text().replace("checkpoint-4", "elsewhere")), 4,
         ["elsewhere: no such checkpoint folder; check the path"]),
    ],
    ids=["malformed-yaml", "unknown-key", "missing-base", "unknown-row", "missing-checkpoint", "mistyped-checkpoint",
         "unlike-any-checkpoint"],
)
def test_bad_recipes_fail_with_one_line_and_write_nothing(real_run, tmp_path, mutate, code, needles):
    run, spec = real_run("hf_bf16_2")
    c2, c4, c6 = checkpoints_of(run, spec)
    recipe = write_recipe(tmp_path, c6, {"layers.1": c4})
    mutate(recipe)
    result = tailor("--apply", recipe)
    assert_one_line_error(result, code, *needles)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["recipe.yaml"]


@pytest.mark.parametrize("other, needle", [
    ("hf_bf16_2_wider_mlp", "model.layers.0.mlp.gate_proj.weight has shape [64, 32], the base [48, 32]"),
    ("hf_bf16_2_frozen", "a different set of frozen parameters"),
    ("hf_bf16_2_subgroups", "9 optimizer sub-groups, the base has 2"),
])
def test_a_source_laid_out_unlike_the_base_is_refused_naming_the_row_and_what_differs(real_run, tmp_path, other,
                                                                                   needle):
    """Loading is strict (README): a source whose parameter shapes, frozen parameters or optimizer sub-groups are
    not the base's, in one line naming the row, the checkpoint and what differs, before anything is written."""
    run, spec = real_run("hf_bf16_2")
    theirs, their_spec = real_run(other)
    source = checkpoints_of(theirs, their_spec)[-1]
    recipe = write_recipe(tmp_path, checkpoints_of(run, spec)[-1], {"layers.1": source})
    assert_one_line_error(tailor("--apply", recipe), 5, "layers.1", source.name, needle)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["recipe.yaml"]


def test_incompatible_source_and_existing_output(real_run, tmp_path):
    run2, spec2 = real_run("hf_bf16_2")
    run3, spec3 = real_run("ds_bf16_3_subgroups")
    recipe = write_recipe(tmp_path, checkpoints_of(run2, spec2)[-1], {"layers.1": checkpoints_of(run3, spec3)[0]})
    assert_one_line_error(tailor("--apply", recipe), 5, "world size 3, the base has 2")

    recipe = write_recipe(tmp_path, checkpoints_of(run2, spec2)[-1], {})
    (tmp_path / "composed").mkdir()
    (tmp_path / "composed" / "keep.txt").write_text("mine")
    assert_one_line_error(tailor("--apply", recipe), 6, "already exists", "--force")
    assert (tmp_path / "composed" / "keep.txt").read_text() == "mine"

    # --force replaces only an earlier tailor-tui output: a folder of the user's is kept
    assert_one_line_error(tailor("--apply", recipe, "--force"), 6, "--force replaces only", "keep.txt")
    assert (tmp_path / "composed" / "keep.txt").read_text() == "mine"
    (tmp_path / "composed" / "keep.txt").unlink()
    assert tailor("--apply", recipe, "-j", "1").returncode == 0
    result = tailor("--apply", recipe, "--force", "-j", "1")
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "composed" / "trainer_state.json").is_file()


def test_missing_and_truncated_rank_files(real_run, tmp_path):
    run, spec = real_run("hf_bf16_2")
    c2, _, c6 = checkpoints_of(run, spec)
    broken = tmp_path / "checkpoint-2"
    shutil.copytree(c2, broken)
    optim = broken / "global_step2" / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    optim.write_bytes(optim.read_bytes()[: optim.stat().st_size // 2])
    recipe = write_recipe(tmp_path, c6, {"layers.1": broken})
    assert_one_line_error(tailor("--apply", recipe, "-j", "1"), 4, "rank_1", "truncated")
    assert not (tmp_path / "composed").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]

    optim.unlink()
    assert_one_line_error(tailor("--apply", recipe), 4, "rank_1", "missing", "incomplete")

    # A base file that is only copied, never parsed, is checked too.
    base = tmp_path / "checkpoint-6"
    shutil.copytree(c6, base)
    states = base / "global_step6" / "zero_pp_rank_1_mp_rank_00_model_states.pt"
    states.write_bytes(states.read_bytes()[:-100])
    recipe = write_recipe(tmp_path, base, {})
    assert_one_line_error(tailor("--apply", recipe), 4, "base", "model_states.pt: a zip-format torch file",
                          "truncated or corrupt")
    assert not (tmp_path / "composed").exists()


def test_usage_errors_are_one_line():
    """A bad command line is one line as every user error is, never the usage first."""
    assert_one_line_error(tailor(), 2, "name a RUN_DIR", "--help")
    assert_one_line_error(tailor("--apply", "x.yaml", "--workers", "0"), 2, "--workers", "at least 1")
    assert_one_line_error(tailor("--apply", "x.yaml", "--world-size", "0"), 2, "--world-size", "at least 1")
    assert_one_line_error(tailor("--apply", "x.yaml", "--bogus"), 2, "--bogus")
    assert_one_line_error(tailor("--stats", "a", "--heal", "b"), 2, "not allowed with")
    assert "usage: tailor-tui" in tailor("--help").stdout  # asked for: the whole usage
    assert_one_line_error(tailor("--apply", "x.yaml"), 3, "x.yaml: no such recipe file")


def test_headless_path_never_imports_textual(real_run, tmp_path):
    run, spec = real_run("hf_bf16_2")
    c2, c4, c6 = checkpoints_of(run, spec)
    recipe = write_recipe(tmp_path, c6, {"layers.1": c4})
    code = (
        "import sys\n"
        "import tailor_tui.checkpoints.checkpoint, tailor_tui.planning.recipe, tailor_tui.planning.plan, tailor_tui.compose.compose_run\n"
        "import tailor_tui.compose.composition, tailor_tui.progress_bars, tailor_tui.events, tailor_tui.compose.model_files\n"
        "import tailor_tui.selective.saver, tailor_tui.verifying.against_recipe\n"
        "from tailor_tui.cli.main import main\n"
        f"assert main(['--apply', {str(recipe)!r}, '-j', '1']) == 0\n"
        "assert 'textual' not in sys.modules, 'the headless path imported textual'\n"
        # Streaming reads structure with its own allow-listed unpickler: no torch import,
        # which is what makes scanning and worker start-up cheap.
        "assert 'torch' not in sys.modules, 'the streaming composition imported torch'\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr


def test_the_composer_needs_a_terminal_and_an_existing_folder(tmp_path):
    assert_one_line_error(tailor(tmp_path / "nope"), 4, "no such folder")
    assert_one_line_error(tailor(tmp_path), 2, "needs a terminal", "--apply")


def test_a_path_of_the_wrong_kind_says_what_it_is_and_what_was_meant(real_run, tmp_path):
    run, spec = real_run("hf_bf16_2")
    c2, _c4, c6 = checkpoints_of(run, spec)
    recipe = write_recipe(tmp_path, c6, {"layers.1": c2})
    for args in ([recipe], ["--stats", recipe], ["--heal", recipe, "--recipe", tmp_path / "fix.yaml"]):
        assert_one_line_error(tailor(*args), 2, str(recipe), "is a recipe, not a run folder", "--apply")
    assert_one_line_error(tailor("--apply", run), 3, str(run), "is a folder, not a recipe", f"tailor-tui {run}")
    for one in (c6, c6 / "global_step6"):  # an HF checkpoint folder, a DeepSpeed tag folder
        assert_one_line_error(tailor("--heal", one, "--recipe", tmp_path / "fix.yaml"), 2, str(one),
                              "is one checkpoint, not a run folder", str(c6.resolve().parent))
    for one in (c6, c6 / "global_step6"):  # a checkpoint as --apply's recipe: its run is named, and the
        refused = tailor("--apply", one)        # advice works when followed (the checkpoint itself would not)
        assert_one_line_error(refused, 3, str(one), "is a checkpoint of the run", f"tailor-tui {run.resolve()}")
        heal = re.search(r"`tailor-tui (--heal [^`]*)`", refused.stderr)[1].replace("fix.yaml", str(tmp_path / "h.yaml"))
        assert tailor(*heal.split()).returncode == 0, heal
        (tmp_path / "h.yaml").unlink()
    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)  # opening it would wait for a writer
    assert_one_line_error(tailor("--apply", fifo, timeout=30), 3, str(fifo), "not a regular file")
    assert not (tmp_path / "composed").exists() and not (tmp_path / "fix.yaml").exists()


def test_no_fsync_output_verifies(real_run, tmp_path):
    run, spec = real_run("hf_bf16_2")
    c2, c4, c6 = checkpoints_of(run, spec)
    recipe = write_recipe(tmp_path, c6, {"layers.1": c4, "embed_tokens": c2})
    result = tailor("--apply", recipe, "--no-fsync", "--workers", "2")
    assert result.returncode == 0, result.stderr
    verified = tailor("--verify", recipe)
    assert verified.returncode == 0, verified.stdout + verified.stderr


def test_paths_from_a_recipe_in_another_folder_are_printed_normalized(real_run, tmp_path):
    """A recipe in recipes/ naming ../run/...: the plan and the final line say run/..., as the
    user would type it from the working folder, not recipes/../run/..."""
    run, spec = real_run("hf_bf16_2")
    shutil.copytree(run, tmp_path / "run")
    c2, _c4, c6 = checkpoints_of(tmp_path / "run", spec)
    (tmp_path / "recipes").mkdir()
    recipe = write_recipe(tmp_path / "recipes", c6, {"layers.1": c2}, output="../run/fixed")
    plan = tailor("--apply", "recipes/recipe.yaml", "--dry-run", cwd=tmp_path).stdout
    assert "output: run/fixed\n" in plan and "base:   run/checkpoint-6 (" in plan and ".." not in plan
    result = tailor("--apply", recipe.relative_to(tmp_path), "-j", "1", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("done: run/fixed (")


def test_the_plan_and_the_final_line_count_the_same_bytes(real_run, tmp_path):
    """Streamed rank files, model files and the base's other files: the plan's "to write" is
    what the final line reports. Files torch writes anew (model_states taking a frozen
    parameter's fragments from another checkpoint) are sized once written: the plan says
    "about" and how many."""
    run, spec = real_run("hf_bf16_2")
    ckpts = checkpoints_of(run, spec)
    recipe = write_recipe(tmp_path, ckpts[-1], {"layers.1": ckpts[0]})
    assert "~" not in tailor("--apply", recipe, "--dry-run").stdout
    result = tailor("--apply", recipe, "-j", "1")
    assert result.returncode == 0, result.stderr
    planned = result.stderr.split(" to write")[0].rsplit(", ", 1)[1]
    assert f"({planned} written in" in result.stdout

    run, spec = real_run("ds_frozen_blown_up")  # layers.1 holds the frozen parameter
    c2, c4 = checkpoints_of(run, spec)
    recipe = write_recipe(tmp_path, c4, {"layers.1": c2}, output="frozen")
    plan = tailor("--apply", recipe, "--dry-run").stdout
    assert "write: ~" in plan and "torch writes 2 file(s) anew" in plan  # both ranks' model_states
    result = tailor("--apply", recipe, "--allow-nonfinite")
    assert result.returncode == 0, result.stderr
    assert ", about " in result.stderr.split(" to write")[0]  # the header says so too


def test_ctrl_c_during_statistics_says_what_was_cancelled(real_run, tmp_path):
    import signal

    run, _spec = real_run("hf_bf16_2")
    proc = start_tailor("--stats", run, "--progress", "lines", env={"TAILOR_TUI_CACHE": str(tmp_path / "cache")})
    seen = wait_for_line(proc, "statistics: ")
    os.killpg(proc.pid, signal.SIGINT)
    err = finish(proc, seen)
    assert proc.returncode == 130, err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert errors == ["error: statistics cancelled"], err  # nothing about an output: --stats writes none


def test_make_demo_names_training_checkpoints_only_and_the_composed_demo_resumes(real_run, tmp_path):
    """`make demo-apply` then `make demo-resume`, as a newcomer runs them: --make-demo of a demo run
    holding an output and an export lists its training checkpoints alone; the composed checkpoint
    resumes in the real HF Trainer on 2 ranks (`python -m tailor_tui.demo.demo_run resume-demo`)."""
    from pilot_helpers import private_copy

    run, (_c2, c4, c6) = private_copy(real_run, tmp_path, "demo")
    recipe = write_recipe(tmp_path, c6, {"layers.2": c4}, output="run/checkpoint-6-tailored")
    assert tailor("--apply", recipe).returncode == 0
    assert tailor("--export", recipe, "--to", run / "checkpoint-6-tailored-hf").returncode == 0
    made = tailor("--make-demo", run)
    assert made.returncode == 0, made.stderr
    assert made.stdout.strip() == f"done: {run} holds the training checkpoints checkpoint-2, checkpoint-4, checkpoint-6"
    resumed = subprocess.run([sys.executable, "-m", "tailor_tui.demo.demo_run", "resume-demo",
                              str(run / "checkpoint-6-tailored")], capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr
    last = resumed.stdout.splitlines()[-1]  # after the Trainer's own log lines
    assert re.fullmatch(rf"resumed {run / 'checkpoint-6-tailored'} \(step 6\) with the HF Trainer on 2 ranks: "
                        r"the next step trained, loss [\d.]+", last)


def test_demo_reuses_the_demo_run_in_this_folder_and_opens_the_composer_on_it(real_run, tmp_path):
    """`tailor-tui --demo` on a terminal, as the README shows: the demo run in ./demo-run (made once: here a copy of
    the cached one, its marker included) is reused and opened; the grid names its checkpoints and rows; q quits."""
    import pty
    import select
    import time

    from helpers import TAILOR

    run, _spec = real_run("demo")
    shutil.copytree(run, tmp_path / "demo-run")
    mine, theirs = pty.openpty()
    drawn = b""
    try:
        proc = subprocess.Popen([TAILOR, "--demo"], cwd=tmp_path, stdin=theirs, stdout=theirs, stderr=theirs,
                                env=dict(os.environ, COLUMNS="120", LINES="40", TERM="xterm-256color"))
        os.close(theirs)
        deadline = time.monotonic() + 120
        while b"checkpoint-6" not in drawn or b"layers.2" not in drawn:
            assert time.monotonic() < deadline and proc.poll() is None, drawn.decode(errors="replace")[-2000:]
            if select.select([mine], [], [], 0.5)[0]:
                drawn += _read_pty(mine)
        os.write(mine, b"q")
        while proc.poll() is None and time.monotonic() < deadline:
            if select.select([mine], [], [], 0.2)[0] and not _read_pty(mine):
                break
        code = proc.wait(timeout=30)
    finally:
        os.close(mine)
    assert code == 0, drawn.decode(errors="replace")[-2000:]
    assert b"reusing it" in drawn and sorted(p.name for p in tmp_path.iterdir()) == ["demo-run"]


def test_an_output_whose_folder_cannot_exist_is_said_as_such_not_as_a_full_disk(real_run, tmp_path):
    """A write error's advice follows its cause, never "free space" where space did not run out: a parent that
    cannot be made (under /proc, as the issue tried) and a file in the way of the output's path."""
    run, spec = real_run("hf_bf16_2")
    recipe = write_recipe(tmp_path, checkpoints_of(run, spec)[-1], {})
    missing = tailor("--apply", recipe, "--output", "/proc/tailor-tui-no-such/out")
    assert_one_line_error(missing, 6, "cannot write (No such file or directory)", "its folder does not exist",
                          "choose an output folder whose parent exists")
    (tmp_path / "file").write_text("mine")
    in_the_way = tailor("--apply", recipe, "--output", tmp_path / "file" / "out")
    assert_one_line_error(in_the_way, 6, "cannot write (File exists)", "choose another output folder")
    assert (tmp_path / "file").read_text() == "mine"
    assert "free space" not in missing.stderr + in_the_way.stderr
