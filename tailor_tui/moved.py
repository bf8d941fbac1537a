"""Names and modules that moved keep their old import paths, with a DeprecationWarning.

Public import paths are promises, kept by one rule, all of it here:

- a module that moved whole is a line of MODULES (old path -> new module), and of RENAMED for the
  names its new home calls otherwise or keeps elsewhere; the import hook `OldPaths`, installed by
  `tailor_tui/__init__.py`, serves every old path of MODULES: `import old` warns once, naming the new
  module, and gives a module holding the new module's very objects (no file is kept at the old path);
- a module or package that lost names to another gets `__getattr__ = moved.names(__name__, {name: new
  module})`: each name warns where it is used. A subpackage's `__init__` gives its public API, found in
  its modules only when first used (torch is imported by the module that needs it, not by the
  package), through the same `__getattr__`: `moved.names(__name__, old_names, public={name: module})`;
- a method that became another module's function is `name = moved.method("module:function", "Class.name")`.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
import warnings

_C, _CO, _F, _H, _K, _P, _R, _T, _V = (f"tailor_tui.{p}." for p in (
    "checkpoints", "compose", "formats", "health", "kinds", "planning", "runs", "team", "verifying"))

# Every module path that moved whole, and the module it is now. The root modules before the
# subpackages (commit 675123b) first; those now a subpackage's own name (selective, health, export,
# cli, team) are served by that subpackage's `__init__` instead.
MODULES = {
    "tailor_tui.cache": _C + "cache", "tailor_tui.checkpoint": _C + "checkpoint", "tailor_tui.layout": _C + "layout",
    "tailor_tui.model_layout": _C + "model_layout", "tailor_tui.partial_rows": _K + "partial",
    "tailor_tui.rows": _C + "rows", "tailor_tui.scan_cache": _C + "scan_cache",
    "tailor_tui.weight_files": _C + "weight_files",
    "tailor_tui.cli_export": "tailor_tui.cli.export_command", "tailor_tui.health_report": "tailor_tui.cli.health_report",
    "tailor_tui.bin_files": _CO + "bin_files", "tailor_tui.composition": _CO + "composition",
    "tailor_tui.merge": _CO + "compose_run", "tailor_tui.model_files": _CO + "model_files",
    "tailor_tui.rank_partial": _CO + "rank_partial", "tailor_tui.rank_reshard": _CO + "rank_reshard",
    "tailor_tui.rank_stream": _CO + "rank_stream", "tailor_tui.rank_task": _CO + "rank_task",
    "tailor_tui.rank_torch": _CO + "rank_torch",
    "tailor_tui.compare": _V + "compare", "tailor_tui.verify": _V + "against_recipe",
    "tailor_tui.verify_reshard": _V + "resharded",
    "tailor_tui.export_plan": "tailor_tui.export.export_plan", "tailor_tui.export_rank": "tailor_tui.export.rank",
    "tailor_tui.ds_format": _F + "ds_format", "tailor_tui.dtypes": _F + "dtypes", "tailor_tui.nonfinite": _F + "nonfinite",
    "tailor_tui.pickled": _F + "pickled", "tailor_tui.ptedit": _F + "ptwrite", "tailor_tui.ptfile": _F + "ptfile",
    "tailor_tui.ptzip": _F + "ptfile", "tailor_tui.ptlegacy": _F + "ptlegacy", "tailor_tui.ptpickle": _F + "ptpickle",
    "tailor_tui.ptwrite": _F + "ptwrite", "tailor_tui.safe_load": _F + "safe_load",
    "tailor_tui.safetensors_in": _F + "safetensors_in", "tailor_tui.safetensors_out": _F + "safetensors_out",
    "tailor_tui.guard": _H + "guard", "tailor_tui.stats_job": _H + "stats_job", "tailor_tui.stats_rank": _H + "stats_rank",
    "tailor_tui.stats_run": _H + "stats_run",
    "tailor_tui.file_plan": _P + "file_plan", "tailor_tui.jobs": _P + "jobs", "tailor_tui.output": _P + "output",
    "tailor_tui.plan": _P + "plan", "tailor_tui.recipe": _P + "recipe",
    "tailor_tui.reshard": "tailor_tui.resharding.partition", "tailor_tui.reshard_skeleton": "tailor_tui.resharding.skeleton",
    "tailor_tui.demo_run": _R + "demo_run",
    "tailor_tui.run_models": _R + "models",
    "tailor_tui.selective_hf": "tailor_tui.selective.hf", "tailor_tui.run_saves": "tailor_tui.selective.run_saves",
    "tailor_tui.launch": _T + "launch", "tailor_tui.team_progress": _T + "progress", "tailor_tui.sbatch": _T + "sbatch",
    "tailor_tui.workers": _T + "workers",
    # moved within the subpackages since
    "tailor_tui.compose.merge": _CO + "compose_run", "tailor_tui.compose.folder": _CO + "compose_run",
    "tailor_tui.compose.provenance": _P + "provenance",
    "tailor_tui.export.folder": "tailor_tui.export.export_run", "tailor_tui.export.plan": "tailor_tui.export.export_plan",
    "tailor_tui.cli.export": "tailor_tui.cli.export_command", "tailor_tui.cli.health": "tailor_tui.cli.health_command",
    "tailor_tui.team.team": _T + "members", "tailor_tui.formats.ptedit": _F + "ptwrite",
    "tailor_tui.verifying.recipe": _V + "against_recipe", "tailor_tui.verifying.weight_files": _V + "weights",
    "tailor_tui.ui.merge_screen": "tailor_tui.ui.progress_screen", "tailor_tui.ui.compose_screen": "tailor_tui.ui.progress_screen",
    "tailor_tui.ui.details": "tailor_tui.ui.describe", "tailor_tui.ui.heatmap": "tailor_tui.ui.describe",
    # the checked read path, one subpackage since issue 58
    "tailor_tui.crc": "tailor_tui.checked.crc", "tailor_tui.reading": "tailor_tui.checked.files",
    # the kinds of checkpoint a rank's files come in, one subpackage of adapters since issue 58
    _C + "rank_reader": _K + "base", _C + "partial_rows": _K + "partial",
}

_MERGE = {"MergeResult": _CO + "compose_run:Composed", "run_merge": _CO + "compose_run:run_compose"}
# A moved module's names that its new home calls otherwise, or that live elsewhere now: name -> "module[:new name]".
_PARTIAL_ROWS = {"crc_range_checked": "tailor_tui.checked.evidence"}
RENAMED = {
    _C + "rank_reader": {**dict.fromkeys(("ZeroRankReader", "SMALL_RANK_FILE", "flat_tensor_bytes", "tensor_bytes"),
                                         _K + "zero"), "PartialRankReader": _K + "partial"},
    _C + "partial_rows": _PARTIAL_ROWS, "tailor_tui.partial_rows": _PARTIAL_ROWS,
    "tailor_tui.reading": dict.fromkeys(("pread_exact", "pread_into", "Window", "READAHEAD", "Readahead", "crc_range",
                                         "RangeCrcs"), "tailor_tui.checked.ranges"),
    "tailor_tui.checkpoint": {"other_run": _C + "lineage", "read_metadata": _C + "model_states",
                              **dict.fromkeys(("ScanResult", "STAGING", "find_checkpoint_dirs", "scan"), _C + "scan")},
    "tailor_tui.bin_files": {"merge_bin_file": _CO + "bin_files:compose_bin_file"},
    "tailor_tui.merge": _MERGE, "tailor_tui.compose.merge": _MERGE,
    "tailor_tui.model_files": {"merge_model_file": _CO + "model_files:compose_model_file"},
    "tailor_tui.rank_task": {"merge_rank": _CO + "rank_task:compose_rank"},
    "tailor_tui.rank_torch": {"merge_model_states": _CO + "rank_torch:compose_model_states"},
    "tailor_tui.plan": {"MergePlan": _P + "plan:ComposePlan", "build_plan": _P + "build"},
    "tailor_tui.demo_run": {"free_port": _R + "ranks"},
    "tailor_tui.ui.merge_screen": {"MergeScreen": "tailor_tui.ui.progress_screen:ProgressScreen"},
    "tailor_tui.ui.compose_screen": {"ComposeScreen": "tailor_tui.ui.progress_screen:ProgressScreen"},
}


def _find(home: str, name: str):
    """The object at `home` ("module" or "module:new name") that was called `name`."""
    module, _, new = home.partition(":")
    return getattr(importlib.import_module(module), new or name)


def names(old: str, homes: dict[str, str], public: dict[str, str] | None = None):
    """A module `__getattr__` for module `old`: each name of `homes` is found in its new module
    (`module`, or `module:NewName` for a name renamed as it moved), warning; each of `public` (a
    package's own API, kept in its modules) is found there, imported when first used, without warning."""

    def __getattr__(name: str):
        if public and name in public:
            return _find(public[name], name)
        home = homes.get(name)
        if home is None:
            raise AttributeError(f"module {old!r} has no attribute {name!r}")
        module, _, new = home.partition(":")
        warnings.warn(f"{old}.{name} is now {module}.{new or name}", DeprecationWarning, stacklevel=2)
        return _find(home, name)

    __getattr__.homes = homes  # type: ignore[attr-defined]  # an old module's shim finds moved names here
    return __getattr__


def method(home: str, old: str):
    """A method that became a function of another module (`home`, "module:function", taking the
    object first): calling `old` ("Class.method") warns, naming the function, and calls it."""
    module, _, new = home.partition(":")

    def call(self, *args, **kwargs):
        warnings.warn(f"{old}() is now {module}.{new}()", DeprecationWarning, stacklevel=2)
        return _find(home, new)(self, *args, **kwargs)

    call.__name__, call.__doc__ = old.rpartition(".")[2], f"Deprecated: {module}.{new}(self, ...)."
    return call


class OldPaths:
    """The import hook: finds each old path of MODULES (only where no module of that name exists: it
    comes after the path finder), and makes it a module holding its new module's objects. A meta path
    finder and loader by their methods, not by importlib.abc's bases: importing those (and the
    importlib.resources they import) took ~5 ms of every start of tailor-tui and of its workers."""

    def find_spec(self, fullname, path=None, target=None):
        return importlib.util.spec_from_loader(fullname, self) if fullname in MODULES else None

    def create_module(self, spec):
        return None  # a plain module

    def exec_module(self, module: types.ModuleType) -> None:
        old, new = module.__name__, MODULES[module.__name__]
        warnings.warn(f"{old} is now {new}", DeprecationWarning, stacklevel=2)
        target = importlib.import_module(new)
        public = getattr(target, "__all__", None) or [n for n in vars(target) if not n.startswith("_")]
        renamed = RENAMED.get(old, {})
        moved_on = getattr(getattr(target, "__getattr__", None), "homes", {})
        for name in public:
            setattr(module, name, getattr(target, name))

        def __getattr__(name: str):  # a name kept elsewhere, moved on from the new module, or private
            home = renamed.get(name) or moved_on.get(name)
            return _find(home, name) if home else getattr(target, name)

        module.__getattr__ = __getattr__  # type: ignore[method-assign]
        module.__all__ = [*public, *renamed]  # type: ignore[attr-defined]

    def get_code(self, fullname: str):
        """`python -m old` runs the new module, warning."""
        warnings.warn(f"{fullname} is now {MODULES[fullname]}", DeprecationWarning, stacklevel=2)
        spec = importlib.util.find_spec(MODULES[fullname])
        get_code = getattr(spec.loader, "get_code", None) if spec else None
        return get_code(spec.name) if get_code and spec else None


def install() -> None:
    """Serve the old paths (once per process: `tailor_tui/__init__.py` calls it)."""
    if not any(isinstance(finder, OldPaths) for finder in sys.meta_path):
        sys.meta_path.append(OldPaths())
