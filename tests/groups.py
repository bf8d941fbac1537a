"""The suite's tests grouped for pytest-xdist's `--dist loadgroup` (`make test`), a pytest plugin (`conftest`
loads it: `pytest_plugins`).

Tests that share what a module-scoped fixture makes (a composition of a run, a loop-mounted XFS) run in one test
process: spread over both, each process would make it again, and wait for the other's run to be trained. Grouped by
module and by the parameters of those fixtures (one composition of each run), not the test's own; a plain `-n`
ignores the groups.
"""

from __future__ import annotations

import pytest


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    """Each test that uses a module-scoped fixture marked with its group. First among the hooks of this name:
    pytest-xdist's reads the marks in one (a test's node ID gets `@group`), and found none when it ran before this
    one. A group's name holds no brackets: xdist takes what follows the last "@" for the group only where it
    follows the last "]" too, and a name like `module[param]` grouped nothing (`tests/test_structure.py` runs
    a module's tests under xdist and checks where they ran)."""
    for item in items:
        fixtures = getattr(item, "_fixtureinfo", None)
        shared = [name for name, defs in (fixtures.name2fixturedefs.items() if fixtures else ())
                  if defs[-1].scope == "module"]
        if not shared:
            continue
        params = getattr(getattr(item, "callspec", None), "params", {})
        group = "-".join([item.module.__name__, *(str(params[name]) for name in sorted(shared) if name in params)])
        item.add_marker(pytest.mark.xdist_group(group.replace("[", "(").replace("]", ")").replace("@", "_")))
