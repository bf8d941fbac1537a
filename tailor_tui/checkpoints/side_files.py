"""Reading a checkpoint's small side files (config.json, trainer_state.json, a manifest, an
index, the DeepSpeed config a run names) as hostile input: bounded in size and in nesting.

A side file must be a regular file: a FIFO, device or socket named in its place is refused
without being read (`/dev/zero` would grow without end, a FIFO would block). It is read up to a
size bound (1 MiB unless the caller allows more, `$TAILOR_TUI_MAX_SIDE_FILE` raises the default)
and its JSON may nest at most MAX_DEPTH levels. Each refusal is a ValueError saying what the
file is instead; an unreadable one an OSError.

A long array in one (trainer_state.json's log history: 650,000 entries in 64 MiB) is read item by
item (`json_items`), never held whole as Python objects, and a number in it is held to 64 bits.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Generator, Iterator
from json.scanner import make_scanner
from pathlib import Path
from typing import Any

from tailor_tui.checked.files import open_regular
from tailor_tui.units import whole_number

MAX_SIDE_FILE = 1 << 20  # bytes: config.json and the like are a few KiB
MAX_RECORD = 64 << 20  # records that grow with the model or the run: an index, a manifest, a provenance record
MAX_DEPTH = 64  # nesting of JSON arrays and objects: HF configs nest three or four levels
_SPACE = re.compile(r"[ \t\n\r]*")  # JSON's whitespace, as json.decoder skips it
RESTART = object()  # `json_items`: the key again; what its earlier array held no longer counts
SKIPPED = object()  # `json_items`: in place of the items `Known` names, as another file's reading gave them


def side_file_limit() -> int:
    """The default size bound of a side file: MAX_SIDE_FILE, or `$TAILOR_TUI_MAX_SIDE_FILE` bytes."""
    value = os.environ.get("TAILOR_TUI_MAX_SIDE_FILE", "")
    bound = whole_number(value)
    return bound if bound else MAX_SIDE_FILE


def read_small(path: Path, limit: int | None = None, *, follow: bool = True, within: Path | None = None) -> bytes:
    """The bytes of the regular file at `path`, refused (ValueError) if it is not one or holds
    more than `limit` bytes (default `side_file_limit()`); `follow=False`: a symlink at `path`
    is refused too (OSError ELOOP); `within`: the run folder it lies in, which no link on the way
    may leave (CheckpointError, `checked.files.confine`)."""
    limit = side_file_limit() if limit is None else limit
    fd = open_regular(path, follow=follow, within=within)
    try:
        st = os.fstat(fd)
        if st.st_size > limit:
            raise ValueError(f"{st.st_size:,} bytes, more than the {limit:,} such a file may hold; not read")
        parts, got = [], 0
        while got <= limit:
            part = os.read(fd, limit + 1 - got)
            if not part:
                break
            parts.append(part)
            got += len(part)
        if got > limit:
            raise ValueError(f"it grew past {limit:,} bytes while being read; not read")
        return b"".join(parts)
    finally:
        os.close(fd)


def parse_json(text: bytes | str, depth: int = MAX_DEPTH):
    """The JSON value of `text`, refused (ValueError) if it nests deeper than `depth` levels. Parsed first (json's
    decoder stops at the interpreter's recursion limit: RecursionError, refused), then its nesting walked without
    recursion, a level at a time (the containers of each level; json makes no other kinds), before anyone walks
    it: a provenance record's 3 MB, 8 ms where a walk of one node at a time took 25."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None
    level, layer = 0, [value] if type(value) in _CONTAINERS else []
    while layer:
        level += 1
        if level > depth:
            raise ValueError(f"JSON nested more than {depth} levels deep, the most a side file may nest")
        inner: list = []
        for node in layer:
            inner += [v for v in (node.values() if type(node) is dict else node) if type(v) in _CONTAINERS]
        layer = inner
    return value


_CONTAINERS = (dict, list)  # (json.loads makes exactly these: no subclass to look for)


def load_json(path: Path, limit: int | None = None, depth: int = MAX_DEPTH, *, follow: bool = True,
              within: Path | None = None):
    """The JSON value of the side file `path` (bounded as `read_small` and `parse_json`)."""
    return parse_json(read_small(path, limit, follow=follow, within=within), depth)


class Unread:
    """An integer past 64 bits where a side file's JSON holds a number (`json_items`): no int, so
    every reader of a number takes it for none (absent), where `float()` of a 401-digit one
    overflows and `int()` refuses one past 4,300 digits; equal only to the same digits."""

    __slots__ = ("digits",)

    def __init__(self, digits: str) -> None:
        self.digits = digits

    def __repr__(self) -> str:
        return f"Unread({self.digits})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Unread) and other.digits == self.digits

    def __hash__(self) -> int:
        return hash(self.digits)


class WideIntegers:
    """The integers past 64 bits a reading met (`json_items`): how many, and the first."""

    def __init__(self) -> None:
        self.count = 0
        self.first: Unread | None = None


class Known:
    """The text the array of another file's reading began with (`json_items`), by its length and
    hash: a reading whose array begins with the same text, up to a `,` or the array's end, skips
    those items and gives SKIPPED in their place (a run's next checkpoint's log begins with the
    last one's). The reading leaves its own array's here, for the next: the length and hash of its
    text up to its last item's end, and the integers past 64 bits those items held (those skipped
    not counted)."""

    def __init__(self, length: int = 0, digest: int = 0) -> None:
        self.length, self.digest, self.wide = length, digest, 0


def _integers(wide: WideIntegers) -> Callable[[str], int | Unread]:
    """json's `parse_int`: an integer of 64 bits (signed or not) as an int, a wider one as `Unread`."""
    def parse(digits: str) -> int | Unread:
        if len(digits) <= 20:  # 2**64 - 1 has 20 digits, -2**63 a sign and 19: int() reads it at once
            value = int(digits)
            if -(1 << 63) <= value < 1 << 64:
                return value
        wide.count += 1
        unread = Unread(digits)
        wide.first = wide.first or unread
        return unread

    return parse


def _too_deep(value: object, levels: int) -> bool:
    """Whether `value` nests more than `levels` levels of arrays and objects."""
    if not isinstance(value, (dict, list)):
        return False
    return levels <= 0 or any(_too_deep(v, levels - 1) for v in (value.values() if isinstance(value, dict) else value))


def _scanned(scan: Callable, text: str, at: int) -> tuple[object, int]:
    """The JSON value at `text[at]` and where it ends, as json's scanner reads it; ValueError where there
    is none, or it nests past the interpreter's recursion."""
    try:
        return scan(text, at)
    except StopIteration:
        raise ValueError(f"expecting a JSON value at character {at}") from None
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None


def _value(scan: Callable, text: str, at: int, levels: int) -> tuple[object, int]:
    """The JSON value at `text[at]` and where it ends; ValueError if there is none or it nests
    more than `levels` levels (walked only where a bracket follows its first: a log entry is flat)."""
    value, end = _scanned(scan, text, at)
    if (text.find("[", at + 1, end) >= 0 or text.find("{", at + 1, end) >= 0) and _too_deep(value, levels):
        raise ValueError(f"JSON nested more than the {MAX_DEPTH} levels a side file may nest")
    return value, end


def _skip(text: str, at: int) -> int:
    """Where the JSON whitespace at `text[at]` ends."""
    return _SPACE.match(text, at).end()  # type: ignore[union-attr]  # the pattern matches the empty string


def _next(text: str, at: int, closing: str) -> tuple[bool, int]:
    """After a value: whether the `,` or `closing` bracket at `text[at]` (whitespace skipped)
    closed its array or object, and where what follows starts."""
    at = _skip(text, at)
    mark = text[at:at + 1]
    if mark != "," and mark != closing:
        raise ValueError(f"expecting ',' or '{closing}' at character {at}")
    return mark == closing, _skip(text, at + 1)


def _begins(text: str, at: int, known: Known) -> bool:
    """Whether the items at `text[at]` begin with the text `known` names, up to a `,` or the array's end."""
    if not 0 < known.length <= len(text) - at:
        return False
    after = _skip(text, at + known.length)
    return text[after:after + 1] in (",", "]") and hash(text[at:at + known.length]) == known.digest


def _items(scan: Callable, text: str, at: int, texts: bool, known: Known | None,
           wide: WideIntegers) -> Generator[object, None, int]:
    """The items of the array whose `[` is at `text[at - 1]`, one at a time (`texts`: each with
    its JSON text), SKIPPED first for those `known` names; returns where the array ends. The hot
    loop of a 64 MiB log: an item is walked for its nesting only where the array holds more
    brackets than objects (a log entry is one flat object), in a second pass."""
    begin = at = _skip(text, at)
    space = _SPACE.match
    objects, counted, end = 0, wide.count, at  # `end`: of the last item
    if text[at:at + 1] == "]":
        done, at = True, at + 1
    elif known is not None and _begins(text, at, known):
        yield SKIPPED  # the same text up to an item's end: the same items
        end = at + known.length
        done, at = _next(text, end, "]")
    else:
        done = False
    scanned = at
    while not done:
        start = at
        item, at = _scanned(scan, text, at)
        objects += type(item) is dict
        yield (item, text[start:at]) if texts else item
        end = at
        if text[at:at + 2] == ", ":  # json.dumps' separator: the fast way on
            at += 2
            if text[at:at + 1] in " \t\n\r":  # (or the end: the scan then finds no value)
                at = space(text, at).end()  # type: ignore[union-attr]  # the pattern matches the empty string
        elif text[at:at + 1] == ",":  # the Trainer's (indented): a line break next
            at = space(text, at + 1).end()  # type: ignore[union-attr]  # as above
        else:
            done, at = _next(text, at, "]")
    if text.count("{", scanned, at) + text.count("[", scanned, at) != objects:
        for _item in _checked(scan, text, scanned):
            pass
    if known is not None:  # for the next reading
        known.length, known.digest, known.wide = end - begin, hash(text[begin:end]), wide.count - counted
    return at


def _checked(scan: Callable, text: str, at: int) -> Iterator[object]:
    """The items of the array at `text[at]` again, each walked for its nesting (ValueError past MAX_DEPTH)."""
    done = text[at:at + 1] == "]"
    at += done
    while not done:
        item, at = _value(scan, text, at, MAX_DEPTH - 2)  # inside the object and its array
        yield item
        done, at = _next(text, at, "]")


def json_items(path: Path, key: str, limit: int, wide: WideIntegers | None = None, *,
               texts: bool = False, known: Known | None = None) -> Iterator[Any]:
    """The items of the array at `key` in the JSON object of the side file `path` (read as
    `read_small` reads it), one at a time, as `json.loads` would parse them: 64 MiB of a log is
    held as its text, never as 650,000 dicts at once (about 200 MiB more). An integer past 64
    bits is an `Unread`, counted in `wide`. `texts`: each item comes as (item, its JSON text),
    which is the same where the items are, and cheaper to compare than the items (not the other
    way round: `1.0` is `1.00`, keys may come in any order). `key` given twice: RESTART before the items of the
    second array (the last counts, as in json.loads' dict). `known`: the text another file's
    array began with (`Known`), skipped here where this one begins alike (SKIPPED in place of
    its items), and this array's own left there for the next. A file that is not JSON, nests more
    than MAX_DEPTH levels, is not an object or holds no array at `key` raises ValueError once
    its items so far were given: a caller keeps nothing of them until the iteration ends."""
    raw = read_small(path, limit)
    text = raw.decode(json.detect_encoding(raw), "surrogatepass")  # as json.loads decodes bytes
    del raw
    wide = WideIntegers() if wide is None else wide
    decoder = json.JSONDecoder(parse_int=_integers(wide))
    scan = make_scanner(decoder)  # type: ignore[arg-type]  # typeshed's own TODO: a JSONDecoder is its context
    at = _skip(text, 0)
    if text[at:at + 1] != "{":
        raise ValueError("not a JSON object")
    found = seen = False  # the last `key` holds an array; one did before
    at = _skip(text, at + 1)
    closed = text[at:at + 1] == "}"
    at += closed
    while not closed:
        if text[at:at + 1] != '"':
            raise ValueError(f"expecting a property name at character {at}")
        name, at = scan(text, at)
        at = _skip(text, at)
        if text[at:at + 1] != ":":
            raise ValueError(f"expecting ':' at character {at}")
        at = _skip(text, at + 1)
        if name == key:
            found = text[at:at + 1] == "["
        if name == key and found:
            if seen:
                yield RESTART
                if known is not None:  # nothing of this file is for the next to skip
                    known.length = 0
                    known = None
            seen = True
            at = yield from _items(scan, text, at + 1, texts, known, wide)
        else:
            _skipped, at = _value(scan, text, at, MAX_DEPTH - 1)
        closed, at = _next(text, at, "}")
    if at != len(text):
        raise ValueError(f"extra data at character {at}")
    if not found:
        raise ValueError(f"no array at {key!r}")
