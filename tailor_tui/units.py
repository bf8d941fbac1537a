"""How tailor-tui shows sizes, progress and names: one way everywhere (plan, CLI, bars, composer)."""

from __future__ import annotations

import unicodedata


def size(n: float) -> str:
    """Bytes, binary units: `1.4 GiB`."""
    import humanize  # here: ~7 ms, which what reads a recipe or a checkpoint without showing a size spares

    return humanize.naturalsize(n, binary=True, format="%.1f")


def throughput(done: float, total: float, elapsed: float) -> tuple[float, float]:
    """(bytes per second so far, seconds left at that rate) of `done` of `total` bytes."""
    rate = done / max(elapsed, 1e-6)
    return rate, (total - done) / rate if rate > 0 else 0.0


# The largest whole number a person may write for tailor-tui (a recipe's `world_size`, an LLMTailor
# `layer_range`, `--world-size`, the composer's world size): 64 bits, signed
MAX_WHOLE = (1 << 63) - 1
WHOLE_NUMBER = ("plain decimal digits 0-9: no sign, leading zero, `_`, 0x/0o/0b or 1:30 form, "
                f"at most {MAX_WHOLE:,}")


def whole_number(text: str) -> int | None:
    """The whole number `text` spells, or None: the one rule for every number a person writes for
    tailor-tui (`WHOLE_NUMBER`). ASCII digits only: Python's int() also reads other scripts' digits
    (`٣`) and fails on others `str.isdigit` accepts (`²`); no leading zero: YAML 1.1 (PyYAML, mergekit)
    reads `010` as 8, so a recipe's number means one value whoever reads it; below 2**63, so 5,000
    digits are refused unread (int() refuses past 4,300)."""
    if not (text.isascii() and text.isdigit() and len(text) <= len(str(MAX_WHOLE))) or text[0] == "0" != text:
        return None
    value = int(text)
    return value if value <= MAX_WHOLE else None


def clipped(text: str, most: int = 40) -> str:
    """`text` as a message quotes what a person wrote: whole, or past `most` characters its start and
    its length (a number of 5,000 digits)."""
    return text if len(text) <= most else f"{text[:most - 16]}… ({len(text):,} characters)"


# What never reaches a terminal or a log as it is: C0 controls (newline, carriage return and
# escape among them), DEL, C1 controls, the line and paragraph separators, and every format
# character (Unicode category Cf: the bidirectional overrides, isolates and marks, which can make a
# name read backwards; the zero-width space, joiners and word joiner, the BOM, the soft hyphen, the
# invisible operators and tags, which make one name look like another). A code point's category is
# looked up the first time a text holds it (the table of all 163 Cf code points would take ~14 ms of
# every start to build), and remembered: the escapes always, up to 65,536 others.
_CONTROLS = [*range(0x20), *range(0x7F, 0xA0), 0x2028, 0x2029]


def _escape(c: int) -> str:
    return repr(chr(c))[1:-1]  # as repr writes it: \n, \x1b, \u202e, \U000e0001


class _Escapes(dict[int, str]):
    """{code point: how it is shown} for `str.translate`, filled as texts are shown."""

    def __missing__(self, c: int) -> str:
        if unicodedata.category(chr(c)) in ("Cc", "Cf"):
            escaped = self[c] = _escape(c)
            return escaped
        if len(self) >= 1 << 16:
            raise LookupError(c)  # left as it is; not remembered
        self[c] = chr(c)
        return self[c]


_ESCAPED = _Escapes({c: _escape(c) for c in _CONTROLS})


def _unformatted(text: str) -> str:
    return "".join(c for c in text if unicodedata.category(c) != "Cf")


def read_as(name: str) -> str:
    """What a name reads as: its format characters (Cf) removed and its compatibility forms folded
    (NFKC: a fullwidth `６` reads as `6`, a ligature `ﬁ` as `fi`). Two names that differ but read as
    the same (`checkpoint-6`, `checkpoint-6` + U+200B, `checkpoint-６`) are confusable: the scan
    refuses a run holding both (`checkpoints.scan`)."""
    return _unformatted(unicodedata.normalize("NFKC", _unformatted(name)))


def shown(text: object) -> str:
    """A name (a path, a folder, a row) or a one-line message holding names, as tailor-tui prints
    or shows it: its control and format characters written as repr writes them (`\\x1b[2J`, `\\n`,
    `\\u200b`), so a hostile name can neither drive the terminal, split one line into two, nor pass
    for another name. Everything else, and a name without such characters, stays as it is. The one
    rule for the CLI and the composer."""
    return str(text).translate(_ESCAPED)


def shown_lines(text: object) -> str:
    """`shown` for text of several lines (a plan, a table): each line escaped, the line breaks kept."""
    return "\n".join(shown(line) for line in str(text).split("\n"))
