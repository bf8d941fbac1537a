"""How tailor-tui shows sizes, progress and names: one way everywhere (plan, CLI, bars, composer)."""

from __future__ import annotations

import humanize


def size(n: float) -> str:
    """Bytes, binary units: `1.4 GiB`."""
    return humanize.naturalsize(n, binary=True, format="%.1f")


def throughput(done: float, total: float, elapsed: float) -> tuple[float, float]:
    """(bytes per second so far, seconds left at that rate) of `done` of `total` bytes."""
    rate = done / max(elapsed, 1e-6)
    return rate, (total - done) / rate if rate > 0 else 0.0


# What never reaches a terminal or a log as it is: C0 controls (newline, carriage return and
# escape among them), DEL, C1 controls, the line and paragraph separators and the bidirectional
# overrides, isolates and marks (which can make a name read backwards).
_CONTROLS = [*range(0x20), *range(0x7F, 0xA0), 0x061C, 0x200E, 0x200F, 0x2028, 0x2029,
             *range(0x202A, 0x202F), *range(0x2066, 0x206A)]
_ESCAPED = {c: repr(chr(c))[1:-1] for c in _CONTROLS}  # as repr writes them: \n, \x1b, \u202e


def shown(text: object) -> str:
    """A name (a path, a folder, a row) or a one-line message holding names, as tailor-tui prints
    or shows it: its control characters written as repr writes them (`\\x1b[2J`, `\\n`), so a
    hostile name can neither drive the terminal nor split one line into two. Everything else,
    and a name without such characters, stays as it is. The one rule for the CLI and the composer."""
    return str(text).translate(_ESCAPED)


def shown_lines(text: object) -> str:
    """`shown` for text of several lines (a plan, a table): each line escaped, the line breaks kept."""
    return "\n".join(shown(line) for line in str(text).split("\n"))
