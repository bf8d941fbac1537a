"""The hidden folder held open (`tailor_tui.held`): what is made in it goes in by its descriptor, never by
its path, so a folder renamed aside and replaced (in a folder others can write) keeps what the job
writes, and a link on the way is never followed. Where the job's writers use it, with a real other
user: tests/test_other_users.py."""

from __future__ import annotations

import os
import pickle

import pytest

from tailor_tui import fileio
from tailor_tui.errors import OutputError
from tailor_tui.held import HeldFolder


def test_files_go_into_the_folder_made_wherever_it_was_renamed(tmp_path):
    held = HeldFolder.make(tmp_path / "hidden")
    os.rename(tmp_path / "hidden", tmp_path / "aside")
    (tmp_path / "hidden").mkdir()  # another folder at its path
    (held / "global_step6").mkdir()
    fileio.write_file(held / "global_step6/rank.pt", b"x")
    fileio.write_file(held / "latest", "global_step6")
    assert sorted(p.name for p in (tmp_path / "aside").rglob("*")) == ["global_step6", "latest", "rank.pt"]
    assert list((tmp_path / "hidden").iterdir()) == []


def test_a_link_inside_is_never_followed(tmp_path):
    held = HeldFolder.make(tmp_path / "hidden")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "hidden" / "tag").symlink_to(elsewhere)
    (tmp_path / "hidden" / "file").symlink_to(elsewhere / "file")
    with pytest.raises(OutputError, match="rank.pt: cannot write"):  # the file it could not write, named
        fileio.write_file(held / "tag/rank.pt", b"x")
    with pytest.raises(OSError):
        (held / "tag").mkdir(exist_ok=True)
    with pytest.raises(OutputError, match="file: cannot write"):
        fileio.write_file(held / "file", b"x")
    assert list(elsewhere.iterdir()) == []


def test_a_copy_in_another_process_checks_it_holds_the_same_folder(tmp_path):
    held = HeldFolder.make(tmp_path / "hidden")
    travelled = pickle.loads(pickle.dumps(held))  # as a task reaches a worker
    fileio.write_file(travelled / "a", b"x")
    assert (tmp_path / "hidden" / "a").read_bytes() == b"x"

    travelled = pickle.loads(pickle.dumps(held))
    os.rename(tmp_path / "hidden", tmp_path / "aside")
    (tmp_path / "hidden").mkdir()
    with pytest.raises(OutputError, match="no longer the folder tailor-tui made there"):
        fileio.write_file(travelled / "b", b"x")
    os.rmdir(tmp_path / "hidden")
    (tmp_path / "hidden").symlink_to(tmp_path / "aside")  # the same folder, through a link: not followed
    with pytest.raises(OutputError, match="no longer the folder tailor-tui made there"):
        fileio.write_file(pickle.loads(pickle.dumps(held)) / "b", b"x")


def test_a_place_never_climbs_out(tmp_path):
    held = HeldFolder.make(tmp_path / "hidden")
    with pytest.raises(ValueError):
        held / "../escape"


def test_a_write_into_the_folder_after_it_was_removed_says_so_not_the_disk(tmp_path):
    """Another process of the job (or another user) removes the folder this one holds open: what fails
    next is that, one line, not "cannot write (No such file or directory)"."""
    import shutil

    held = HeldFolder.make(tmp_path / ".out")
    (held / "tag").mkdir()
    os.rename(tmp_path / ".out", tmp_path / ".out.aside")
    shutil.rmtree(tmp_path / ".out.aside")
    for act in (lambda: (held / "tag" / "f").open(os.O_WRONLY | os.O_CREAT),
                lambda: (held / "other").mkdir(),
                lambda: (held / "tag" / "g").unlink()):
        with pytest.raises(OutputError, match="no longer the folder tailor-tui made there"):
            act()
    error = fileio.output_error(OSError(28, "No space left on device"), held / "tag" / "f")
    assert "no longer the folder tailor-tui made there" in str(error)
