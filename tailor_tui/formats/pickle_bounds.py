"""How much a pickle would build, found before one object is built: the bounds every checkpoint
pickle is held to (memo, nesting, estimated memory of its objects, unfolded), in one pass over its
bytes with no argument decoded. `pickled` checks them before it unpickles anything.
"""

from __future__ import annotations

import pickle
import pickletools
from typing import Any

# A ZeRO-3 checkpoint's pickle is small whatever the model size (shapes, counters, where tensors sit):
# about 300 bytes and 60 opcodes per parameter, so a few MiB for a 70B model and ~15 MiB for a 47k-parameter
# MoE. Anything beyond these bounds is refused before one object is built: reading any structure stays under
# 256 MiB of memory.
MAX_PICKLE_BYTES = 64 << 20
MAX_OBJECT_BYTES = 160 << 20  # estimated memory of the objects the pickle would build, unfolded
MAX_MEMO = 1 << 22  # memo slots (a crafted LONG_BINPUT 400000000 would allocate 3 GiB)
MAX_NESTING = 100  # open MARKs
_CHEAP = {"BINPUT", "LONG_BINPUT", "PUT", "MEMOIZE", "BINGET", "LONG_BINGET", "GET", "MARK", "STOP",
          "PROTO", "FRAME", "POP", "POP_MARK", "DUP", "BININT1", "NONE", "NEWTRUE", "NEWFALSE"}
# opcodes that call a constructor: each builds an object (a tensor stand-in with its tuples and hooks, a Size)
# whatever its arguments' cost was (they may all be one memoized tuple)
_BUILDS = {"REDUCE", "BUILD", "NEWOBJ", "NEWOBJ_EX", "OBJ", "INST"}
BUILD_COST = 512
# what an opcode makes that a later one may add to (APPEND…, BUILD: -1, the items up to the MARK)
_CONTAINERS = {"EMPTY_LIST", "EMPTY_DICT", "EMPTY_SET", "LIST", "DICT", "OBJ", "INST", "REDUCE", "NEWOBJ", "NEWOBJ_EX"}
_ADDS = {"APPEND": 1, "SETITEM": 2, "BUILD": 1, "APPENDS": -1, "SETITEMS": -1, "ADDITEMS": -1}
# How check_bounds_bytes steps over an opcode's argument, and what it does to the stack
_FIXED, _MEMO_INDEX, _MEMO_LINE, _SIZED, _LINES, _UNKNOWN = range(6)
_MAKE, _ADD, _GET, _PUT, _MARK, _POP, _POP_MARK, _STOP, _REFUSE = range(9)


class Truncated(pickle.UnpicklingError):
    """The pickle goes on past the bytes given."""


def _opcode_table() -> list[tuple]:
    """code byte -> (how its argument is laid out, its bytes or lines, base cost, what it does to the stack,
    how many items it takes (-1: to the MARK), what it leaves (0 nothing, 1 a value, 2 a container), name)."""
    table = [(_UNKNOWN, 0, 0, _REFUSE, 0, 0, "")] * 256
    special = {"MARK": _MARK, "POP": _POP, "POP_MARK": _POP_MARK, "STOP": _STOP, "DUP": _REFUSE, "MEMOIZE": _PUT}
    for op in pickletools.opcodes:
        arg, name, n = op.arg, op.name, 0
        if arg is None or arg.n >= 0:
            n = arg.n if arg is not None else 0
            kind = _MEMO_INDEX if name.endswith(("PUT", "GET")) else _FIXED
        elif arg.n == pickletools.UP_TO_NEWLINE:
            kind, n = _MEMO_LINE if name in ("PUT", "GET") else _LINES, 2 if arg.name.endswith("_pair") else 1
        else:
            kind = _SIZED
            n = {pickletools.TAKEN_FROM_ARGUMENT1: 1, pickletools.TAKEN_FROM_ARGUMENT4: -4,
                 pickletools.TAKEN_FROM_ARGUMENT4U: 4, pickletools.TAKEN_FROM_ARGUMENT8U: 8}[arg.n]
        takes = -1 if pickletools.markobject in op.stack_before else len(op.stack_before)
        action = special.get(name, _GET if name.endswith("GET") else _PUT if name.endswith("PUT") else
                             _ADD if name in _ADDS else _MAKE)
        base = 8 if name in _CHEAP else BUILD_COST if name in _BUILDS else 64
        leaves = 2 if name in _CONTAINERS else 1 if op.stack_after else 0
        table[op.code.encode("latin-1")[0]] = (kind, n, base, action, _ADDS.get(name, takes), leaves, name)
    return table


_OPCODES = _opcode_table()


def check_bounds_bytes(data: bytes) -> int:
    """The index just past the STOP of the pickle `data` starts with; refuses (UnpicklingError) one whose
    memo, nesting or estimated object memory, unfolded, exceeds what a checkpoint ever needs: a memo fetch
    costs all that the object fetched holds (one tuple used a million times costs a million tuples: hashing,
    printing or walking it costs that). A container changed once fetched (a structure that holds itself) is
    refused: no checkpoint holds one. One pass over the bytes, arguments not decoded."""
    cost = i = 0
    # stack and memo hold a value's weight (int) or a container's [weight, fetched], told apart by
    # `__class__ is int` (faster than isinstance, but the type checker does not narrow on it): Any
    stack: list[Any] = []
    memo: dict[int, Any] = {}
    marks: list[int] = []
    end = len(data)
    table, find, from_bytes, max_memo = _OPCODES, data.find, int.from_bytes, MAX_MEMO
    FIXED, MEMO_INDEX, MAKE, ADD, GET, PUT = _FIXED, _MEMO_INDEX, _MAKE, _ADD, _GET, _PUT  # noqa: N806 (fast locals)
    while True:
        try:
            kind, n, base, action, takes, leaves, name = table[data[i]]
        except IndexError:  # i is past the last byte
            raise Truncated("the pickle ends before its STOP opcode (truncated)") from None
        i += 1
        weight, index = base, -1
        if kind == FIXED:
            i += n
        elif kind == MEMO_INDEX:
            index, i = from_bytes(data[i: i + n], "little"), i + n
            if index >= max_memo:
                raise pickle.UnpicklingError(f"memo index {index} is beyond what any checkpoint uses")
        elif kind == _SIZED:
            width = n if n > 0 else -n
            size = from_bytes(data[i: i + width], "little", signed=n < 0)
            if size > MAX_PICKLE_BYTES:
                raise pickle.UnpicklingError(f"its structure is larger than {MAX_PICKLE_BYTES >> 20} MiB")
            if size < 0 or i + width + size > end:
                raise Truncated(f"{name} at byte {i} claims {size} bytes past the end (truncated)")
            i += width + size
            weight += size
        elif kind == _MEMO_LINE:
            j = find(b"\n", i)
            try:
                index = int(data[i:j]) if j >= 0 else -1
            except ValueError:
                index = -1
            if index < 0:
                raise Truncated(f"{name} at byte {i} has no index (truncated?)")
            if index >= max_memo:
                raise pickle.UnpicklingError(f"memo index {index} is beyond what any checkpoint uses")
            i = j + 1
        elif kind == _LINES:
            for _ in range(n):
                j = find(b"\n", i)
                if j < 0:
                    raise Truncated(f"{name} at byte {i} has no end of line (truncated)")
                weight += j - i
                i = j + 1
        else:
            raise pickle.UnpicklingError(f"unknown opcode {data[i - 1]:#04x} at byte {i - 1}")
        cost += weight
        if action == MAKE and not takes:  # a value of its own (the most frequent): a reference to it weighs 8
            if leaves:
                stack.append(8 if leaves == 1 else [weight, False])
        elif action == MAKE or action == ADD:
            if takes < 0 and not marks:
                raise pickle.UnpicklingError(f"{name} at byte {i - 1} has no MARK")
            start = marks.pop() if takes < 0 else len(stack) - takes
            if start < (marks[-1] if marks and takes >= 0 else 0):
                raise pickle.UnpicklingError(f"{name} at byte {i - 1} takes more than the stack holds")
            taken = stack[start:]
            del stack[start:]
            for item in taken:
                weight += item if item.__class__ is int else item[0]
            if action == ADD:
                held = stack[-1] if stack and (not marks or len(stack) > marks[-1]) else None
                if held is None or held.__class__ is int or held[1]:
                    raise pickle.UnpicklingError(f"{name} at byte {i - 1} adds to what is no new container")
                held[0] += weight
            else:
                stack.append([weight, False] if leaves == 2 else weight)
        elif action == GET:
            try:
                item = memo[index]
            except KeyError:
                raise pickle.UnpicklingError(f"{name} at byte {i - 1} fetches memo {index}, never set") from None
            if item.__class__ is not int:
                item[1] = True
                cost += item[0]
            else:
                cost += item
            stack.append(item)
        elif action == PUT:
            memo[len(memo) if index < 0 else index] = stack[-1]  # at most MAX_MEMO + 1 entries
            continue
        elif action == _MARK:
            marks.append(len(stack))
            if len(marks) > MAX_NESTING:
                raise pickle.UnpicklingError(f"nested more than {MAX_NESTING} deep")
            continue
        elif action == _POP:  # the MARK when nothing lies above it
            (marks if marks and len(stack) == marks[-1] else stack).pop()
        elif action == _POP_MARK:
            if not marks:
                raise pickle.UnpicklingError(f"{name} at byte {i - 1} has no MARK")
            del stack[marks.pop():]
        elif action == _STOP:
            return i
        else:
            raise pickle.UnpicklingError(f"{name} at byte {i - 1}, which no checkpoint uses")
        if cost > MAX_OBJECT_BYTES:
            raise pickle.UnpicklingError(f"it would build more than {MAX_OBJECT_BYTES >> 20} MiB of objects")
