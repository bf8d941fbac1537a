"""Every hostile input the command line reads, refused as issue 30 asks: one `error: ` line, the
documented exit code, under 256 MiB of peak memory, nothing written (no output, no recipe, no
hidden `.tailor-*` folder or lock beside it, no source changed). Each case (tests/refusal_cases.py,
which bench/bench_refusals.py times) is built on a copy of one real run: a FIFO, a link to
/dev/zero, an oversized or deeply nested file in place of each file read, zip archives whose
directory claims too much, pickles that would do unbounded work, safetensors headers that claim
too much. A few inputs are tolerated instead (a log or a cache that cannot be read is skipped):
those cases end with exit 0, within the same bounds. Wall time is measured by the bench, not here."""

from __future__ import annotations

import shutil

import pytest
from helpers import assert_one_line_error, tailor_peak
from refusal_cases import CASES, RUN_SPEC, snapshot

PEAK = 256 << 20


@pytest.fixture(scope="module")
def source(real_run):
    return real_run(RUN_SPEC)[0]


@pytest.mark.parametrize("name", list(CASES))
def test_a_hostile_input_is_refused_in_one_line_within_bounds_writing_nothing(source, tmp_path, name):
    run = tmp_path / "run"
    shutil.copytree(source, run, symlinks=True)
    case = CASES[name](run, tmp_path)
    before = snapshot(tmp_path)
    result, peak = tailor_peak(*case.args, env={"TAILOR_TUI_CACHE": str(tmp_path / "cache"), **case.env},
                               timeout=120)
    assert peak < PEAK, f"{peak >> 20} MiB"
    if case.code:
        assert_one_line_error(result, case.code, *case.needles)
        after = snapshot(tmp_path)
        assert after == before, sorted(set(after.items()) ^ set(before.items()))
    else:  # tolerated: the command does its work, saying what it skipped
        assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
        assert all(needle in result.stderr for needle in case.needles), result.stderr

