"""Loaded by every Python process whose PYTHONPATH holds this folder, at its start: the tailor-tui
processes the tests start (`inject.environment`) and the workers those spawn. It installs the faults
the environment asks for (`inject.install`), before the process imports tailor_tui; where none is
asked for it does nothing more.

An interpreter loads one module named sitecustomize, the first on its path, so this one shadows
any that the installation has (neither this venv nor its base Python has one now: `python -c
"import sitecustomize"` fails there). That one is loaded first from here, by its path, so a
process started by a test still starts as it would without the faults.
"""

import importlib.machinery
import importlib.util
import os
import sys


def _the_installations() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    others = [entry for entry in sys.path if os.path.abspath(entry or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", others)
    if spec is not None and spec.loader is not None:
        module = importlib.util.module_from_spec(spec)
        sys.modules["_shadowed_sitecustomize"] = module
        spec.loader.exec_module(module)


_the_installations()

import inject  # noqa: E402 - after the installation's own start-up

inject.install()
