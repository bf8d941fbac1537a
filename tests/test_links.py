"""Symbolic links inside a checkpoint (issue 43, item 3): a link is read as the file or folder it
leads to only where that lies inside the run folder (the folder holding the checkpoint folder,
compared by identity, not by spelling); one that leaves the run or leads nowhere refuses the
checkpoint in one line naming it and its target, for --apply (and --dry-run), --export,
--stats and the composer's scan. Each case on a copy of a real run, through the command line."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import checkpoints_of
from helpers import assert_one_line_error, tailor, write_recipe
from pilot_helpers import compose_finished, scan_notices, scanned, start_composing

from tailor_tui.checkpoints.scan import scan
from tailor_tui.errors import CheckpointError
from tailor_tui.ui.app import make_app

SECRET = "tailor-links-test-secret-token\n"
OPTIM_1 = "global_step6/bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"


def _copy_run(real_run, tmp_path: Path, name: str) -> tuple[Path, list[Path]]:
    source, spec = real_run(name)
    run = tmp_path / "run"
    shutil.copytree(source, run, symlinks=True)
    return run, checkpoints_of(run, spec)


@pytest.fixture
def hf(real_run, tmp_path):
    """A copy of an HF-layout run, a secret file outside it, and a recipe composing checkpoint-6
    with layers.1 from checkpoint-2 into tmp/composed."""
    run, (c2, _c4, c6) = _copy_run(real_run, tmp_path, "hf_bf16_2")
    secret = tmp_path / "home" / "secret"
    secret.parent.mkdir()
    secret.write_text(SECRET)
    return run, c6, secret, write_recipe(tmp_path, c6, {"layers.1": c2})


def _outside_copy(path: Path, tmp_path: Path) -> Path:
    """A copy of `path` (a file or folder of the run) outside the run, where a link may lead."""
    elsewhere = tmp_path / "elsewhere" / path.name
    elsewhere.parent.mkdir(exist_ok=True)
    if path.is_dir():
        shutil.copytree(path, elsewhere)
    else:
        shutil.copy2(path, elsewhere)
    return elsewhere


def _replace_with_link(path: Path, target: Path | str) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif os.path.lexists(path):
        path.unlink()
    path.symlink_to(target)


def _leaked(tmp_path: Path) -> list[Path]:
    """Files under tmp_path outside the run and the secret's folder that hold the secret."""
    return [p for p in tmp_path.rglob("*") if p.is_file() and not p.is_symlink()
            and "home" not in p.relative_to(tmp_path).parts and p.read_bytes() == SECRET.encode()]


def _assert_link_refused(result, link: Path, target) -> None:
    assert_one_line_error(result, 4, f"{link} is a symbolic link to {target}", "outside the run",
                          "reads no file through a link that leaves the run", "itself (", "if you trust it")


# --- links that leave the run: refused by every command ------------------------------------------

@pytest.mark.parametrize("name", ["tokenizer_config.json", "docs/README.txt"])
def test_a_link_to_a_file_outside_the_run_is_refused_by_apply_dry_run_and_export(hf, tmp_path, name):
    """`ln -s ~/secret checkpoint-6/tokenizer_config.json`, and one in a subfolder: before, --apply
    and --export exited 0 with the secret in the output as a "run-level" file."""
    run, c6, secret, recipe = hf
    link = c6 / name
    link.parent.mkdir(exist_ok=True)
    _replace_with_link(link, secret)
    for args in (("--apply", recipe, "--dry-run"), ("--apply", recipe), ("--export", recipe, "--to", tmp_path / "hf")):
        result = tailor(*args)
        _assert_link_refused(result, link, secret)
    assert not (tmp_path / "composed").exists() and not (tmp_path / "hf").exists()
    assert _leaked(tmp_path) == []


def test_a_link_to_etc_passwd_in_a_subfolder_is_refused(hf, tmp_path):
    run, c6, _secret, recipe = hf
    (c6 / "docs").mkdir()
    (c6 / "docs" / "README.txt").symlink_to("/etc/passwd")
    _assert_link_refused(tailor("--apply", recipe), c6 / "docs" / "README.txt", "/etc/passwd")
    assert not (tmp_path / "composed").exists()


@pytest.mark.parametrize("what", [OPTIM_1, "model.safetensors", "global_step6", "docs"])
def test_a_rank_file_the_model_file_or_a_folder_linked_out_of_the_run_is_refused(hf, tmp_path, what):
    """The same bytes, but read through a link out of the run: a rank file, model.safetensors, the
    tag folder itself, a subfolder of run-level files."""
    run, c6, _secret, recipe = hf
    if what == "docs":
        (c6 / "docs").mkdir()
        (c6 / "docs" / "notes.txt").write_text("notes\n")
    target = _outside_copy(c6 / what, tmp_path)
    _replace_with_link(c6 / what, target)
    for args in (("--apply", recipe, "--dry-run"), ("--apply", recipe)):
        _assert_link_refused(tailor(*args), c6 / what, target)
    assert not (tmp_path / "composed").exists()


def test_a_link_chain_that_ends_outside_the_run_is_refused(hf, tmp_path):
    """tokenizer_config.json -> ../hop (inside the run) -> the secret: where it ends decides."""
    run, c6, secret, recipe = hf
    (run / "hop").symlink_to(secret)
    (c6 / "tokenizer_config.json").symlink_to("../hop")
    _assert_link_refused(tailor("--apply", recipe), c6 / "tokenizer_config.json", secret)
    assert _leaked(tmp_path) == []


def test_a_dangling_link_is_refused_not_passed_over(hf, tmp_path):
    run, c6, _secret, recipe = hf
    (c6 / "tokenizer_config.json").symlink_to(tmp_path / "nowhere")
    result = tailor("--apply", recipe, "--dry-run")
    assert_one_line_error(result, 4, f"{c6 / 'tokenizer_config.json'} is a symbolic link to {tmp_path / 'nowhere'}",
                          "leads nowhere")


def test_a_folder_beside_the_run_whose_name_starts_like_it_is_outside(hf, tmp_path):
    """Inside is decided by identity, not by the spelling: run-evil/ is not inside run/."""
    run, c6, _secret, recipe = hf
    evil = tmp_path / "run-evil" / "tokenizer_config.json"
    evil.parent.mkdir()
    evil.write_text(SECRET)
    (c6 / "tokenizer_config.json").symlink_to(evil)
    _assert_link_refused(tailor("--apply", recipe), c6 / "tokenizer_config.json", evil)


def test_deepspeed_layout_links_out_of_the_run_are_refused(real_run, tmp_path):
    """A DeepSpeed save_dir: its recovery script (copied into the output), a rank file of the tag
    folder, and `latest`, each a link out of the run."""
    run, (g2, _g4, g6) = _copy_run(real_run, tmp_path, "ds_bf16_3_subgroups")
    recipe = write_recipe(tmp_path, g6, {"layers.1": g2})
    for rel in ("zero_to_fp32.py", "global_step6/zero_pp_rank_2_mp_rank_00_model_states.pt", "latest"):
        original = run / rel
        target = _outside_copy(original, tmp_path)
        _replace_with_link(original, target)
        _assert_link_refused(tailor("--apply", recipe), original, target)
        assert not (tmp_path / "composed").exists()
        original.unlink()
        shutil.copy2(target, original)
    assert tailor("--apply", recipe, "--dry-run").returncode == 0


def test_stats_and_the_composers_scan_skip_the_checkpoint_naming_the_link(hf, tmp_path):
    run, c6, secret, _recipe = hf
    (c6 / "tokenizer_config.json").symlink_to(secret)
    result = tailor("--stats", run, "--json", env={"TAILOR_TUI_CACHE": str(tmp_path / "cache")})
    assert result.returncode == 0, result.stderr
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning: skipped")]
    assert len(warnings) == 1 and f"{c6 / 'tokenizer_config.json'} is a symbolic link to {secret}" in warnings[0]
    assert str(c6) not in result.stdout
    found = scan(run, cache=None)
    assert c6 not in [c.path for c in found.checkpoints]
    assert [(p, "symbolic link to" in why) for p, why in found.problems] == [(c6, True)]


async def test_the_composer_skips_a_checkpoint_linked_out_of_the_run_and_says_why(hf, tmp_path):
    """In the composer: one notice naming the link and its target; the checkpoint is no column, and
    the composition (from what is left) holds no byte of the secret."""
    run, c6, secret, _recipe = hf
    (c6 / "tokenizer_config.json").symlink_to(secret)
    app = make_app(run, workers=1)
    async with app.run_test(size=(130, 32), notifications=True) as pilot:
        notices = await scan_notices(pilot)
        assert len(notices) == 1 and notices[0].title == "Skipped checkpoint-6", notices
        assert f"is a symbolic link to {secret}" in notices[0].message
        await scanned(pilot)
        assert c6 not in [c.path for c in app.home.draft.checkpoints]
        assert len(app.home.draft.checkpoints) == 2
        await start_composing(pilot)
        await compose_finished(pilot)
    assert not _leaked(tmp_path)


# --- links that stay inside the run: read as that file ---------------------------------------------

def test_links_inside_the_run_are_read_as_their_files(hf, tmp_path):
    """A tokenizer file shared at the run's top, the tag folder kept elsewhere in the run, a rank
    file and a subfolder linked to their places in the run, the run named through another path:
    composed, exported and verified, each output file a regular file with the target's bytes."""
    run, c6, _secret, recipe = hf
    (run / "shared").mkdir()
    (run / "shared" / "tokenizer_config.json").write_text('{"shared": true}\n')
    (c6 / "tokenizer_config.json").symlink_to("../shared/tokenizer_config.json")
    (run / "store").mkdir()
    (c6 / "global_step6").rename(run / "store" / "global_step6")
    (c6 / "global_step6").symlink_to(run / "store" / "global_step6")  # absolute: the run's real path
    rank = run / "store" / OPTIM_1
    rank.rename(run / "store" / "rank1.pt")
    rank.symlink_to("../rank1.pt")
    (run / "shared" / "docs").mkdir()
    (run / "shared" / "docs" / "notes.txt").write_text("notes\n")
    (c6 / "docs").symlink_to("../shared/docs")
    (tmp_path / "alias").symlink_to(run)  # the recipe names the run through another path
    recipe = write_recipe(tmp_path, tmp_path / "alias" / c6.name, {"layers.1": tmp_path / "alias" / "checkpoint-2"})
    applied = tailor("--apply", recipe)
    assert applied.returncode == 0, applied.stderr
    out = tmp_path / "composed"
    for rel, want in (("tokenizer_config.json", b'{"shared": true}\n'), ("docs/notes.txt", b"notes\n")):
        assert not (out / rel).is_symlink() and (out / rel).read_bytes() == want
    assert not (out / "global_step6").is_symlink() and (out / OPTIM_1).is_file()
    verified = tailor("--verify", recipe)
    assert verified.returncode == 0, verified.stdout + verified.stderr
    exported = tailor("--export", recipe, "--to", tmp_path / "hf")
    assert exported.returncode == 0, exported.stderr
    assert (tmp_path / "hf" / "tokenizer_config.json").read_bytes() == b'{"shared": true}\n'


def test_a_link_through_a_bind_mount_of_the_run_is_inside_it(hf, tmp_path):
    """The run reached by another name (a bind mount of it): compared by identity, a link into the
    run through that name is inside the run and read as its file; nothing else moved."""
    run, c6, _secret, recipe = hf
    (run / "shared").mkdir()
    (run / "shared" / "tokenizer_config.json").write_text('{"shared": true}\n')
    mount = tmp_path / "mnt"
    mount.mkdir()
    if subprocess.run(["mount", "--bind", run, mount], capture_output=True).returncode != 0:
        pytest.skip("bind mounts need root (or a user namespace) here")
    try:
        (c6 / "tokenizer_config.json").symlink_to(mount / "shared" / "tokenizer_config.json")
        applied = tailor("--apply", recipe)
        assert applied.returncode == 0, applied.stderr
        copied = tmp_path / "composed" / "tokenizer_config.json"
        assert not copied.is_symlink() and copied.read_bytes() == b'{"shared": true}\n'
    finally:
        subprocess.run(["umount", mount], check=True)


def test_a_link_to_a_folder_the_checkpoint_already_holds_is_refused(hf, tmp_path):
    """docs -> . (a loop) or -> the tag folder (its rank files copied as run-level files): refused."""
    run, c6, _secret, recipe = hf
    for target in (".", "global_step6"):
        _replace_with_link(c6 / "docs", target)
        assert_one_line_error(tailor("--apply", recipe, "--dry-run"), 4, f"{c6 / 'docs'} is a symbolic link",
                              "already holds")


# --- a link swapped in after the check (TOCTOU) ----------------------------------------------------

def test_a_file_swapped_for_a_link_after_the_check_is_not_read(hf, tmp_path, monkeypatch):
    """The copy checks the links on the way (`confine`), then opens: a link to the secret put in
    the file's place between the two is caught by the opened file's identity, and nothing is copied."""
    from tailor_tui.checked import files
    from tailor_tui.fileio import copy_file

    run, c6, secret, _recipe = hf
    victim = c6 / "generation_config.json"
    real_confine = files.confine

    def confine_then_swap(path, within):
        found = real_confine(path, within)
        _replace_with_link(victim, secret)  # the race, won by the attacker
        return found

    monkeypatch.setattr(files, "confine", confine_then_swap)
    with pytest.raises(CheckpointError, match="changed while it was opened"):
        copy_file(victim, tmp_path / "copied", within=run)
    assert not (tmp_path / "copied").exists()
    assert _leaked(tmp_path) == []
