"""The public API's import paths that moved keep working, with a DeprecationWarning, for one minor release.

The public API is what the README and docs show: each subpackage's `__all__`. A path an earlier README showed
that moved is kept by one rule, all of it here:

- a module that moved whole is a line of MODULES (old path -> new module); the import hook `OldPaths`,
  installed by `tailor_tui/__init__.py`, serves every old path of MODULES: `import old` warns once, naming the
  new module, and gives a module holding the new module's very objects (no file is kept at the old path; an old
  package that is gone is an empty one holding them); a name renamed as its module moved is a line of RENAMED,
  served at the old path under its old name, the one warning naming it;
- a name that moved out of a module the docs show gets `__getattr__ = moved.names(__name__, {name: new
  module})`: it warns where it is used. A subpackage's `__init__` gives its public API, found in its modules
  only when first used (torch is imported by the module that needs it, not by the package), through the same
  `__getattr__`: `moved.names(__name__, {}, public={name: module})`.

CHANGELOG.md says until which release each is kept. Internal modules are free to move: no path is kept for them.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
import warnings

# The module paths an earlier README showed that moved whole, and the module each is now: each kept, with a
# DeprecationWarning, until the release CHANGELOG.md names. Every other module is internal, free to move.
MODULES = {
    "tailor_tui.selective_hf": "tailor_tui.selective.hf",
    "tailor_tui.run_saves": "tailor_tui.selective.run_saves",
    "tailor_tui.demo_run": "tailor_tui.demo.demo_run",  # `python -m tailor_tui.demo_run`
    "tailor_tui.runs.demo_run": "tailor_tui.demo.demo_run",  # `python -m tailor_tui.runs.demo_run`
    "tailor_tui.compose.composition": "tailor_tui.planning.recipe_draft",
}
# names renamed as their module moved: (old module, old name) -> the new module's name, served at the old path
RENAMED = {("tailor_tui.compose.composition", "Composition"): "RecipeDraft"}


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

    return __getattr__


class OldPaths:
    """The import hook: finds each old path of MODULES (only where no module of that name exists: it
    comes after the path finder), and makes it a module holding its new module's objects. A meta path
    finder and loader by their methods, not by importlib.abc's bases: importing those (and the
    importlib.resources they import) took ~5 ms of every start of tailor-tui and of its workers."""

    def find_spec(self, fullname, path=None, target=None):
        # an old package that is gone is an empty one, where its old modules kept are found (by this hook)
        package = any(old.startswith(fullname + ".") for old in MODULES)
        if fullname not in MODULES and not package:
            return None
        return importlib.util.spec_from_loader(fullname, self, is_package=package)

    def create_module(self, spec):
        return None  # a plain module

    def exec_module(self, module: types.ModuleType) -> None:
        old, new = module.__name__, MODULES.get(module.__name__)
        if new is None:  # (a package only holding old modules)
            return
        renamed = {name: now for (path, name), now in RENAMED.items() if path == old}
        said = "".join(f" (its {name}: {now})" for name, now in renamed.items())
        warnings.warn(f"{old}{said} is now {new}", DeprecationWarning, stacklevel=2)
        target = importlib.import_module(new)
        public = getattr(target, "__all__", None) or [n for n in vars(target) if not n.startswith("_")]
        for name in public:
            setattr(module, name, getattr(target, name))
        for name, now in renamed.items():
            setattr(module, name, getattr(target, now))

        def __getattr__(name: str):  # a private name: the new module's
            return getattr(target, name)

        module.__getattr__ = __getattr__  # type: ignore[method-assign]
        module.__all__ = list(public)  # type: ignore[attr-defined]

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
