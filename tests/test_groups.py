"""The suite's own grouping (`groups`, for `make test`'s `--dist loadgroup`): tests sharing a module-scoped fixture
run in one test process, the fixture made once per parameter (two processes each made the architectures' and the
vision-language models' compositions, a minute and a half of the suite, while the groups were named so that
pytest-xdist found none)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent

MODULE = '''
import pytest


@pytest.fixture(scope="module", params=["a", "b[1]"])
def made(request, tmp_path_factory):
    with open(MADE, "a") as f:
        f.write(request.param + "\\n")
    return request.param


@pytest.mark.parametrize("k", range(4))
def test_uses_it(made, k):
    pass


def test_also(made):
    pass


def test_alone():
    pass


@pytest.fixture(scope="module")
def compositions():
    made = set()

    def get(name):
        if name not in made:
            made.add(name)
            with open(MADE, "a") as f:
                f.write("composed-" + name + "\\n")
        return name
    return get


@pytest.fixture
def variant(request, compositions):
    return compositions(request.param)


@pytest.mark.parametrize("variant", ["x", "y"], indirect=True)
@pytest.mark.parametrize("k", range(3))
def test_variant(variant, k):
    pass
'''


def test_the_tests_sharing_a_module_fixture_run_in_one_process_which_makes_it_once(tmp_path):
    made = tmp_path / "made.txt"
    (tmp_path / "test_shared.py").write_text(f"MADE = {str(made)!r}\n" + MODULE)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "groups", "-p", "no:cacheprovider", "-n", "2", "--dist", "loadgroup",
         "-v", "--rootdir", str(tmp_path), "-c", os.devnull, str(tmp_path / "test_shared.py")],
        capture_output=True, text=True, timeout=300, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(TESTS)})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    ran = re.findall(r"\[(gw\d+)\] +\[ *\d+%\] PASSED \S+::(test_\w+)(?:\[([^@ ]*)\])?", done.stdout)
    assert len(ran) == 17, done.stdout
    where: dict[str, set[str]] = {}
    for worker, test, params in ran:
        group = {"test_uses_it": params[:-2], "test_also": params, "test_variant": params[-1:]}.get(test)
        if group is not None:
            where.setdefault(group, set()).add(worker)
    assert {group: len(workers) for group, workers in where.items()} == {"a": 1, "b[1]": 1, "x": 1, "y": 1}, \
        done.stdout  # each parameter's tests in one process
    assert sorted(made.read_text().split()) == ["a", "b[1]", "composed-x", "composed-y"], done.stdout  # made once
    groups = set(re.findall(r"PASSED \S+::\w+(?:\[[^@ ]*\])?@(\S+)", done.stdout))
    # grouped by the parameters of the module's fixtures, those of a test alone left out; no brackets in a name
    assert groups == {"test_shared-a", "test_shared-b(1)", "test_shared-x", "test_shared-y"}, done.stdout
