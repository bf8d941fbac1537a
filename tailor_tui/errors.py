"""Errors a user can cause, each with its own exit code.

Every one of them is shown as a single `error: ...` line that says what went wrong,
where, and what to do; none of them should ever surface as a traceback.
"""

from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    OK = 0
    INTERNAL = 1  # a bug in tailor-tui: one line, its traceback in a log file (cli/crash)
    USAGE = 2  # bad command line (argparse uses 2 as well)
    RECIPE = 3  # the recipe file is malformed or names unknown rows/keys
    CHECKPOINT = 4  # a checkpoint is missing, unreadable, truncated or unsafe
    INCOMPATIBLE = 5  # a source cannot be combined with the base
    OUTPUT = 6  # the output cannot be written (exists, read-only, disk full)
    VERIFY_FAILED = 7  # --verify found rows that do not match their sources, or sources changed since
    NONFINITE = 8  # the output would hold NaN/Inf (--apply), a row has no healthy checkpoint (--heal), or
    # a cell is unhealthy (--stats --check)
    CANCELLED = 130  # stopped by the user (Ctrl-C), like a shell's SIGINT status


# What each code means, in the words `tailor-tui --help` prints (its one source).
MEANING = {
    ExitCode.OK: "ok",
    ExitCode.USAGE: "usage",
    ExitCode.RECIPE: "recipe",
    ExitCode.CHECKPOINT: "checkpoint (missing, truncated, corrupt, unsafe)",
    ExitCode.INCOMPATIBLE: "incompatible source",
    ExitCode.OUTPUT: "output (exists, read-only, full, locked)",
    ExitCode.VERIFY_FAILED: "--verify found differences, or sources changed since the composition",
    ExitCode.NONFINITE: "non-finite values (NaN/Inf) kept, a row nothing heals, or (--stats --check) an unhealthy cell",
    ExitCode.CANCELLED: "cancelled",
    ExitCode.INTERNAL: "internal error",
}


# what a user is told to do about a checkpoint file that is damaged, truncated or not what it says it is
RECOPY = "re-copy it from the training run"


def exit_codes_help() -> str:
    import textwrap

    return textwrap.fill("exit codes: " + ", ".join(f"{int(code)} {meaning}" for code, meaning in MEANING.items()),
                         width=96)


class TailorError(Exception):
    """A failure the user can act on; `str(err)` is the whole one-line message."""

    exit_code: int = ExitCode.INTERNAL  # an ExitCode; a team's failure carries the code another process failed with


class UsageError(TailorError):
    exit_code = ExitCode.USAGE


class RecipeError(TailorError):
    exit_code = ExitCode.RECIPE


class CheckpointError(TailorError):
    exit_code = ExitCode.CHECKPOINT


class IncompatibleError(TailorError):
    exit_code = ExitCode.INCOMPATIBLE


class OutputError(TailorError):
    exit_code = ExitCode.OUTPUT


class NonFiniteError(TailorError):
    exit_code = ExitCode.NONFINITE


class Cancelled(TailorError):
    exit_code = ExitCode.CANCELLED

    def __init__(self, message: str = "cancelled; nothing was written to the output path"):
        super().__init__(message)
