"""Every action of the composer, once: its keys, its name, what it does, where it belongs.

The composer's bindings (`bindings`), the grid's own keys, the command palette and the keys
section of the help screen are all built from `ACTIONS`: adding an action here is the one
edit that puts it in all of them, and they cannot disagree.
"""

from __future__ import annotations

import ast
import textwrap
from collections.abc import Iterable
from dataclasses import dataclass

from textual.binding import Binding, BindingType

# who binds an action: the app (every screen), the composer's screen, the grid, the details panel
APP, HOME, GRID, DETAILS = "app", "home", "grid", "details"


@dataclass(frozen=True)
class Action:
    action: str  # Textual's action, with its arguments: `extend_selection(1)`
    keys: str  # Textual's key list: `u,ctrl+z`
    name: str  # the footer's and the command palette's title
    description: str  # what the command palette says it does
    group: str  # the help screen's section
    help: str = ""  # the help screen's words for it ("" : told with another action of its group)
    shows: str = ""  # how the help screen writes its keys (default: from `keys`)
    footer: bool = False  # in the footer at every width (80 columns included)
    owner: str = HOME
    palette: bool = True

    @property
    def method(self) -> str:
        """The action's name without arguments: `extend_selection`."""
        return self.action.partition("(")[0]

    @property
    def arguments(self) -> tuple:
        _name, _, arguments = self.action.partition("(")
        return ast.literal_eval(f"({arguments[:-1]},)") if arguments else ()

    @property
    def key_text(self) -> str:
        """Its keys as a person writes them: `u / ctrl+z`."""
        return self.shows or key_text(self.keys)


_KEY_NAMES = {"question_mark": "?", "slash": "/", "space": "space", "enter": "Enter", "escape": "Esc",
              "pageup": "pgup", "pagedown": "pgdn", "exclamation_mark": "!"}


def key_text(keys: str) -> str:
    """A Textual key list as a person writes it: `enter,y` is `Enter / y`."""
    return " / ".join(_KEY_NAMES.get(k, k) for k in keys.split(","))

GROUPS = ("pick", "move", "view", "recipe", "export", "compose", "other")

ACTIONS: tuple[Action, ...] = (
    # pick
    Action("pick", "space", "Pick", "Pick the cell under the cursor (or the selected rows) from its checkpoint",
           "pick", "this cell (or the selected rows)", shows="space / Enter / click", footer=True),
    Action("choose", "enter", "Pick", "", "pick", owner=GRID, palette=False),
    Action("pick_column", "a", "Pick column", "Pick every row from the checkpoint under the cursor", "pick",
           "the whole column"),
    Action("select_rows", "v", "Select rows", "Select a block of rows (arrows extend it, space picks it, Esc drops it)",
           "pick", "select rows; arrows extend, space picks them", shows="v / shift+arrows"),
    Action("extend_selection(1)", "shift+down", "Select down", "Extend the selected rows", "pick"),
    Action("extend_selection(-1)", "shift+up", "Select up", "Extend the selected rows", "pick"),
    Action("clear_selection", "escape", "Drop selection", "Drop the row selection", "pick", "drop the selection"),
    Action("set_base", "b", "Make base", "Make the checkpoint under the cursor the base", "pick", "make base"),
    Action("heal", "h", "Heal", "Heal: every row from the newest checkpoint where it is healthy", "pick",
           "heal (newest healthy per row)", footer=True),
    # move
    Action("cursor(-1, 0)", "up", "Up", "", "move", "move", shows="arrows", owner=GRID, palette=False),
    Action("cursor(1, 0)", "down", "Down", "", "move", owner=GRID, palette=False),
    Action("cursor(0, -1)", "left", "Left", "", "move", owner=GRID, palette=False),
    Action("cursor(0, 1)", "right", "Right", "", "move", owner=GRID, palette=False),
    Action("page(-1)", "pageup", "Page up", "", "move", "a page", shows="pgup / pgdn", owner=GRID, palette=False),
    Action("page(1)", "pagedown", "Page down", "", "move", owner=GRID, palette=False),
    Action("cursor(-1000000, 0)", "home", "First row", "", "move", owner=GRID, palette=False),
    Action("cursor(1000000, 0)", "end", "Last row", "", "move", owner=GRID, palette=False),
    Action("first_row", "g", "First row", "Go to the first row", "move", "first / last row",
           shows="g / G (home / end)"),
    Action("last_row", "G", "Last row", "Go to the last row", "move"),
    Action("jump", "slash", "Jump to row", "Jump to a row by name", "move", "jump to a row"),
    Action("fold", "f", "Fold", "Fold or unfold the stack under the cursor (a multimodal model's vision, "
           "language…); a pick on a folded stack picks its every row", "move", "fold / unfold a stack"),
    # view
    Action("cycle_metric", "m", "Metric", "Colour the grid by the next health metric", "view", "heatmap metric"),
    Action("focus_details", "tab,shift+tab", "Details",
           "Into the details panel, to read all of it: the arrows, pgup/pgdn, home/end scroll it; Esc, tab or "
           "Enter go back to the grid", "view", "into the details panel, to scroll it (Esc / tab / Enter: back)",
           shows="tab / shift+tab", footer=True),
    Action("focus_grid", "escape,tab,shift+tab,enter", "Grid", "", "view", owner=DETAILS, footer=True, palette=False),
    Action("toggle_details", "d", "Taller details",
           "Give the details panel (or the loss curve) more room (on a narrow terminal they sit below the grid)",
           "view", "taller details or curve (narrow terminals)"),
    Action("toggle_curve", "c", "Curve",
           "The run's loss curve, each checkpoint marked: hide or show it below the details (on a narrow "
           "terminal: show it in the details' place)", "view",
           "loss curve: hide / show (narrow terminals: in the details' place)", footer=True),
    # recipe
    Action("save_recipe", "ctrl+s", "Save", "Save the picks as a recipe", "recipe", "save", footer=True,
           owner=APP),
    Action("save_recipe_as", "S", "Save as", "Save the picks as a recipe under another name", "recipe", "save as"),
    Action("load_recipe", "ctrl+o", "Load", "Load a recipe's picks", "recipe", "load"),
    Action("set_output", "o", "Output", "Set the output folder", "recipe", "output folder"),
    Action("set_world_size", "w", "World size",
           "Set the world size to compose for (reshard for another number of ranks)", "recipe",
           "world size (ranks to compose for)"),
    Action("undo", "u,ctrl+z", "Undo", "Undo the last change", "recipe", "undo"),
    Action("redo", "ctrl+y,ctrl+shift+z", "Redo", "Redo the change undone last", "recipe", "redo"),
    # export
    Action("export", "e", "Export",
           "Export for evaluation: the composition as a plain HF model folder (from_pretrained loads it)", "export",
           "the composition as a plain HF model folder, to evaluate"),
    # compose
    Action("run_compose", "ctrl+r", "Compose", "Review the plan and compose", "compose",
           "review the plan, then compose (the plan's own keys: below)", footer=True),
    # other
    Action("help", "question_mark,f1", "Help", "Help: what each mark means, the keys", "other", "help",
           footer=True, owner=APP),
    Action("command_palette", "ctrl+p", "Commands", "", "other", "command palette", palette=False,
           owner="textual"),
    Action("request_quit", "q", "Quit", "Quit tailor-tui (asks first if picks are unsaved or a composition runs)",
           "other", "quit", footer=True, owner=APP),
)


def bindings(owner: str) -> list[BindingType]:
    """The bindings of `owner` (HOME: the composer's screen; GRID: the grid widget; DETAILS: the
    details panel, focused)."""
    return [Binding(a.keys, a.action, a.name, show=a.footer) for a in ACTIONS if a.owner == owner]


def palette_actions() -> list[Action]:
    """The actions the command palette offers (every one of the app and the composer's screen)."""
    return [a for a in ACTIONS if a.palette and a.owner in (APP, HOME)]


def keys_help(width: int = 68) -> str:
    """The help screen's keys section: a paragraph per group of `keys: what` entries, an entry
    broken across lines only when it is wider than a line."""
    room = width - 11  # "  group    " before each line
    lines = ["Keys"]
    for group in GROUPS:
        rows: list[str] = []
        for a in ACTIONS:
            if a.group != group or not a.help:
                continue
            entry = f"{a.key_text}: {a.help}"
            if rows and len(rows[-1]) + 3 + len(entry) <= room:
                rows[-1] += "   " + entry
            else:
                rows.extend(textwrap.wrap(entry, room, break_long_words=False, break_on_hyphens=False))
        lines += [f"  {group if i == 0 else '':<8} {row}" for i, row in enumerate(rows)]
    return "\n".join(lines) + "\n"


def screen_keys(bindings: Iterable[BindingType]) -> list[tuple[str, str]]:
    """(its keys as a person writes them, what it does) of each binding a screen's footer shows: what the help and
    docs/composer.md say of the screens over the grid."""
    return [(key_text(b.key), b.description[:1].lower() + b.description[1:]) for b in bindings
            if isinstance(b, Binding) and b.show and b.description]


def screens_help(screens: Iterable[tuple[str, Iterable[BindingType]]], width: int = 68) -> str:
    """The keys of the screens over the composer (dialogs, the progress screen), from their own bindings (each
    `(what it is, its BINDINGS)`, `screen_keys`): a paragraph per screen of `keys: what` entries."""
    room = width - 4
    lines = []
    for title, found in screens:
        rows: list[str] = []
        joinable = False  # (never onto the last line of an entry broken across lines)
        for entry in (f"{keys}: {what}" for keys, what in screen_keys(found)):
            if joinable and len(rows[-1]) + 3 + len(entry) <= room:
                rows[-1] += "   " + entry
            else:
                wrapped = textwrap.wrap(entry, room, break_long_words=False, break_on_hyphens=False)
                rows.extend(wrapped)
                joinable = len(wrapped) == 1
        lines += [title, *(f"  {row}" for row in rows)]
    return "\n".join(lines) + "\n"
