"""Names are data: how the composer shows any text that holds a path or a name (a checkpoint's
folder, the run's, a row's, a message naming them) — as text, never read as markup, its control
characters escaped by `units.shown` (the CLI's rule too). A folder named `checkpoint-6[link=a:b]`
or holding `ESC[2J` shows as what it is; it can neither end the app nor drive the terminal.

The composer has no markup of its own: every Label, Static, dialog and notice takes its text
through here (`plain`, `plain_lines`), and the app's `notify` through `notice`."""

from __future__ import annotations

from typing import Iterable

from textual.content import Content

from tailor_tui.units import shown, shown_lines


def plain(text: object) -> Content:
    """One line (a title, a label, a message), whatever its names hold."""
    return Content(shown(text))


def plain_lines(lines: Iterable[str]) -> Content:
    """Several lines (a plan, the details panel, a dialog's body), each escaped: a newline in a
    name stays on its line (text already joined: `text.split("\n")`, its breaks kept)."""
    return Content("\n".join(map(shown, lines)))


def notice(text: object) -> str:
    """A notice's message or title as `App.notify` takes it (with markup off): its lines escaped."""
    return shown_lines(text)
