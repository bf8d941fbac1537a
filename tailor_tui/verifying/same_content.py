"""The output's model_states files of a resharded output, torch's unpickling done once per content.

A resharded output's model_states files hold one structure under each rank's archive name, and
torch's weights-only unpickler takes ~0.1 s for each of a wide run's (a placeholder tensor per
parameter): most of a 512-rank verification. A file whose archive lists, in order, the records of
one loaded before (every record checked against its CRC-32, `torch_files.small_records`), each
with the same name within the archive and the same bytes, loads as that one did: its object is
that one's. (`.data/serialization_id` aside: an id drawn per archive, which torch only logs.)

Frozen parameters' fragments are each rank's own. The first file of a structure (its `data.pkl`,
byte for byte) is loaded by torch, and the records that hold one frozen fragment each are found
in it: the one record whose bytes are the fragment's whole storage, a storage no other tensor of
the file uses. Any doubt (a fragment that is a view, bytes that two records share, an object the
walk cannot see into) and that structure is loaded by torch file by file. A later file of the
structure may differ from the first in those records alone; its object then holds its own
bytes for those fragments. Any other file is loaded by `torch_files.load`.
"""

from __future__ import annotations

from pathlib import Path

from tailor_tui.formats.ds_format import FROZEN_PARAM_FRAGMENTS
from tailor_tui.verifying.torch_files import load, small_records

SERIALIZATION_ID = ".data/serialization_id"


class SameContent:
    """`load` returns a file's object and a dict for what the caller found in it (what does not
    depend on the frozen fragments' values), shared by the files of one content."""

    def __init__(self, keep: int = 4):
        self.keep = keep
        self.known: dict[tuple, tuple[object, dict]] = {}  # content -> (object, found): the last `keep` contents
        # (structure, frozen) -> {record: frozen parameter} or None: the last `keep`
        self.holding: dict[tuple[bytes, tuple[str, ...]], dict[str, str] | None] = {}

    def load(self, path, frozen: tuple[str, ...] = ()) -> tuple[object, dict]:
        """`frozen`: the names of the frozen parameters whose fragments the file holds."""
        path = Path(path)
        records = small_records(path)
        if records is None or (prefix := _prefix(records)) is None:
            return load(path), {}
        key = (bytes(dict(records)[prefix + "data.pkl"]), frozen)
        first = None  # the first file of its structure: loaded by torch, which finds the fragments
        if frozen and key not in self.holding:
            first = load(path, checked=True)
            holding = _fragment_records(first, records, prefix, frozen)
            _remembered(self.holding, key, self.keep, lambda: holding)
        holding = self.holding[key] if frozen else {}
        if holding is None:
            return (first if first is not None else load(path, checked=True)), {}
        content, own = _content(records, prefix, holding)
        states, found = _remembered(self.known, content, self.keep,
                                    lambda: (first if first is not None else load(path, checked=True), {}))
        return (_with_fragments(states, own) if own else states), found

    def content(self, path, frozen: tuple[str, ...] = ()) -> tuple | None:
        """What `path` holds, as `load` compares it: every record's name within the archive and
        size, in order, and the bytes of all but those holding a frozen fragment alone (known once
        a file of its structure was loaded); None when `path` is no small torch zip file or its
        structure's fragments could not be told."""
        records = small_records(Path(path))
        if records is None or (prefix := _prefix(records)) is None:
            return None
        holding = self.holding.get((bytes(dict(records)[prefix + "data.pkl"]), frozen), None if frozen else {})
        return None if holding is None else _content(records, prefix, holding)[0]


def _prefix(records: list[tuple[str, memoryview]]) -> str | None:
    """The archive's folder (`name/`, torch's: one, holding data.pkl); None if it is not so."""
    pickles = [name for name, _data in records if name.endswith("/data.pkl")]
    prefix = pickles[0][: -len("data.pkl")] if len(pickles) == 1 else ""
    if prefix.count("/") != 1 or prefix == "/" or not all(name.startswith(prefix) for name, _data in records):
        return None
    return prefix


def _content(records, prefix: str, holding: dict[str, str]) -> tuple[tuple, dict[str, bytes]]:
    """(content key, {frozen parameter: its record's bytes})."""
    skip, names, sizes, held, own = len(prefix), [], [], [], {}
    for name, data in records:
        inner = name[skip:]
        if inner == SERIALIZATION_ID:
            continue
        names.append(inner)
        sizes.append(len(data))
        if inner in holding:
            own[holding[inner]] = bytes(data)
        else:
            held.append(data)
    return (tuple(names), tuple(sizes), b"".join(held)), own


def _remembered(memo: dict, key, keep: int, make):
    """`memo[key]`, made by `make()` the first time; past `keep` entries, the oldest is forgotten."""
    if key not in memo:
        if len(memo) >= keep:
            del memo[next(iter(memo))]
        memo[key] = make()
    return memo[key]


def _tensors(obj, depth: int = 0):
    """Every tensor in a loaded structure of dicts, lists and tuples; None where something else
    (an object, a structure deeper than a model_states file's) might hold one."""
    import torch

    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (str, bytes, int, float, bool, type(None), torch.dtype, torch.Size)):
        return []
    if depth >= 16 or not isinstance(obj, (dict, list, tuple)):
        return None
    found = []
    for item in (obj.values() if isinstance(obj, dict) else obj):
        inner = _tensors(item, depth + 1)
        if inner is None:
            return None
        found += inner
    return found


def _fragment_records(states, records, prefix: str, frozen: tuple[str, ...]) -> dict[str, str] | None:
    """{record name within the archive: frozen parameter} of the records that each hold one of
    the `frozen` parameters' fragments and nothing else, in the loaded `states`; None when that
    cannot be told for every one of them."""
    import torch

    tensors = _tensors(states)
    fragments = states.get(FROZEN_PARAM_FRAGMENTS) if isinstance(states, dict) else None
    if tensors is None or not isinstance(fragments, dict):
        return None
    users: dict[int, int] = {}
    for t in tensors:
        if t.untyped_storage().nbytes():
            users[t.untyped_storage().data_ptr()] = users.get(t.untyped_storage().data_ptr(), 0) + 1
    data = [(name[len(prefix):], bytes(value)) for name, value in records if name[len(prefix):].startswith("data/")]
    holding = {}
    for name in frozen:
        t = fragments.get(name)
        if not isinstance(t, torch.Tensor) or not t.numel():
            return None
        storage = t.untyped_storage()
        if (t.storage_offset() or not t.is_contiguous() or storage.nbytes() != t.numel() * t.element_size()
                or users.get(storage.data_ptr()) != 1):
            return None
        mine = t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        matches = [record for record, value in data if value == mine]
        if len(matches) != 1 or matches[0] in holding:
            return None
        holding[matches[0]] = name
    return holding


def _with_fragments(states: dict, own: dict[str, bytes]) -> dict:
    """`states` with each frozen fragment in `own` made of those bytes, shaped as its own is."""
    import torch

    fragments = dict(states[FROZEN_PARAM_FRAGMENTS])
    for name, data in own.items():
        known = fragments[name]
        fragments[name] = torch.frombuffer(bytearray(data), dtype=known.dtype).reshape(known.shape)
    return {**states, FROZEN_PARAM_FRAGMENTS: fragments}
