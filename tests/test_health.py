"""Row health: `--stats` against an independent reading, `--heal`, the non-finite guard of
`--apply`, the cache, CRC failures as unhealthy cells; on real runs in which a layer blew up
through DeepSpeed's own ZeRO-3 API."""

from __future__ import annotations

import json
import math
import re
import shutil
from collections import Counter
from pathlib import Path

import pytest
import torch
import yaml
from conftest import checkpoints_of, resume_with, tree_digest
from helpers import assert_one_line_error, param_row, row_at, stats_json, tailor, write_recipe
from zero_reader import read_full_state

from tailor_tui.formats.nonfinite import Census, Region, count
from tailor_tui.planning.recipe_file import load_recipe

BLOWN = "layers.2"


@pytest.fixture(autouse=True)
def stats_cache(tmp_path, monkeypatch):
    """Each test starts with an empty statistics cache of its own (the CLI inherits it)."""
    monkeypatch.setenv("TAILOR_TUI_CACHE", str(tmp_path / "stats-cache"))
    return tmp_path / "stats-cache"


def expected_cells(ckpts, frozen=()) -> dict:
    """{(row, checkpoint): cell} computed from DeepSpeed's zero_to_fp32 reading, in float64."""
    states = [read_full_state(c) for c in ckpts]
    cells = {}
    for i, (ckpt, state) in enumerate(zip(ckpts, states)):
        rows: dict[str, list[str]] = {}
        for name in state["fp32"]:
            if name not in frozen and name in state["exp_avg"]:  # (a tied lm_head has no state of its own)
                rows.setdefault(param_row(name), []).append(name)
        for row, names in rows.items():
            theta = torch.cat([state["fp32"][n].detach().double().flatten() for n in names])
            moments = [state[k][n].double().flatten() for k in ("exp_avg", "exp_avg_sq") for n in names]
            bad = int((~torch.isfinite(theta)).sum()) + sum(int((~torch.isfinite(m)).sum()) for m in moments)
            rel = None
            if i and not bad:
                prev = torch.cat([states[i - 1]["fp32"][n].detach().double().flatten() for n in names])
                if torch.isfinite(prev).all():
                    rel = float((theta - prev).norm() / prev.norm())
            v = torch.cat([state["exp_avg_sq"][n].double().flatten() for n in names])
            cells[row, str(ckpt)] = {
                "nonfinite": bad,
                "weight_rms": None if bad else float(theta.pow(2).mean().sqrt()),
                "adam_v_max": None if bad else float(v.max()),
                "rel_change": rel,
            }
    return cells


def assert_close(got, want, what):
    if want is None:
        assert got is None, what
    else:
        assert got is not None and math.isclose(got, want, rel_tol=1e-4, abs_tol=1e-12), (what, got, want)


def test_stats_match_deepspeeds_own_reading_and_flag_only_the_blown_cell(real_run):
    run, spec = real_run("ds_blown_up")
    ckpts = checkpoints_of(run, spec)
    before = tree_digest(run)
    doc = stats_json(run)
    assert tree_digest(run) == before  # sources are read-only
    assert [c["path"] for c in doc["checkpoints"]] == [str(c) for c in ckpts]
    assert all(c["loss"] is None for c in doc["checkpoints"])  # DeepSpeed layout: no trainer log
    want = expected_cells(ckpts)
    got = {(c["row"], c["checkpoint"]): c for c in doc["cells"]}
    assert set(got) == set(want)
    for key, cell in want.items():
        assert got[key]["nonfinite"] == cell["nonfinite"], key
        for metric in ("weight_rms", "adam_v_max", "rel_change"):
            assert_close(got[key][metric], cell[metric], (key, metric))
        assert got[key]["crc_ok"] is True
    flagged = {key for key, c in got.items() if c["nonfinite"]}
    assert flagged == {(BLOWN, str(ckpts[-1]))}
    # the poisoned parameters' masters (NaN) and exp_avg_sq (+Inf), nothing else
    assert got[BLOWN, str(ckpts[-1])]["nonfinite"] == 2 * (32 * 32 + 32 * 48)


def test_second_stats_reads_nothing_and_table_marks_the_cell(real_run, stats_cache):
    run, _spec = real_run("ds_blown_up")
    first = tailor("--stats", run, "--progress", "lines")
    assert first.returncode == 0, first.stderr
    lines = first.stdout.splitlines()
    blown = next(line for line in lines if line.startswith(BLOWN))
    assert blown.rstrip().endswith("✗ NaN×5,120")
    assert "1 unhealthy cell(s)" in lines
    assert any(stats_cache.rglob("*.json"))
    again = tailor("--stats", run, "--progress", "lines")
    assert again.stdout == first.stdout
    assert "6 cached, 0 Bytes to read" in again.stderr


def test_an_outlying_change_is_marked_in_the_stats_table(real_run, tmp_path, stats_cache):
    """The `--stats` table marks a cell whose change stands out in its row (▲, README): a fourth save whose layers.1 is
    another training's (hf_bf16_2_seed1's, composed into step 6's and its provenance record removed, so that it scans
    as the run's own save) changes layers.1 by far more than three times the row's median change; a change no larger
    than the median is never marked, whatever the floats training computed."""
    run, spec = real_run("hf_bf16_2")
    other, other_spec = real_run("hf_bf16_2_seed1")
    for checkpoint in checkpoints_of(run, spec):
        shutil.copytree(checkpoint, tmp_path / "run" / checkpoint.name)
    theirs = checkpoints_of(other, other_spec)[-1]
    recipe = write_recipe(tmp_path, tmp_path / "run" / "checkpoint-6", {"layers.1": theirs}, output="run/checkpoint-8")
    assert tailor("--apply", recipe).returncode == 0
    (tmp_path / "run" / "checkpoint-8" / "tailor_provenance.json").unlink()
    result = tailor("--stats", tmp_path / "run", "--progress", "lines")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].split() == ["row", "checkpoint-2", "checkpoint-4", "checkpoint-6", "checkpoint-8"], result.stdout
    swapped = next(line for line in lines if line.startswith("layers.1 "))
    assert swapped.rstrip().endswith("▲") and swapped.count("▲") == 1, result.stdout  # at checkpoint-8 alone
    assert "▲ outlying change" in result.stdout


def test_heal_picks_the_previous_checkpoint_and_real_deepspeed_resumes_finite(real_run, tmp_path):
    run, spec = real_run("ds_blown_up")
    c2, c4, c6 = checkpoints_of(run, spec)
    recipe = tmp_path / "healed.yaml"
    result = tailor("--heal", run, "--recipe", recipe)
    assert result.returncode == 0, result.stderr
    assert f"{BLOWN} <- global_step4 (global_step6: 5,120 non-finite value(s))" in result.stdout
    doc = yaml.safe_load(recipe.read_text())
    assert (recipe.parent / doc["base"]).resolve() == c6.resolve()
    assert {row: (recipe.parent / p).resolve() for row, p in doc["layers"].items()} == {BLOWN: c4.resolve()}
    applied = tailor("--apply", recipe, "--output", tmp_path / "healed")
    assert applied.returncode == 0, applied.stderr
    losses = resume_with(spec_version(), tmp_path / "healed", spec, tmp_path / "resaved")
    assert losses and all(math.isfinite(x) for x in losses)


def spec_version() -> str:
    from conftest import INSTALLED_DEEPSPEED

    return INSTALLED_DEEPSPEED


@pytest.mark.parametrize("cached", [False, True], ids=["statistics computed", "statistics of --stats"])
def test_apply_refuses_to_keep_nonfinite_rows_unless_allowed(real_run, tmp_path, monkeypatch, cached):
    """One non-finite rule, decided before anything is written from the statistics of the checkpoint each row is
    taken from (cached by --stats, or computed for those cells): --dry-run warns, --apply refuses before any
    task starts (no rank says "done", no staging folder), --allow-nonfinite writes it and says so."""
    monkeypatch.setenv("TAILOR_TUI_CACHE", str(tmp_path / "cache"))
    run, spec = real_run("ds_blown_up")
    c2, c4, c6 = checkpoints_of(run, spec)
    if cached:
        assert tailor("--stats", run).returncode == 0
    recipe = write_recipe(tmp_path, c6, {"layers.1": c4})  # the blown base row is not replaced
    preview = tailor("--apply", recipe, "--dry-run")
    assert preview.returncode == 0, preview.stderr
    assert re.search(rf"warning: the output .* would hold non-finite values: {BLOWN} from global_step6 "
                     r"\(5,120 NaN/Inf; newest finite: global_step4\).*--apply refuses it \(exit 8\)", preview.stderr)
    refused = tailor("--apply", recipe)
    assert_one_line_error(refused, 8, f"{BLOWN} from global_step6 (5,120 NaN/Inf; newest finite: global_step4)",
                          "--allow-nonfinite")
    assert "composing " not in refused.stderr and "done" not in refused.stderr  # refused before any task
    assert not (tmp_path / "composed").exists() and not list(tmp_path.glob(".composed*"))
    picked = write_recipe(tmp_path, c4, {BLOWN: c6})  # a picked row
    assert_one_line_error(tailor("--apply", picked), 8, f"{BLOWN} from global_step6")
    allowed = tailor("--apply", picked, "--allow-nonfinite")
    assert allowed.returncode == 0, allowed.stderr
    assert f"holds NaN/Inf values in {BLOWN} (5,120)" in allowed.stderr


def test_export_refuses_nonfinite_rows_before_writing_unless_allowed(real_run, tmp_path, monkeypatch):
    """--export of a recipe keeping the blown row: refused in one line (exit 8) before anything is written, the
    same rule as --apply's; --dry-run warns; --allow-nonfinite exports it and says so."""
    monkeypatch.setenv("TAILOR_TUI_CACHE", str(tmp_path / "cache"))
    run, spec = real_run("ds_blown_up")
    c2, c4, c6 = checkpoints_of(run, spec)
    recipe = write_recipe(tmp_path, c6, {"layers.1": c4})
    preview = tailor("--export", recipe, "--to", tmp_path / "model", "--dry-run")
    assert preview.returncode == 0 and "--export refuses it (exit 8)" in preview.stderr, preview.stderr
    refused = tailor("--export", recipe, "--to", tmp_path / "model")
    assert_one_line_error(refused, 8, f"{BLOWN} from global_step6 (5,120 NaN/Inf; newest finite: global_step4)",
                          "export anyway with --allow-nonfinite")
    assert not (tmp_path / "model").exists() and not list(tmp_path.glob(".model*"))
    allowed = tailor("--export", recipe, "--to", tmp_path / "model", "--allow-nonfinite")
    assert allowed.returncode == 0, allowed.stderr
    assert f"warning: --allow-nonfinite: the output {tmp_path / 'model'} would hold non-finite values" in allowed.stderr


def test_a_record_failing_its_crc_is_an_unhealthy_cell_that_heal_avoids(real_run, tmp_path):
    run, spec = real_run("ds_blown_up")
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    c2, c4, c6 = checkpoints_of(copy, spec)  # step 6 is the blown one: heal must look further back
    target = next(c4.glob("*rank_1_*optim_states.pt"))
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0x01  # the middle of an optim file: its flat tensors' data
    target.write_bytes(bytes(data))
    doc = stats_json(copy)
    bad = {c["row"] for c in doc["cells"] if c["checkpoint"] == str(c4) and not c["crc_ok"]}
    assert bad, "a flipped bit in a tensor record must fail its CRC check"
    recipe = tmp_path / "healed.yaml"
    result = tailor("--heal", copy, "--recipe", recipe)
    assert result.returncode == 0, result.stderr
    picks = {row: (recipe.parent / p).resolve() for row, p in yaml.safe_load(recipe.read_text())["layers"].items()}
    assert picks[BLOWN] == c2.resolve()  # step 6 is NaN, step 4 fails its CRC check
    assert "a record fails its CRC-32 check" in result.stdout


def test_partial_checkpoints_losses_and_frozen_parameters(real_run):
    run, spec = real_run("hf_selective_parity")
    doc = stats_json(run / "run")
    by_name = {c["name"]: c for c in doc["checkpoints"]}
    state = json.loads((run / "run" / "partial-step6" / "trainer_state.json").read_text())
    logged = {e["step"]: e for e in state["log_history"] if "loss" in e}
    for name, step in (("checkpoint-2", 2), ("partial-step4", 4), ("partial-step6", 6)):
        assert by_name[name]["step"] == step
        assert by_name[name]["loss"] == pytest.approx(logged[step]["loss"])
        assert by_name[name]["grad_norm"] == pytest.approx(logged[step]["grad_norm"])
    rows = Counter(c["checkpoint"] for c in doc["cells"])
    full = rows[by_name["checkpoint-2"]["path"]]
    assert 0 < rows[by_name["partial-step4"]["path"]] < full  # a partial has cells for its rows only
    assert all(c["nonfinite"] == 0 and c["crc_ok"] for c in doc["cells"])
    # every cell of a partial checkpoint (rows from the partial's own slices) matches the
    # reference saves the same run wrote in full at the same step
    reference = [run / "reference" / f"checkpoint-{s}" for s in (2, 4, 6)]
    want = expected_cells(reference, frozen=spec.frozen)
    for c in doc["cells"]:
        step = next(x["step"] for x in doc["checkpoints"] if x["path"] == c["checkpoint"])
        w = want[c["row"], str(run / "reference" / f"checkpoint-{step}")]
        assert_close(c["weight_rms"], w["weight_rms"], (c["row"], step))
        assert_close(c["adam_v_max"], w["adam_v_max"], (c["row"], step))


def test_census_counts_nan_and_inf_per_row_in_any_chunking():
    values = torch.tensor([1.0, float("nan"), 2.0, float("inf"), -float("inf"), 3.0, float("nan"), 0.0])
    data = values.numpy().tobytes()
    assert count(data) == 4
    assert count(torch.tensor([1.0, float("nan")], dtype=torch.bfloat16).view(torch.int16).numpy().tobytes(),
                 "bfloat16") == 1
    for chunk in (4, 8, 12, 32):
        census = Census([Region(0, 12, "a"), Region(12, 20, "b")])
        for at in range(0, len(data), chunk):
            census.inspect(at, memoryview(data)[at: at + chunk])
        assert dict(census.counts) == {"a": 1, "b": 3}


def test_a_frozen_parameter_gone_nan_is_counted_and_guarded(real_run, tmp_path):
    """A frozen parameter has no fp32 master or moments: its values are the fragments in the
    model_states files. NaN there flags its row at that checkpoint (only there), and --apply
    refuses to keep it."""
    run, spec = real_run("ds_frozen_blown_up")
    c2, c4 = checkpoints_of(run, spec)
    doc = stats_json(run)
    frozen = read_full_state(c4)["fp32"]["model.layers.1.mlp.up_proj.weight"]  # zero_to_fp32 reads fragments too
    bad = [(c["row"], c["checkpoint"], c["nonfinite"]) for c in doc["cells"] if c["nonfinite"]]
    assert bad == [("layers.1", str(c4), frozen.numel())]
    assert torch.isnan(frozen).all()
    result = tailor("--apply", write_recipe(tmp_path, c4, {}), "--output", tmp_path / "out")
    assert_one_line_error(result, 8, "layers.1", "global_step4", "global_step2")
    assert not (tmp_path / "out").exists()


def test_the_padding_of_a_frozen_fragment_is_not_a_value(real_run, tmp_path):
    """ZeRO-3 partitions a frozen parameter as a trainable one and never writes the padding of its last
    fragment: Mllama's one-element gate, at 2 ranks, is rank 0's value and rank 1's padding, whatever
    memory held (a NaN at times). NaN there is no NaN of the model: --stats and --apply pass it; NaN in
    the value is counted (once) and refused."""
    gate = "model.vision_model.pre_tile_positional_embedding.gate"
    source, spec = real_run("hf_mllama_frozen_vision")
    run = tmp_path / "run"
    shutil.copytree(source, run)
    c2, c4 = checkpoints_of(run, spec)
    row = row_at(c4, "model.vision_model.pre_tile_positional_embedding").name

    def set_gate(ckpt: Path, rank: int, value: float) -> None:
        path = next(ckpt.glob(f"global_step*/zero_pp_rank_{rank}_mp_rank_00_model_states.pt"))
        states = torch.load(path, map_location="cpu", weights_only=False)
        assert states["frozen_param_fragments"][gate].numel() == 1  # one element per rank: rank 1's is padding
        states["frozen_param_fragments"][gate].fill_(value)
        torch.save(states, path)  # as DeepSpeed saves it

    for ckpt in (c2, c4):
        set_gate(ckpt, 1, math.nan)
    assert not [c for c in stats_json(run)["cells"] if c["nonfinite"] and c["row"] == row]
    for picks in ({}, {row: c4}):  # the base's fragment kept, another's taken (c4 holds a blown vision block)
        shutil.rmtree(tmp_path / "composed", ignore_errors=True)
        result = tailor("--apply", write_recipe(tmp_path, c2, picks))
        assert result.returncode == 0, result.stderr
    set_gate(c4, 0, math.nan)
    bad = [(c["checkpoint"], c["nonfinite"]) for c in stats_json(run)["cells"] if c["nonfinite"] and c["row"] == row]
    assert bad == [(str(c4), 1)]
    shutil.rmtree(tmp_path / "composed")
    assert_one_line_error(tailor("--apply", write_recipe(tmp_path, c2, {row: c4})), 8, row, "1 NaN/Inf")


def test_checkpoints_sharing_a_folder_name_get_their_own_progress_lines(real_run, tmp_path):
    """Two DeepSpeed save_dirs each with a `global_step2`, and an HF run whose tag folders have
    the same names: every rank file is its own task (one line, one finish), labelled apart."""
    from tailor_tui.checkpoints.scan import scan
    from tailor_tui.events import TaskFinished, TaskOptions
    from tailor_tui.health.stats_run import compute_health

    ds, _ = real_run("ds_bf16_3_subgroups")
    hf, _ = real_run("hf_bf16_2")
    for side in ("a", "b"):
        shutil.copytree(ds / "global_step2", tmp_path / "mixed" / side / "global_step2")
    shutil.copytree(hf / "checkpoint-2", tmp_path / "mixed" / "hf" / "checkpoint-2")
    ckpts = tuple(scan(tmp_path / "mixed").checkpoints)
    finished = []
    emit = lambda e: finished.append(e.task) if isinstance(e, TaskFinished) else None  # noqa: E731
    health = compute_health(ckpts, workers=2, emit=emit, options=TaskOptions())
    assert len(health.checkpoints) == 3
    assert sorted(finished) == sorted({*finished})
    assert len(finished) == sum(len(c.ranks) for c in ckpts) == 3 + 3 + 2
    assert {t.rsplit(" rank ", 1)[0] for t in finished} == {"a/global_step2", "b/global_step2", "checkpoint-2"}


def test_distinct_names_add_parent_folders_only_where_names_repeat():
    from pathlib import Path

    from tailor_tui.checkpoints.checkpoint import distinct_names

    paths = [Path("/r/x/a/global_step2"), Path("/r/y/a/global_step2"), Path("/r/x/global_step4"),
             Path("/r/checkpoint-6")]
    assert distinct_names(paths) == ["x/a/global_step2", "y/a/global_step2", "global_step4", "checkpoint-6"]
    assert distinct_names([Path("global_step2"), Path("/global_step2")]) == ["global_step2", "/global_step2"]


@pytest.mark.parametrize("name", ["ds_blown_up", "hf_bf16_2"])
def test_heal_then_apply_twice_writes_a_sibling_and_outputs_are_never_columns(real_run, tmp_path, name):
    """The README's unattended recovery, run twice: the second output is a new sibling, never
    written inside or over the first, and the first is never a checkpoint of the run (not a
    column of --stats, not --heal's base)."""
    source, spec = real_run(name)
    run = tmp_path / "run"
    shutil.copytree(source, run)
    newest = checkpoints_of(run, spec)[-1]
    recipe = tmp_path / "fix.yaml"
    outputs = []
    for attempt in (1, 2):
        healed = tailor("--heal", run, "--recipe", recipe)
        assert healed.returncode == 0, healed.stderr
        doc = yaml.safe_load(recipe.read_text())
        assert (recipe.parent / doc["base"]).resolve() == newest.resolve(), attempt
        applied = tailor("--apply", recipe)
        assert applied.returncode == 0, applied.stderr
        outputs.append((recipe.parent / doc["output"]).resolve())
    first, second = outputs
    assert first == newest.resolve().with_name(newest.name + "-tailored")
    assert second == newest.resolve().with_name(newest.name + "-tailored-2")
    assert {p.name for p in run.iterdir()} >= {first.name, second.name}
    assert not [p for p in first.rglob("*") if "tailored" in p.name]  # nothing written inside the first
    columns = {Path(c["path"]).name for c in stats_json(run)["checkpoints"]}
    assert columns == {c.name for c in checkpoints_of(run, spec)}


def test_a_folder_of_outputs_only_names_them_and_their_sources(real_run, tmp_path):
    run, spec = real_run("hf_bf16_2")
    c2, c4, c6 = checkpoints_of(run, spec)
    outputs = tmp_path / "outputs"
    outputs.mkdir()
    recipe = write_recipe(tmp_path, c6, {"layers.1": c4}, output="outputs/fixed")
    assert tailor("--apply", recipe).returncode == 0
    result = tailor("--stats", outputs)
    assert_one_line_error(result, 4, f"{outputs}: holds no training checkpoint, only what tailor-tui composed",
                          "fixed (from checkpoint-6, checkpoint-4)", "open the run those came from")


def test_two_runs_in_one_folder_are_refused_naming_both(real_run, tmp_path):
    """Two trainings of the same model side by side: never one grid, statistics or healing
    across them (their trainer_state.json histories differ); a restored copy of a checkpoint of
    the same run is not another run."""
    one, spec = real_run("hf_bf16_2")
    other, _ = real_run("hf_bf16_2_seed1")
    folder = tmp_path / "runs"
    shutil.copytree(one, folder / "first")
    shutil.copytree(other, folder / "second")
    for command in (["--stats", folder], ["--heal", folder, "--recipe", tmp_path / "fix.yaml"]):
        result = tailor(*command)
        assert_one_line_error(result, 2, f"{folder}: holds checkpoints of 2 training runs",
                              "first/checkpoint-2, first/checkpoint-4, first/checkpoint-6",
                              "second/checkpoint-2, second/checkpoint-4, second/checkpoint-6",
                              "trainer_state.json) differ at step", f"tailor-tui {folder / 'first'}")
    assert not (tmp_path / "fix.yaml").exists()
    shutil.rmtree(folder / "second")
    shutil.copytree(one / "checkpoint-4", folder / "restored" / "checkpoint-4")  # the same run, elsewhere
    assert tailor("--stats", folder).returncode == 0


def test_two_deepspeed_save_dirs_in_one_folder_are_two_runs_never_one_grid(real_run, tmp_path):
    """Issue 60 (6): DeepSpeed's own layout keeps no history; two save_dirs that both saved a step are two runs (a
    sweep's lr-high/ and lr-low/, each with the same tags), refused in one line naming both, as two HF runs are;
    each opens alone, and a run resumed into a new save_dir (later steps there) stays one run."""
    run, spec = real_run("ds_blown_up")
    folder = tmp_path / "sweep"
    for name in ("lr-high", "lr-low"):
        shutil.copytree(run, folder / name)
    tags = [c.name for c in checkpoints_of(run, spec)]
    for command in (["--stats", folder], ["--heal", folder, "--recipe", tmp_path / "fix.yaml"]):
        result = tailor(*command)
        assert_one_line_error(result, 2, f"{folder}: holds checkpoints of 2 training runs",
                              ", ".join(f"lr-high/{t}" for t in tags), ", ".join(f"lr-low/{t}" for t in tags),
                              f"both saved step {tags[0].removeprefix('global_step')}, to different DeepSpeed "
                              "save_dirs (lr-high/ and lr-low/)", f"tailor-tui {folder / 'lr-high'}")
    assert not (tmp_path / "fix.yaml").exists()
    alone = tailor("--stats", folder / "lr-low")
    assert "training runs" not in alone.stderr and all(t in alone.stdout for t in tags), alone.stderr
    for tag in tags[1:]:  # lr-low/ holds the first save alone: a run resumed into lr-high/ from there
        shutil.rmtree(folder / "lr-low" / tag)
    shutil.rmtree(folder / "lr-high" / tags[0])
    resumed = tailor("--stats", folder)
    assert "training runs" not in resumed.stderr and resumed.stdout.split("\n", 1)[0].split() == ["row", *tags]


def test_flat_statistics_match_slice_by_slice_in_any_chunking(real_run):
    """The flat reader (every slice of a chunk at once, `stats_flat`) gives what the general one,
    slice by slice (`stats_rank`), does: on the blown-up checkpoint and the one before it, with
    chunks of 64 bytes (slices split across reads), 4 KiB and 1 MiB."""
    import contextlib
    import dataclasses

    from tailor_tui.checkpoints.scan import scan
    from tailor_tui.events import ByteCounter, TaskOptions
    from tailor_tui.health.stats_flat import can_read_flat, flat_stats
    from tailor_tui.health.stats_rank import rank_stats
    from tailor_tui.health.stats_run import stats_jobs

    run, _spec = real_run("ds_blown_up")
    checkpoints = scan(run, cache=None).checkpoints
    for column in (len(checkpoints) - 2, len(checkpoints) - 1):
        for job in stats_jobs(checkpoints, column):
            assert can_read_flat(job)
            general = rank_stats(dataclasses.replace(job, table=None), lambda e: None, lambda: False)
            assert general.error is None and general.rows
            for chunk in (64, 4096, 1 << 20):
                sums = {}
                counter = ByteCounter.for_job(job, lambda e: None, lambda: False, TaskOptions())
                with contextlib.ExitStack() as stack:
                    assert flat_stats(job, sums, stack, counter, {}, chunk=chunk)
                assert sums.keys() == general.rows.keys()
                for row, mine in sums.items():
                    theirs = general.rows[row]
                    for field in ("nonfinite", "count", "prev_nonfinite", "has_prev", "crc_ok"):
                        assert getattr(mine, field) == getattr(theirs, field), (column, row, field, chunk)
                    for field in ("sumsq", "v_max", "diff_sq", "prev_sq"):
                        assert_close(getattr(mine, field), getattr(theirs, field), (column, row, field, chunk))
                if column == len(checkpoints) - 1:
                    assert sums[BLOWN].nonfinite > 0


@pytest.mark.parametrize("name", ["ds_blown_up", "ds_bf16_3_subgroups"])
def test_each_ranks_elements_per_row_are_its_slots_real_elements(real_run, name):
    """`row_elements` adds each slot's real elements up per row once per group of ranks holding the
    same elements (`ZeroLayout.same_holdings`); the same as counting every slot on every rank, padding
    excluded."""
    from tailor_tui.checkpoints.scan import scan
    from tailor_tui.health.stats_run import row_elements

    run, _spec = real_run(name)
    for ckpt in scan(run, cache=None).checkpoints:
        owner = ckpt.param_to_row()
        want = []
        for rank in range(ckpt.world_size):
            counts: dict[str, int] = {}
            for s in ckpt.layout.slots:
                if s.valid(rank) and s.name in owner:
                    counts[owner[s.name]] = counts.get(owner[s.name], 0) + s.valid(rank)
            want.append(counts)
        assert row_elements(ckpt, owner, {}) == want and any(want)


def test_heal_never_replaces_a_recipe_a_person_wrote(real_run, tmp_path):
    """--heal --recipe of a recipe a person wrote or edited is refused in one line before any statistic
    is computed (--force replaces it); one tailor-tui wrote and nobody changed is written again; a
    folder given as --recipe is named as such."""
    run, spec = real_run("ds_blown_up")
    hand = tmp_path / "hand.yaml"
    hand.write_text("# my notes\nbase: x\noutput: mine\n")
    refused = tailor("--heal", run, "--recipe", hand)
    assert_one_line_error(refused, 6, str(hand), "--force")
    assert "statistics" not in refused.stderr  # refused before any was computed
    assert hand.read_text() == "# my notes\nbase: x\noutput: mine\n"
    assert tailor("--heal", run, "--recipe", hand, "--force").returncode == 0
    assert "# my notes" not in hand.read_text()
    assert tailor("--heal", run, "--recipe", hand).returncode == 0  # as tailor-tui wrote it: again
    hand.write_text(hand.read_text() + "# edited\n")
    assert_one_line_error(tailor("--heal", run, "--recipe", hand), 6, str(hand))
    assert_one_line_error(tailor("--heal", run, "--recipe", tmp_path), 2, "is a folder", "fix.yaml")


def test_heal_force_over_a_persons_recipe_keeps_their_comments(real_run, tmp_path):
    """--heal --force over a recipe a person wrote edits their file: their comments, blank lines and
    the lines it does not change stay; the rows healing does not take go, each with its own comment."""
    run, spec = real_run("ds_blown_up")
    c2, c4, c6 = checkpoints_of(run, spec)
    hand = tmp_path / "hand.yaml"
    hand.write_text(f"# my notes: the loss spiked at step 6\n\nversion: 1\nbase: {c6}   # the newest\n"
                    f"output: mine   # my output\n\nlayers:\n  # by hand\n  layers.0: {c2}  # a hand pick\n")
    healed = tailor("--heal", run, "--recipe", hand, "--force")
    assert healed.returncode == 0, healed.stderr
    text = hand.read_text()
    assert text.startswith(f"# my notes: the loss spiked at step 6\n\nversion: 1\nbase: {c6}   # the newest\n")
    assert "   # my output\n\nlayers:\n" in text and "  # by hand\n" in text and "a hand pick" not in text
    recipe = load_recipe(hand)
    assert recipe.base.resolve() == c6.resolve() and recipe.output.name == f"{c6.name}-tailored"
    assert {row: p.resolve() for row, p in recipe.layers.items()} == {BLOWN: c4.resolve()}


def test_stats_check_exits_8_on_an_unhealthy_cell_for_scripts(real_run, tmp_path):
    """--stats --check: the table, then one error line naming the unhealthy cells and what heals
    them, exit 8; a healthy run exits 0; --check without --stats is a usage error."""
    blown, _spec = real_run("ds_blown_up")
    checked = tailor("--stats", blown, "--check")
    assert checked.returncode == 8, checked.stderr
    assert "row" in checked.stdout  # the table is printed as without --check
    error = [line for line in checked.stderr.splitlines() if line.startswith("error:")]
    assert len(error) == 1 and f"{BLOWN} in global_step6" in error[0] and "--heal" in error[0]
    assert tailor("--stats", blown).returncode == 0  # without --check: a report, exit 0
    healthy, _spec = real_run("hf_bf16_2")
    assert tailor("--stats", healthy, "--check").returncode == 0
    assert_one_line_error(tailor("--apply", tmp_path / "r.yaml", "--check"), 2, "--check")
