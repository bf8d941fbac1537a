"""Checkpoints written under another Python are read: a real run trained by a second interpreter.

Early Python 3.11 releases (3.11.2, Debian 12's python3, is one) pickle an enum member by name,
`getattr(ZeroStageEnum, 'weights')`, where other releases pickle `ZeroStageEnum(3)`; DeepSpeed's
optim files hold one. The demo run is trained with the installed DeepSpeed under the machine's other
interpreter of this minor release (`conftest.other_python`; its compiled packages are this
environment's), then composed, verified, written back by the torch-free writer and resumed here.
The rule itself (getattr is honoured for a member of an allowed enumeration, by name, and nothing
else) is tested on crafted pickles in test_formats.py.
"""

from __future__ import annotations

import math
import subprocess
import zipfile

import pytest
from conftest import INSTALLED_DEEPSPEED, checkpoints_of, other_python, resume_with
from helpers import apply_and_verify, assert_rows_from_picks, two_checkpoint_picks, write_recipe

from tailor_tui.formats.pickled import ZeroStageEnum
from tailor_tui.formats.ptfile import read_structure
from tailor_tui.formats.ptpickle import dumps

_BY_NAME = ("import enum, pickle\n"
            "class E(enum.Enum):\n    a = 1\n"
            "print(b'getattr' in pickle.dumps(E.a, 2))\n")


@pytest.fixture(scope="module")
def python():
    found = other_python()
    if found is None:
        pytest.skip("no second interpreter of this Python's minor release on this machine")
    return found


def test_a_run_trained_under_another_python_composes_verifies_and_resumes(real_run, python, tmp_path):
    run, spec = real_run("demo", python=python)
    oldest, _middle, newest = checkpoints_of(run, spec)
    by_name = subprocess.run([python[0], "-c", _BY_NAME], capture_output=True, text=True).stdout.strip() == "True"
    for optim in newest.rglob("*optim_states.pt"):  # the form that interpreter pickles an enum member in
        with zipfile.ZipFile(optim) as z:
            pickled = z.read(next(n for n in z.namelist() if n.endswith("/data.pkl")))
        assert (b"__builtin__\ngetattr\n" in pickled) == by_name, optim
        structure, _records, _prefix = read_structure(optim)
        zero_stage = structure["optimizer_state_dict"]["zero_stage"]
        assert isinstance(zero_stage, ZeroStageEnum) and zero_stage == 3
        assert dumps(structure, location=None)[0] == pickled  # written back as that interpreter wrote it

    picks = {**two_checkpoint_picks(spec, oldest), "layers.2": oldest}  # layers.2 blew up before the newest
    recipe = write_recipe(tmp_path, newest, picks)
    apply_and_verify(recipe)
    out = tmp_path / "composed"
    assert_rows_from_picks(out, picks, newest)
    losses = resume_with(INSTALLED_DEEPSPEED, out, spec, tmp_path / "resume")
    assert losses and all(math.isfinite(x) for x in losses)
