"""The public API is what the README and docs show, and the paths an earlier README showed keep working for one
minor release (`tailor_tui.moved`, CHANGELOG.md):

- the old paths kept are exactly those an earlier README showed (`SHOWN_BEFORE`), each named in CHANGELOG.md
  with the release it goes in; imported in a fresh interpreter, each warns once naming its new module
  (`-W error::DeprecationWarning` makes its import fail), and holds its new module's very objects;
- each subpackage gives its public API (`__all__`) without a warning, found in its modules when first used;
- `import tailor_tui` and every subpackage's `__init__` import no torch, transformers, DeepSpeed or
  Textual; every subpackage declares `__all__`, and each of its entries is found;
- every `import tailor_tui…` and `from tailor_tui… import …` line of the README and docs/ runs, and
  names no old path.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tailor_tui import moved

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "tailor_tui"
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

def _run(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def _home(home: str, name: str):
    module, _, new = home.partition(":")
    return getattr(importlib.import_module(module), new or name)


def test_no_old_path_has_a_module_of_its_own():
    """The hook serves a path only where no module exists (it comes after the path finder): an old
    path's file would hide it, and each new module exists."""
    for old, new in moved.MODULES.items():
        assert importlib.util.find_spec(new) is not None, f"{old}: no module {new}"
        parent, _, leaf = old.rpartition(".")
        folder = PACKAGE.joinpath(*parent.split(".")[1:])
        assert not (folder / f"{leaf}.py").exists() and not (folder / leaf).is_dir(), f"{old} is a module"


def test_the_old_paths_kept_are_those_an_earlier_readme_showed_until_the_release_the_changelog_names():
    shown = {new_module for _line, new_module in SHOWN_BEFORE if new_module}
    assert set(moved.MODULES.values()) <= shown, set(moved.MODULES.values()) - shown
    changelog = (ROOT / "CHANGELOG.md").read_text()
    for old in moved.MODULES:
        assert re.search(rf"`{re.escape(old)}`[^\n]*until 0\.2", changelog), old


# In a fresh interpreter: the import warns (an error under -W error), then, warnings printed as
# `-W default` prints them, the old module's names are the new module's objects.
_SHIM_CHECK = """
import importlib, sys, warnings
from tailor_tui import moved
old, new = sys.argv[1], moved.MODULES[sys.argv[1]]
warnings.simplefilter("error", DeprecationWarning)
try:
    importlib.import_module(old)
    print("no warning")
except DeprecationWarning as w:
    print("raised:", w)
assert old not in sys.modules
warnings.resetwarnings()
warnings.simplefilter("default")
shim, target = importlib.import_module(old), importlib.import_module(new)
names = [n for n in vars(target) if not n.startswith("_")]
wrong = [n for n in names if getattr(shim, n) is not getattr(target, n)]
print("wrong:", wrong, len(names))
"""


@pytest.mark.parametrize("old", sorted(moved.MODULES))
def test_an_old_module_path_warns_once_and_holds_the_new_modules_objects(old):
    new = moved.MODULES[old]
    result = _run("-c", _SHIM_CHECK, old)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    # (a name renamed as its module moved is named in the one warning: `(its Composition: RecipeDraft)`)
    renamed = "".join(f" (its {name}: {now})" for (path, name), now in moved.RENAMED.items() if path == old)
    assert lines[0] == f"raised: {old}{renamed} is now {new}", result.stdout
    assert lines[1].startswith("wrong: [] ") and int(lines[1].split()[-1]) > 0, lines[1]
    ours = [line for line in result.stderr.splitlines() if "DeprecationWarning: tailor_tui" in line]
    assert len(ours) == 1 and ours[0].endswith(f"DeprecationWarning: {old}{renamed} is now {new}"), \
        result.stderr[-3000:]


# The import lines an earlier README showed (`git log -p README.md docs/`), as a script would use them, and
# the module each old path is now (None: a path that never moved).
SHOWN_BEFORE = [
    ("from tailor_tui.selective import save_rows", None),
    ("from tailor_tui.selective.saver import Parity, SelectiveSaver, save_rows", None),
    ("from tailor_tui.selective.hf import SelectiveCheckpointCallback", None),
    ("from tailor_tui.selective.run_saves import resume_point", None),
    ("from tailor_tui.ui.actions import ACTIONS, GROUPS", None),
    ("from tailor_tui.selective_hf import SelectiveCheckpointCallback", "tailor_tui.selective.hf"),
    ("from tailor_tui.run_saves import resume_point", "tailor_tui.selective.run_saves"),
    ("from tailor_tui import demo_run", "tailor_tui.demo.demo_run"),  # (`python -m tailor_tui.demo_run`)
    ("from tailor_tui.runs.demo_run import DEMO, make_run", "tailor_tui.demo.demo_run"),  # (`make demo-resume`)
    # a module the subpackages' __all__ declared public (compose's), moved with its class renamed
    ("from tailor_tui.compose.composition import Composition", "tailor_tui.planning.recipe_draft"),
]


@pytest.mark.parametrize("line, new", SHOWN_BEFORE)
def test_an_old_import_line_runs_with_one_warning(line, new):
    """`python -W error::DeprecationWarning` refuses a deprecated path; `-W default` prints one warning."""
    strict = _run("-W", "error::DeprecationWarning", "-c", line)
    if new is None:
        assert strict.returncode == 0, strict.stderr[-3000:]
        return
    assert strict.returncode == 1 and "DeprecationWarning: tailor_tui." in strict.stderr, strict.stderr[-3000:]
    shown = _run("-W", "default", "-c", line)
    assert shown.returncode == 0, shown.stderr[-3000:]
    ours = [x for x in shown.stderr.splitlines() if "DeprecationWarning: tailor_tui" in x]
    assert len(ours) == 1 and ours[0].endswith(f" is now {new}"), shown.stderr[-3000:]


_ = "tailor_tui."
# Each subpackage whose public API is found in its modules when first used: each name, where it lives, and
# whether it warns (none does: its public API).
PACKAGE_NAMES = {
    "tailor_tui.selective": {
        **{n: (_ + "selective.saver", False) for n in ("partial_name", "row_naming", "model_rows", "save_rows",
                                                       "Parity", "Filter", "SelectiveSaver")},
        **{n: (_ + "selective.hf", False) for n in ("SelectiveCheckpointCallback", "StaleStartError")},
        **{n: (_ + "selective.run_saves", False) for n in ("resume_point", "Save")}},
    "tailor_tui.health": {n: (_ + "health.healing", False) for n in ("Health", "Healing", "heal", "TrainingLog",
                                                                    "training_log", "why_unhealthy")},
    "tailor_tui.export": {n: (_ + "export.export_run", False) for n in ("run_export", "ExportResult")},
    "tailor_tui.team": {**{n: (_ + "team.members", False) for n in ("Team", "TeamError", "SOLO")},
                        "connect": (_ + "team.meet", False)},
}

_PACKAGE_CHECK = """
import importlib, json, sys, warnings
package, names = sys.argv[1], json.loads(sys.argv[2])
found = {}
for name, (home, _) in names.items():
    module, _, now = home.partition(":")
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        try:
            value = getattr(importlib.import_module(package), name)
            said = None
        except DeprecationWarning as w:
            said = str(w)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        value = getattr(importlib.import_module(package), name)
    ours = [str(w.message) for w in caught if str(w.message).startswith("tailor_tui")]
    found[name] = [said, ours, value is getattr(importlib.import_module(module), now or name)]
print(json.dumps(found))
"""


@pytest.mark.parametrize("package", sorted(PACKAGE_NAMES))
def test_a_subpackages_public_api_is_found_in_its_modules(package):
    names = PACKAGE_NAMES[package]
    result = _run("-c", _PACKAGE_CHECK, package, json.dumps(names))
    assert result.returncode == 0, result.stderr[-3000:]
    found = json.loads(result.stdout.splitlines()[-1])
    for name, (home, warns) in names.items():
        said, ours, same = found[name]
        module, _, now = home.partition(":")
        expected = f"{package}.{name} is now {module}.{now or name}" if warns else None
        assert (said, ours, same) == (expected, [expected] if warns else [], True), name
    public = {name for name, (_, warns) in names.items() if not warns}
    assert public <= set(importlib.import_module(package).__all__)


def _subpackages() -> list[str]:
    return sorted(f"tailor_tui.{p.parent.name}" for p in PACKAGE.glob("*/__init__.py"))


def test_the_package_and_each_subpackage_import_no_torch():
    code = "".join(f"import {m}\n" for m in ["tailor_tui", *_subpackages()]) + (
        "import sys\nprint([m for m in ('torch', 'transformers', 'deepspeed', 'textual') if m in sys.modules])\n")
    result = _run("-W", "error::DeprecationWarning", "-c", code)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["[]"], result.stdout


@pytest.mark.parametrize("package", _subpackages())
def test_each_subpackage_declares_its_public_api(package):
    module = importlib.import_module(package)
    assert module.__all__ and len(set(module.__all__)) == len(module.__all__), package
    for name in module.__all__:
        if importlib.util.find_spec(f"{package}.{name}") is None:
            assert getattr(module, name) is not None, f"{package}.{name}"


_IMPORT = re.compile(r"^\s*((?:from tailor_tui[\w.]* import [\w, ]+)|(?:import tailor_tui[\w.]*(?: as \w+)?))\s*$", re.M)


def test_every_import_the_readme_and_docs_show_runs():
    """Each line alone, in a fresh interpreter that turns a DeprecationWarning into an error: the
    docs show no old path."""
    lines = sorted({m for page in PAGES for m in _IMPORT.findall(page.read_text())})
    assert any("tailor_tui.selective" in line for line in lines), lines
    code = ("import json\nfailed = {}\nfor line in json.loads(%r):\n    try:\n        exec(line, {})\n"
            "    except Exception as e:\n        failed[line] = repr(e)\nprint(json.dumps(failed))\n") % json.dumps(lines)
    result = _run("-W", "error::DeprecationWarning", "-c", code)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout.splitlines()[-1]) == {}


@pytest.mark.parametrize("old, warns", [("tailor_tui.demo_run", True), ("tailor_tui.runs.demo_run", True),
                                        ("tailor_tui.cli", False)])
def test_an_old_module_still_runs_with_python_m(old, warns):
    """`python -m tailor_tui.demo_run` (the docs before the subpackages) runs its new module, warning;
    `python -m tailor_tui.cli` is the command line, as before."""
    result = _run("-W", "default", "-m", old, "--help")
    assert "usage:" in (result.stdout + result.stderr).lower(), result.stdout[-2000:] + result.stderr[-3000:]
    ours = [x for x in result.stderr.splitlines() if "DeprecationWarning: tailor_tui" in x]
    assert ours == ([f"{ours[0].split(': ')[0]}: DeprecationWarning: {old} is now {moved.MODULES[old]}"]
                    if warns else []), result.stderr[-3000:]
