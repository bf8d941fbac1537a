"""Small modal dialogs: ask for a path, confirm, show an error in plain words, help."""

from __future__ import annotations

from typing import Any, Iterable

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, Static

from tailor_tui.ui.actions import keys_help, screens_help
from tailor_tui.ui.plain import plain, plain_lines


class PathPrompt(ModalScreen[str | None]):
    """Ask for a path (or a short answer); dismisses with the text ("" when left empty), or None on Esc."""

    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, title: str, value: str = "", placeholder: str = "") -> None:
        super().__init__()
        self.title_text, self.value, self.placeholder = title, value, placeholder

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Label(plain(self.title_text), classes="dialog-title")
            yield Input(value=self.value, placeholder=self.placeholder, id="path")
            yield Label("Enter accepts, Esc cancels", classes="dialog-hint")

    def on_input_submitted(self, event: Input.Submitted) -> None:
        self.dismiss(event.value.strip())

    def action_cancel(self) -> None:
        self.dismiss(None)


# What a `Confirm` answers its callback: True or False, a further button's id (`more_buttons`),
# or None (Textual's: a screen dismissed without a result)
Answer = bool | str | None


class Confirm(ModalScreen[bool | str]):
    """A yes/no question; Enter (or y) accepts, Esc (or n) declines: it answers True or False, or
    the id of a further button a subclass adds (`more_buttons`)."""

    BINDINGS = [
        Binding("enter,y", "accept", "Yes"),
        Binding("escape,n", "decline", "No"),
        # the body scrolls from the keyboard while the focus stays on the buttons
        Binding("down,j", "scroll(1)", "Scroll", show=False),
        Binding("up,k", "scroll(-1)", "Scroll", show=False),
        Binding("pagedown,space", "scroll(10)", "Page", show=False),
        Binding("pageup", "scroll(-10)", "Page", show=False),
    ]

    accept_keys, decline_keys = "Enter", "Esc"  # as the buttons say them

    def __init__(self, title: str, body: str, accept: str = "Yes", decline: str = "No") -> None:
        super().__init__()
        self.title_text, self.body, self.accept, self.decline = title, body, accept, decline

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Label(plain(self.title_text), classes="dialog-title")
            with VerticalScroll(classes="dialog-scroll", can_focus=False):  # the plan's lines, indented
                yield Static(plain_lines(self.body.split("\n")), classes="dialog-body")
            with Horizontal(classes="dialog-buttons"):
                yield Button(f"{self.accept} ({self.accept_keys})", variant="primary", id="accept")
                yield Button(f"{self.decline} ({self.decline_keys})", id="decline")
                yield from self.more_buttons()

    def more_buttons(self) -> Iterable[Button]:
        """Further choices: a button whose id the dialog dismisses with (see PlanDialog)."""
        return ()

    def on_mount(self) -> None:
        self.query_one(self.default_button, Button).focus()

    @property
    def default_button(self) -> str:
        """The button Enter presses when the dialog opens."""
        return "#accept"

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "accept" if event.button.id in ("accept", "decline") else event.button.id)

    def action_scroll(self, lines: int) -> None:
        self.query_one(".dialog-scroll", VerticalScroll).scroll_relative(y=lines, animate=False)

    def action_accept(self) -> None:
        self.dismiss(True)

    def action_decline(self) -> None:
        self.dismiss(False)


class PlanDialog(Confirm):
    """The plan before a composition: Enter composes (True), Esc goes back (False), w sets the world size
    to compose for ("world_size"); with `batch` (a large plan on a login node), s writes an
    sbatch script for the saved recipe instead ("sbatch"). With `risky` (the output would hold
    unhealthy rows) going back is the default: Enter and y go back, and only ! (or a click on
    its button) composes anyway, as `--allow-nonfinite` does headlessly."""

    BINDINGS = [Binding("enter,y", "accept", "Compose (back, where the output would hold NaN/Inf)"),
                Binding("escape,n", "decline", "Back"), *Confirm.BINDINGS[2:],  # (its scrolling keys)
                Binding("w", "world_size", "World size"),
                Binding("s", "batch", "sbatch script (a large plan on a login node)"),
                Binding("exclamation_mark", "accept_anyway", "Compose anyway (an output holding NaN/Inf)")]

    def __init__(self, *args: Any, batch: bool = False, risky: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.offers_batch, self.risky = batch, risky  # `batch` would hide Textual's Widget.batch
        if risky:  # the safe choice is the default one
            self.accept_keys, self.decline_keys = "!", "Enter, Esc"

    @property
    def default_button(self) -> str:
        return "#decline" if self.risky else "#accept"

    def more_buttons(self) -> Iterable[Button]:
        yield Button("World size… (w)", id="world_size")
        if self.offers_batch:
            yield Button("sbatch (s)", id="sbatch")

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool:
        if action == "accept_anyway":
            return self.risky
        return self.offers_batch if action == "batch" else True

    def action_accept(self) -> None:
        self.dismiss(not self.risky)  # Enter or y: composes, or goes back when the output would be unhealthy

    def action_accept_anyway(self) -> None:
        self.dismiss(True)

    def action_world_size(self) -> None:
        self.dismiss("world_size")

    def action_batch(self) -> None:
        self.dismiss("sbatch")


class ErrorDialog(ModalScreen[None]):
    """A backend error, in its own words (one line saying what, where and what to do)."""

    BINDINGS = [Binding("escape,enter", "close", "Close")]

    def __init__(self, message: str, title: str = "Cannot do that") -> None:
        super().__init__()
        self.message, self.title_text = message, title

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog error"):
            yield Label(plain(self.title_text), classes="dialog-title")
            yield Static(plain(self.message), classes="dialog-body")
            yield Label("Enter or Esc closes", classes="dialog-hint")

    def action_close(self) -> None:
        self.dismiss(None)


HELP_WIDTH = 64  # the help's lines: its dialog's width less border, padding and scroll bar (no line wraps)
HELP = """\
A row per model row, a column per checkpoint (oldest left).

Cell marks
  ● base      the row comes from the base
  ● picked    the row comes from this checkpoint
  ·           this checkpoint holds the row: space picks it
  –           a partial checkpoint that did not save this row
  ✗           cannot be combined with the base (why: details)
  tied        no weights of its own (a tied lm_head)
  NaN         NaN/Inf values in the row's optimizer state
  CRC / ERR   a record fails its CRC-32 check / unreadable
  colours     heatmap metric, per row: blue low … red high
  ▲ (header)  the training loss jumped at this checkpoint
  composed    a folder tailor-tui composed, not a training save

The base is what the output starts from: every row not picked
elsewhere, and the optimizer settings, steps, scheduler, RNG
states and every other file of the checkpoint.

""" + keys_help(HELP_WIDTH) + "\n"
# the keys of the dialogs over the grid, each from its own bindings (the help and docs/composer.md list them)
DIALOG_KEYS = (("In the plan (ctrl+r; e's export)", PlanDialog.BINDINGS), ("In a question", Confirm.BINDINGS),
               ("In a prompt (Enter: done)", PathPrompt.BINDINGS), ("In a message", ErrorDialog.BINDINGS))


class HelpScreen(ModalScreen[None]):
    """What every mark means and the keys by task, scrolled by the keyboard (arrows, pgup/pgdn,
    home/end) at any size, never cut; its title says how to close it, always in view."""

    BINDINGS = [Binding("escape,question_mark,f1,q", "close", "Close")]

    def __init__(self, screens: Iterable[tuple[str, Iterable[BindingType]]] = DIALOG_KEYS) -> None:
        """`screens`: (what, BINDINGS) of every screen over the grid whose keys it lists (`app.SCREEN_KEYS`)."""
        super().__init__()
        self.text = HELP + screens_help(screens, HELP_WIDTH)

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog help"):
            yield Label("tailor-tui: help · Esc closes · arrows, pgup/pgdn, home/end scroll", classes="dialog-title")
            with VerticalScroll(classes="help-scroll"):
                yield Static(Text(self.text.rstrip("\n"), no_wrap=True), classes="help-body")

    def on_mount(self) -> None:
        self.query_one(VerticalScroll).focus()  # the keys scroll it at once

    def action_close(self) -> None:
        self.dismiss(None)
