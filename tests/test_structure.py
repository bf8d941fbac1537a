"""The package's structure is declared and checked, not remembered.

- `lint-imports` holds every import-linter contract in pyproject.toml: the subpackages' layers,
  the ground-floor root modules, no Textual in the core, no torch in the torch-free parts;
- the torch-free parts also import without torch and Textual, transitively (what a streaming
  worker or the planner pays at start-up), the modules named by that same contract;
- no module imports another module's private (`_name`) names;
- no module grows past MAX_LINES, no subpackage past MAX_MODULES, and the root holds only the
  ground floor;
- every kind of job keeps the one job contract, and only team/ makes the team's calls.
"""

from __future__ import annotations

import ast
import pkgutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import tailor_tui

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "tailor_tui"
MAX_LINES = 400  # no module over 400 lines
MAX_MODULES = 16  # per subpackage, its __init__ included: headroom over the largest (14); past it, split by concern
ROOT_MODULES = {"__init__", "__main__", "errors", "units", "events", "report", "fileio", "reading", "crc", "moved"}


def contracts() -> list[dict]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]


def test_import_contracts_hold():
    result = subprocess.run([str(Path(sys.executable).with_name("lint-imports"))], cwd=ROOT,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    assert "broken" not in result.stdout.lower().split("contracts:")[-1].replace("0 broken", "")


def _expand(names: list[str]) -> list[str]:
    """Modules named, packages expanded to every module under them."""
    found = []
    for name in names:
        module = __import__(name, fromlist=["_"])
        found.append(name)
        if hasattr(module, "__path__"):
            found += [m.name for m in pkgutil.walk_packages(module.__path__, name + ".")]
    return found


def test_torch_free_parts_import_without_torch_or_textual():
    """Scanning, planning, the streaming workers and the statistics workers start without torch:
    importing any module of the torch-free contract imports neither torch nor Textual."""
    torch_free = next(c for c in contracts() if "torch" in c.get("forbidden_modules", ()))
    modules = _expand(torch_free["source_modules"])
    assert "tailor_tui.compose.rank_stream" in modules and "tailor_tui.planning.plan" in modules
    code = "".join(f"import {m}\n" for m in modules) + (
        "import sys\nassert 'torch' not in sys.modules, 'torch imported'\n"
        "assert 'textual' not in sys.modules, 'textual imported'\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def _modules() -> list[tuple[str, Path]]:
    return [(m.name, Path(m.module_finder.path) / (m.name.rsplit(".", 1)[-1] + ".py"))
            for m in pkgutil.walk_packages(tailor_tui.__path__, "tailor_tui.") if not m.ispkg]


def test_no_module_imports_another_modules_private_names():
    found = []
    for name, path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("tailor_tui"):
                found += [f"{name} imports {node.module}.{a.name}" for a in node.names
                          if a.name.startswith("_") and not a.name.startswith("__")]
    assert not found, found


def test_modules_and_subpackages_stay_small():
    too_long = [f"{path.relative_to(ROOT)}: {n} lines" for _name, path in _modules()
                if (n := len(path.read_text().splitlines())) > MAX_LINES]
    assert not too_long, too_long
    for package in (p for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()):
        modules = list(package.glob("*.py"))
        assert len(modules) <= MAX_MODULES, f"{package.name}: {len(modules)} modules"
    assert {p.stem for p in PACKAGE.glob("*.py")} <= ROOT_MODULES


def test_every_job_keeps_the_job_contract():
    """Every kind of job (a frozen dataclass named `...Job`) has the task its progress is
    reported under and the bytes it reads and writes (`events.Job`): one contract for planners,
    workers, the team's division of work and the progress bars."""
    import dataclasses
    import importlib

    from tailor_tui.events import Job

    found = []
    for name, path in _modules():
        if name.startswith("tailor_tui.ui.") or name.endswith("__main__"):
            continue
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef) and node.name.endswith("Job"):
                cls = getattr(importlib.import_module(name), node.name)
                if dataclasses.is_dataclass(cls):
                    found.append(cls)
                    fields = {f.name for f in dataclasses.fields(cls)}
                    for attribute in ("task", "total_bytes"):
                        assert attribute in fields or isinstance(getattr(cls, attribute, None), property), \
                            f"{name}.{node.name} lacks {attribute} ({Job.__name__})"
                    assert cls.__dataclass_params__.frozen, f"{name}.{node.name} is not frozen"
    names = {cls.__name__ for cls in found}
    assert {"RankJob", "ReshardJob", "ModelFileJob", "BinFileJob", "ExportJob", "StatsJob"} <= names, names


def test_team_calls_are_made_by_the_team_skeleton_alone():
    """Gathering, sharing, agreeing and dividing the work happen in one place (team/): every
    kind of work plugs its stages into `transaction.run_as_team` instead of weaving the calls in."""
    import re

    for _name, path in _modules():
        if path.parent.name == "team":
            continue
        calls = re.findall(r"\bteam\.(gather|share|agree|mine|working|post|peek)\(", path.read_text())
        assert not calls, f"{path.relative_to(ROOT)} calls team.{calls[0]}(): plug into team/transaction.py instead"


# Every import path a name left, and the module it lives in now: the old path keeps working, warning.
MOVED = [
    ("tailor_tui.formats.pickled", "MAX_MEMO", "tailor_tui.formats.pickle_bounds"),
    ("tailor_tui.compose.rank_stream", "dtype_mismatch", "tailor_tui.checkpoints.rank_reader"),
    ("tailor_tui.compose.rank_stream", "tensor_bytes", "tailor_tui.checkpoints.rank_reader"),
    ("tailor_tui.compose.rank_stream", "flat_tensor_bytes", "tailor_tui.checkpoints.rank_reader"),
    ("tailor_tui.checkpoints.partial_rows", "crc_range_checked", "tailor_tui.checkpoints.rank_reader"),
]


@pytest.mark.parametrize("old, name, new", MOVED)
def test_a_moved_name_is_still_found_where_it_was(old, name, new):
    import importlib

    with pytest.warns(DeprecationWarning, match=f"{old}.{name} is now {new}.{name}"):
        found = getattr(importlib.import_module(old), name)
    assert found is getattr(importlib.import_module(new), name)
    with pytest.raises(AttributeError):
        getattr(importlib.import_module(old), "no_such_name_anywhere")
