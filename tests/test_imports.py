"""Every import path users were shown, or could use, keeps working (`tailor_tui.moved`).

- every root module of the package before the subpackages (commit 675123b) is still a path: a
  current root module, a subpackage, or an old path the import hook serves (`moved.MODULES`);
- each old path, imported in a fresh interpreter, warns once naming its new module
  (`-W error::DeprecationWarning` makes its import fail), and holds its new module's very objects;
- the old modules now a subpackage's name (selective, health, export, cli, team) give their names from
  the subpackage: its public API without a warning, the others warning once, naming their module;
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

# The package's root modules before the subpackages (`git ls-tree 675123b^ tailor_tui/`), and ptzip (before 948eca2).
ROOT_BEFORE_SUBPACKAGES = """
    bin_files cache checkpoint cli cli_export compare composition crc demo_run ds_format dtypes errors events export
    export_plan export_rank file_plan fileio guard health health_report jobs launch layout merge model_files
    model_layout nonfinite output partial_rows pickled plan ptedit ptfile ptlegacy ptpickle ptwrite ptzip rank_partial
    rank_reshard rank_stream rank_task rank_torch recipe report reshard reshard_skeleton rows run_accelerate
    run_models run_saves safe_load safetensors_in safetensors_out sbatch scan_cache selective selective_hf stats_job
    stats_rank stats_run team team_progress units verify verify_reshard weight_files workers""".split()
NOW_A_SUBPACKAGE = ["selective", "health", "export", "cli", "team"]
NOW_TEST_CODE = {"run_accelerate": "tests/accelerate_run.py"}  # a module only the tests ran: no path kept


def _run(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def _home(home: str, name: str):
    module, _, new = home.partition(":")
    return getattr(importlib.import_module(module), new or name)


def test_every_root_module_before_the_subpackages_is_still_a_path():
    lost = [m for m in ROOT_BEFORE_SUBPACKAGES if f"tailor_tui.{m}" not in moved.MODULES
            and not (PACKAGE / f"{m}.py").is_file() and not (PACKAGE / m / "__init__.py").is_file()]
    assert lost == list(NOW_TEST_CODE), lost
    assert all((ROOT / path).is_file() for path in NOW_TEST_CODE.values())
    assert all((PACKAGE / m / "__init__.py").is_file() for m in NOW_A_SUBPACKAGE)


def test_no_old_path_has_a_module_of_its_own():
    """The hook serves a path only where no module exists (it comes after the path finder): an old
    path's file would hide it, and each new module exists."""
    for old, new in moved.MODULES.items():
        assert importlib.util.find_spec(new) is not None, f"{old}: no module {new}"
        parent, _, leaf = old.rpartition(".")
        folder = PACKAGE.joinpath(*parent.split(".")[1:])
        assert not (folder / f"{leaf}.py").exists() and not (folder / leaf).is_dir(), f"{old} is a module"
    assert set(moved.RENAMED) <= set(moved.MODULES), set(moved.RENAMED) - set(moved.MODULES)


# In a fresh interpreter: the import warns (an error under -W error), then, warnings printed as
# `-W default` prints them, the old module's names are the new module's objects, and its renamed names
# those they were renamed to.
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
for name, home in moved.RENAMED.get(old, {}).items():
    module, _, now = home.partition(":")
    if getattr(shim, name) is not getattr(importlib.import_module(module), now or name):
        wrong.append(name)
print("wrong:", wrong, len(names))
"""


@pytest.mark.parametrize("old", sorted(moved.MODULES))
def test_an_old_module_path_warns_once_and_holds_the_new_modules_objects(old):
    new = moved.MODULES[old]
    result = _run("-c", _SHIM_CHECK, old)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert lines[0] == f"raised: {old} is now {new}", result.stdout
    assert lines[1].startswith("wrong: [] ") and int(lines[1].split()[-1]) > 0, lines[1]
    ours = [line for line in result.stderr.splitlines() if "DeprecationWarning: tailor_tui" in line]
    assert len(ours) == 1 and ours[0].endswith(f"DeprecationWarning: {old} is now {new}"), result.stderr[-3000:]


# The paths users were shown before the subpackages, and a name of each, as a script would use them.
SHOWN_BEFORE = [
    ("from tailor_tui.selective import save_rows", None),
    ("from tailor_tui.selective_hf import SelectiveCheckpointCallback", "tailor_tui.selective.hf"),
    ("from tailor_tui.run_saves import resume_point", "tailor_tui.selective.run_saves"),
    ("import tailor_tui.checkpoint", "tailor_tui.checkpoints.checkpoint"),
    ("from tailor_tui.merge import run_merge", "tailor_tui.compose.compose_run"),
    ("from tailor_tui import demo_run", "tailor_tui.runs.demo_run"),
    ("from tailor_tui.health import rms", "tailor_tui.health.healing.rms"),
    ("from tailor_tui.planning.recipe import load_recipe", "tailor_tui.planning.recipe_file.load_recipe"),
    ("import tempfile; from pathlib import Path; from tailor_tui.planning.recipe import Recipe; "
     "assert Recipe(base=Path('b')).save(Path(tempfile.mkdtemp(), 'r.yaml')).read_text().count('base: ')",
     "tailor_tui.planning.recipe_file.save_recipe()"),
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
# The old modules now a subpackage's name: each of their names (those that still exist), where it lives
# now, and whether it is an old path (a warning) or the subpackage's public API (none).
PACKAGE_NAMES = {
    "tailor_tui.selective": {
        **{n: (_ + "selective.saver", False) for n in ("partial_name", "row_naming", "model_rows", "save_rows",
                                                       "Parity", "Filter", "SelectiveSaver")},
        **{n: (_ + "selective.hf", False) for n in ("SelectiveCheckpointCallback", "StaleStartError")},
        **{n: (_ + "selective.run_saves", False) for n in ("resume_point", "Save")}},
    "tailor_tui.health": {
        **{n: (_ + "health.healing", False) for n in ("Health", "Healing", "heal", "TrainingLog", "training_log",
                                                      "why_unhealthy")},
        **{n: (_ + "health.healing", True) for n in ("METRICS", "Cell", "damage", "damage_text", "rms")}},
    "tailor_tui.export": {
        **{n: (_ + "export.export_run", False) for n in ("run_export", "ExportResult")},
        **{n: (_ + "export.export_run", True) for n in ("CONFIG", "COMPANIONS", "TORCH_DTYPE", "config_source")}},
    "tailor_tui.cli": {
        "parser": (_ + "cli.main", True), "apply": (_ + "cli.apply_command:apply_command", True),
        "interactive": (_ + "cli.composer_command", True), "ensure_demo": (_ + "cli.demo_command", True),
        "make_demo": (_ + "cli.demo_command:make_demo_command", True),
        "verify": (_ + "cli.verify_command:verify_command", True),
        "stats": (_ + "cli.health_command:stats_command", True), "heal": (_ + "cli.health_command:heal_command", True)},
    "tailor_tui.team": {
        **{n: (_ + "team.members", False) for n in ("Team", "TeamError", "SOLO")}, "connect": (_ + "team.meet", False),
        **{n: (_ + "team.members", True) for n in ("DEFAULT_TIMEOUT", "CONNECT_TIMEOUT", "BEAT", "POLL", "Failure")}},
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
def test_an_old_modules_names_are_found_in_the_subpackage_of_its_name(package):
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


@pytest.mark.parametrize("old, warns", [("tailor_tui.demo_run", True), ("tailor_tui.cli", False)])
def test_an_old_module_still_runs_with_python_m(old, warns):
    """`python -m tailor_tui.demo_run` (the docs before the subpackages) runs its new module, warning;
    `python -m tailor_tui.cli` is the command line, as before."""
    result = _run("-W", "default", "-m", old, "--help")
    assert "usage:" in (result.stdout + result.stderr).lower(), result.stdout[-2000:] + result.stderr[-3000:]
    ours = [x for x in result.stderr.splitlines() if "DeprecationWarning: tailor_tui" in x]
    assert ours == ([f"{ours[0].split(': ')[0]}: DeprecationWarning: {old} is now {moved.MODULES[old]}"]
                    if warns else []), result.stderr[-3000:]
