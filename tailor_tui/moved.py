"""Names and modules that moved keep their old import paths, with a DeprecationWarning.

Public import paths are promises: a module that loses a name to another gets
`__getattr__ = moved.names(__name__, {name: new module})`, and a module that moved whole is kept
as a shim calling `moved.module(__name__, new module)` (its names, re-exported, warned once, at import).
"""

from __future__ import annotations

import importlib
import sys
import warnings


def names(old: str, homes: dict[str, str]):
    """A module `__getattr__` for module `old`: each name of `homes` is found in its new module
    (`module`, or `module:NewName` for a name renamed as it moved)."""

    def __getattr__(name: str):
        home = homes.get(name)
        if home is None:
            raise AttributeError(f"module {old!r} has no attribute {name!r}")
        module, _, new = home.partition(":")
        warnings.warn(f"{old}.{name} is now {module}.{new or name}", DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(module), new or name)

    return __getattr__


def module(old: str, new: str, renamed: dict[str, str] | None = None) -> None:
    """Make module `old` (a shim being imported) hold every public name of module `new`, and each
    old name of `renamed` (old name -> its name in `new`)."""
    warnings.warn(f"{old} is now {new}", DeprecationWarning, stacklevel=3)
    target = importlib.import_module(new)
    shim = sys.modules[old]
    for name in getattr(target, "__all__", None) or [n for n in vars(target) if not n.startswith("_")]:
        setattr(shim, name, getattr(target, name))
    for name, now in (renamed or {}).items():
        setattr(shim, name, getattr(target, now))
