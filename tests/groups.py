"""The suite's tests grouped for pytest-xdist's `--dist loadgroup` (`make test`), a pytest plugin (`conftest`
loads it: `pytest_plugins`).

Tests that share what a module-scoped fixture makes (a composition of a run, a loop-mounted XFS) run in one test
process: spread over several, each process would make it again, and wait for another's run to be trained. Grouped by
module and by the parameters of the suite's fixtures they take (one composition of each run), not the test's own;
a plain `-n` ignores the groups.
"""

from __future__ import annotations

import pytest


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    """Each test that uses a module-scoped fixture marked with its group: its module and the parameters of the
    suite's fixtures it takes (a module fixture's, or one given indirectly: a name a module fixture makes a
    composition of on first use), not those parametrizing the test alone, which share the composition. First
    among the hooks of this name: pytest-xdist's reads the marks in one (a test's node ID gets `@group`), and found
    none when it ran before this one. A group's name holds no brackets: xdist takes what follows the last "@" for
    the group only where it follows the last "]" too, and a name like `module[param]` grouped nothing
    (`tests/test_groups.py` runs a module's tests under xdist and checks where they ran)."""
    for item in items:
        fixtures = getattr(item, "_fixtureinfo", None)
        defs = fixtures.name2fixturedefs if fixtures is not None else {}
        if not any(found[-1].scope == "module" for found in defs.values()):
            continue
        params = getattr(getattr(item, "callspec", None), "params", {})
        shared = [str(value) for name, value in sorted(params.items()) if name in defs and _suites(defs[name][-1])]
        group = "-".join([item.module.__name__, *shared])
        item.add_marker(pytest.mark.xdist_group(group.replace("[", "(").replace("]", ")").replace("@", "_")))


def _suites(fixture) -> bool:
    """Whether a fixture is one the suite defines, not pytest's stand-in for a parameter given to the test
    directly (`parametrize` without `indirect`)."""
    return fixture.func.__module__.partition(".")[0] != "_pytest"
