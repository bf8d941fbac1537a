"""Ctrl-C (SIGINT) and Slurm's scancel or time limit (SIGTERM), held back where acting on them
at once would break something.

Python turns these signals into an exception raised in the main thread between any two
bytecodes. Inside a block that must not be cut (publishing a finished output, taking a lock)
or inside library code that holds a lock while it runs (`concurrent.futures.wait` holds every
future's lock while it checks them: an exception there leaves one held, the pool's manager
thread then waits on it forever, and so does the shutdown that joins it), that is not safe.
`signals_held` notes the signal instead and acts on it once the block is done, exactly as it
would have acted (KeyboardInterrupt, or the CLI's SIGTERM handler); `on_signal` lets the
block stop early through its own cancel flag.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator


@contextlib.contextmanager
def signals_held(*, on_signal: Callable[[], None] | None = None) -> Iterator[None]:
    """SIGINT and SIGTERM wait until the block is done, then act as they would have; each one
    that arrives meanwhile calls `on_signal` (in the main thread, between two bytecodes: it
    must only set a flag, such as a `threading.Event`).

    Their handlers are swapped for one that only notes them (Python runs handlers in the
    main thread whichever thread the kernel picks, so masking the main thread alone would
    not do). Only the main thread can do this; elsewhere (the composer's worker thread)
    cancelling goes through the composition's cancel flag."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []

    def note(signum: int, _frame) -> None:
        caught.append(signum)
        if on_signal is not None:
            on_signal()

    previous = {s: signal.signal(s, note) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        if caught:
            handler = previous[signal.Signals(caught[0])]
            if callable(handler):
                handler(caught[0], None)  # KeyboardInterrupt, or the CLI's SIGTERM handler
            elif handler == signal.SIG_DFL:
                signal.raise_signal(caught[0])
