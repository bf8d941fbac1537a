"""The package's structure is declared and checked, not remembered.

- `lint-imports` holds every import-linter contract in pyproject.toml: the subpackages' layers,
  the ground-floor root modules, no Textual in the core, no torch in the torch-free parts;
- the torch-free parts also import without torch and Textual, transitively (what a streaming
  worker or the planner pays at start-up), the modules named by that same contract;
- no module imports another module's private (`_name`) names;
- no module grows past the ceilings MAX_CODE_LINES lines of code or MAX_LINES lines in all, no
  subpackage past MAX_MODULES (review guidance sits well below them), and the root holds only the
  ground floor;
- every kind of job keeps the one job contract, and only team/ makes the team's calls;
- no mixins in the front end: no method types its `self` as something else (a part held together by a
  protocol), and the composer's screen is a Textual screen alone;
- ruff (imports sorted, F, B) and mypy find nothing;
- no two modules share a name, and no two classes are a letter apart.
"""

from __future__ import annotations

import ast
import inspect
import io
import pkgutil
import subprocess
import sys
import tokenize
import tomllib
from pathlib import Path

import tailor_tui

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "tailor_tui"
# A module's size is its code: the lines holding code, its docstrings, comments and blank lines not
# counted, so explaining a module never pushes it over, and squeezing prose out never makes room.
# Size is a smell, not a reason to split: past ~400 lines of code a module is looked at in review for
# a second job (docs/architecture.md, "Growing the code"); a module is split by concern, never to meet
# a number. These are hard ceilings only, well above the largest module (~400 lines of code, ~540 in
# all; a subpackage of 16 modules): what no module should reach whatever it does.
MAX_CODE_LINES = 800
MAX_LINES = 1000
MAX_MODULES = 24  # per subpackage, its __init__ included
ROOT_MODULES = {"__init__", "__main__", "errors", "units", "events", "progress_bars", "fileio", "held", "reading", "crc",
                "moved", "interrupts", "cloning"}


def contracts() -> list[dict]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]


def test_ruff_finds_nothing():
    """The import sorter and the linter (ruff: I, F, B; the config in pyproject.toml) over the package,
    the tests, the benchmarks and the docs' sample maker."""
    result = subprocess.run([str(Path(sys.executable).with_name("ruff")), "check", "--no-cache", "tailor_tui",
                             "tests", "bench", "docs"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]


def test_the_type_checker_finds_nothing():
    """mypy over the package (`[tool.mypy]` in pyproject.toml): every module checks clean; its cache
    lives with the runs' (a rerun checks only what changed)."""
    result = subprocess.run([sys.executable, "-m", "mypy", "--cache-dir", str(ROOT / ".tailor-cache" / "mypy")],
                            cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]


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


def code_lines(source: str) -> int:
    """The lines of `source` that hold code: not blank, not only a comment, not a docstring's."""
    docstrings = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                docstrings.update(range(first.lineno, first.end_lineno + 1))
    lines = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type not in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
                              tokenize.ENDMARKER):
            lines.update(range(token.start[0], token.end[0] + 1))
    return len(lines - docstrings)


def test_code_lines_count_code_alone():
    source = '''"""A module.

Its docstring.
"""

# a comment
X = [1,
     2]  # a trailing comment


def f():
    """A function's docstring."""
    return """a string that is code,
not a docstring"""
'''
    assert code_lines(source) == 5


def test_modules_and_subpackages_stay_small():
    too_long = []
    for _name, path in _modules():
        text = path.read_text()
        code, n = code_lines(text), len(text.splitlines())
        if code > MAX_CODE_LINES or n > MAX_LINES:
            too_long.append(f"{path.relative_to(ROOT)}: {code} lines of code, {n} lines")
    assert not too_long, too_long
    for package in (p for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()):
        modules = list(package.glob("*.py"))
        assert len(modules) <= MAX_MODULES, f"{package.name}: {len(modules)} modules"
    assert {p.stem for p in PACKAGE.glob("*.py")} <= ROOT_MODULES


OWN_COST_RULE: set[str] = set()  # jobs that work out their cost themselves: none


def test_every_job_keeps_the_job_contract():
    """Every kind of job (a frozen dataclass named `...Job`) has the task its progress is
    reported under and the bytes it reads and writes (`events.Job`): one contract for planners,
    workers, the team's division of work and the progress bars. Its cost and progress follow
    from its read_bytes and write_bytes by the one rule (`events.JobCost`), not a rule of its own;
    the jobs not there yet are named (OWN_COST_RULE), and only they."""
    import dataclasses
    import importlib

    from tailor_tui.events import Job, JobCost

    found, own_rule = [], set()
    for name, path in _modules():
        if name.startswith("tailor_tui.ui.") or name.endswith("__main__"):
            continue
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef) and node.name.endswith("Job"):
                cls = getattr(importlib.import_module(name), node.name)
                if dataclasses.is_dataclass(cls):
                    found.append(cls)
                    fields = {f.name for f in dataclasses.fields(cls)}
                    for attribute in ("task", "total_bytes", "progress_bytes"):
                        assert attribute in fields or isinstance(getattr(cls, attribute, None), property), \
                            f"{name}.{node.name} lacks {attribute} ({Job.__name__})"
                    assert cls.__dataclass_params__.frozen, f"{name}.{node.name} is not frozen"
                    by_rule = issubclass(cls, JobCost) and all(
                        inspect.getattr_static(cls, a) is JobCost.__dict__[a] for a in ("total_bytes", "progress_bytes"))
                    if by_rule:
                        for attribute in ("read_bytes", "write_bytes"):
                            assert attribute in fields or isinstance(getattr(cls, attribute, None), property), \
                                f"{name}.{node.name} lacks {attribute} ({JobCost.__name__})"
                    else:
                        own_rule.add(node.name)
    names = {cls.__name__ for cls in found}
    assert {"RankJob", "ReshardJob", "ModelFileJob", "BinFileJob", "ExportJob", "StatsJob"} <= names, names
    assert own_rule == OWN_COST_RULE, f"jobs with a cost rule of their own: {sorted(own_rule)}"


def test_the_job_cost_rule_gives_each_kind_of_job_its_numbers():
    """What each kind of job reports, by the one rule: a rank job costs what it reads and writes
    and shows what it writes, as `rank N`; a weight file job reads and writes its size; an export
    job of nothing still costs a byte (a bar never counts to zero)."""
    from pathlib import Path as P

    from tailor_tui.export.export_plan import ExportJob
    from tailor_tui.kinds.zero import ZeroRankFiles
    from tailor_tui.planning.jobs import BinFileJob, RankJob
    from tailor_tui.resharding.partition import ReshardJob

    rank = RankJob(3, {}, (), (), (), (), (), read_bytes=700, write_bytes=200)
    reshard = ReshardJob(2, "m", "o", {}, {}, (), (), (), read_bytes=50, write_bytes=20)
    weights = BinFileJob("pytorch_model.bin", P("b"), {}, {}, {}, {}, size=123)
    export = ExportJob("base rank 1", ZeroRankFiles(1, P("m"), P("o")), (), (), (), (), (), "BF16", 0, 0)
    assert (rank.task, rank.total_bytes, rank.progress_bytes) == ("rank 3", 900, 200)
    assert (reshard.task, reshard.total_bytes, reshard.progress_bytes) == ("rank 2", 70, 20)
    assert (weights.task, weights.total_bytes, weights.progress_bytes) == ("pytorch_model.bin", 246, 123)
    assert (export.task, export.total_bytes, export.progress_bytes) == ("base rank 1", 1, 1)


def test_team_calls_are_made_by_the_team_skeleton_alone():
    """Gathering, sharing, agreeing and dividing the work happen in one place (team/): every
    kind of work plugs its stages into `transaction.run_as_team` instead of weaving the calls in."""
    import re

    for _name, path in _modules():
        if path.parent.name == "team":
            continue
        calls = re.findall(r"\bteam\.(gather|share|agree|mine|working|post|peek)\(", path.read_text())
        assert not calls, f"{path.relative_to(ROOT)} calls team.{calls[0]}(): plug into team/transaction.py instead"


def test_no_mixins():
    """Widgets own their state and the screen wires them: no class of the front end is a part mixed into another
    that types its `self` as the class it will be mixed into, and the composer's screen derives from Textual's screen
    alone. (The jobs' one cost rule, `events.JobCost`, is such a trait of plain dataclasses, on purpose.)"""
    from textual.screen import Screen

    from tailor_tui.ui.composer import ComposerScreen

    typed = []
    for _name, path in _modules():
        if path.parent.name != "ui":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.args.args:
                first = node.args.args[0]
                if first.arg == "self" and first.annotation is not None:
                    typed.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}")
    assert typed == [], f"methods typing their self (a mixin's mark): {typed}"
    assert ComposerScreen.__bases__ == (Screen,)


def test_each_module_has_a_name_of_its_own():
    """No two modules of the package share a file name, and none is named as a subpackage (a reader
    of `folder` or `plan` would not know which)."""
    packages = {p.parent.name for p in PACKAGE.rglob("__init__.py")} - {PACKAGE.name}
    seen: dict[str, Path] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.stem in ("__init__", "__main__"):
            continue
        assert path.stem not in seen, f"{path.relative_to(ROOT)} and {seen[path.stem].relative_to(ROOT)}"
        assert path.stem not in packages, f"{path.relative_to(ROOT)} is named as the subpackage {path.stem}/"
        seen[path.stem] = path


# Classes of the same name in two places, each the verifier's own re-derivation of the writers' (on purpose).
SAME_NAME_ON_PURPOSE = {"Piece", "Record", "_Parameter"}


def test_no_two_classes_are_told_apart_by_a_letter():
    """Two classes for different things never share a name, nor differ by one letter (ComposeScreen
    beside ComposerScreen) or by case alone (DType beside Dtype)."""
    import itertools

    where: dict[str, list[str]] = {}
    for name, path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                where.setdefault(node.name.lstrip("_"), []).append(name)
    twice = {n: w for n, w in where.items() if len(w) > 1 and n not in {s.lstrip("_") for s in SAME_NAME_ON_PURPOSE}}
    assert not twice, twice

    def one_letter(a: str, b: str) -> bool:
        if a == b:  # (names that differ by case alone)
            return True
        if len(a) == len(b):
            return sum(x != y for x, y in zip(a, b)) == 1
        short, long = sorted((a, b), key=len)
        return len(long) - len(short) == 1 and any(long[:i] + long[i + 1:] == short for i in range(len(long)))

    close = [(a, b) for a, b in itertools.combinations(sorted(where), 2) if one_letter(a.lower(), b.lower())]
    assert not close, close
