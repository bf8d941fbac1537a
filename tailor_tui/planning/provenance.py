"""What an output records of how it was made (`tailor_provenance.json`), and the digest every
process of a job agrees on before composing: the recipe, the rows' sources, and the identity
of every checkpoint's files (sizes, times)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from pathlib import Path

from tailor_tui import __version__
from tailor_tui.checked.files import FileIdentity
from tailor_tui.checkpoints.checkpoint import PROVENANCE, Checkpoint, tied_partner
from tailor_tui.checkpoints.side_files import MAX_RECORD, load_json
from tailor_tui.planning.plan import ComposePlan


def plan_digest(plan: ComposePlan) -> str:
    """What every process of a job must agree on: the recipe, the output, every checkpoint's
    files (sizes, times) and what is taken from where."""
    record = provenance(plan)
    del record["created"]
    return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()


def _identity(ckpt: Checkpoint) -> dict:
    """A checkpoint as the output records it: each file's size, times and inode as the composition read
    them (its identities when it was opened, which the tasks checked: `checked.files.PlannedFiles`), what `--verify` finds a
    source that changed since by (`changed_since`). The device is left out: it differs between the nodes
    of a job on a shared filesystem, whose processes must agree on this record."""
    files = {}
    for f, size in sorted(ckpt.sizes.items()):
        found = ckpt.identities[f]  # (recorded beside its size)
        files[os.path.relpath(f, ckpt.path)] = {"bytes": size, "mtime": found.mtime_ns / 1e9,
                                                 "mtime_ns": found.mtime_ns, "ctime_ns": found.ctime_ns,
                                                 "inode": found.inode}
    return {
        "path": str(ckpt.path.resolve()),
        "kind": ckpt.kind,
        "tag": ckpt.tag,
        "step": ckpt.step,
        "world_size": ckpt.world_size,
        "dtype": ckpt.dtype,
        "deepspeed_version": ckpt.ds_version,
        "files": files,
    }


def read_record(out: Path) -> dict | None:
    """The provenance record of the output folder `out` (None: none readable; a link is not followed)."""
    try:
        record = load_json(out / PROVENANCE, MAX_RECORD, follow=False)
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def stand_in(record: dict, path: Path, base: Checkpoint) -> Checkpoint | None:
    """The checkpoint at `path`, deleted since the composition `record` (its provenance record) tells of,
    as a `--verify` of that output plans it: the base's layout, rows and file names under `path`, marked
    `gone` (nothing of it is read: `changed_since` names it gone, and the rows it gave are proven against
    what the record says was taken). None where the record does not name it, or names it with another world
    size, dtype, kind or other files than the base's (a plan from the base's layout would be wrong), or the base
    keeps its rows' slices apart (`SaveKind.sliced`: a partial save's rows and slices are its own)."""
    where = str(path.resolve()) if path.is_absolute() else str(path.absolute())
    entries = record.get("sources") if isinstance(record, dict) else None
    entry = next((e for e in entries or () if isinstance(e, dict) and e.get("path") == where), None)
    if entry is None or base.saved.sliced or (entry.get("world_size"), entry.get("dtype"), entry.get("kind")) != (
            base.world_size, base.dtype, base.kind) or not isinstance(entry.get("step"), int):
        return None
    tag, gone = entry.get("tag"), Path(where)
    base_tag = os.path.relpath(base.tag_dir, base.path)  # "." where the checkpoint is named by its tag folder
    if not isinstance(tag, str) or (base_tag != "." and (not tag or "/" in tag or tag in (".", ".."))):
        return None

    def moved(f: Path) -> Path:  # the base's file as the gone checkpoint named it: under its path, its tag
        rel = os.path.relpath(f, base.path)
        if base_tag != "." and (rel == base_tag or rel.startswith(base_tag + os.sep)):
            rel = tag + rel[len(base_tag):]
        return gone / rel

    if not isinstance(entry.get("files"), dict) or set(entry["files"]) != {
            os.path.relpath(moved(f), gone) for f in base.sizes}:
        return None

    ranks = tuple(dataclasses.replace(r, model_states=moved(r.model_states), optim_states=moved(r.optim_states))
                  for r in base.ranks)
    return dataclasses.replace(base, path=gone, tag=tag, tag_dir=moved(base.tag_dir),
                               save_dir=moved(base.save_dir), step=entry["step"], ranks=ranks,
                               model_files=tuple(moved(f) for f in base.model_files), sizes={}, identities={},
                               composed=False, gone=True)


def changed_since(record: dict) -> list[tuple[str, str]]:
    """The source files a provenance record (`provenance`) names that are not, now, as the composition read
    them: (the checkpoint's path as recorded, a line: "PATH: changed since the composition (its ctime)") each;
    those it names without their times (an older record) are not looked at. `record` comes from a file:
    every field is checked."""
    said = []
    entries = [record.get("base"), *(record.get("sources") or [])] if isinstance(record, dict) else []
    for entry in entries:
        if not (isinstance(entry, dict) and isinstance(entry.get("path"), str) and isinstance(entry.get("files"), dict)):
            continue
        if not os.path.lexists(entry["path"]):  # the whole checkpoint: one line, not one per file
            said.append((entry["path"], f"{entry['path']}: gone since the composition (it read "
                                        f"{len(entry['files']):,} file(s) there)"))
            continue
        for rel, was in entry["files"].items():
            if not (isinstance(rel, str) and isinstance(was, dict)
                    and all(type(was.get(k)) is int for k in ("bytes", "mtime_ns", "ctime_ns", "inode"))):
                continue
            path = Path(entry["path"]) / rel
            try:
                st = os.stat(path)
            except OSError:
                said.append((entry["path"], f"{path}: gone since the composition (it read {was['bytes']:,} bytes there)"))
                continue
            then = FileIdentity(st.st_dev, was["inode"], was["bytes"], was["mtime_ns"], was["ctime_ns"])
            now = FileIdentity.of(st)
            if then != now:
                said.append((entry["path"], f"{path}: changed since the composition ({then.differences(now)})"))
    return said


def provenance(plan: ComposePlan) -> dict:
    rows = {}
    for row in plan.base.rows:
        if row.tied:
            rows[row.name] = f"tied to {tied_partner(plan.base, row)}"
        else:
            rows[row.name] = str(plan.sources[plan.picks[row.name]].path.resolve())
    return {
        "tool": f"tailor-tui {__version__}",
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "recipe": plan.recipe.to_yaml(),
        "recipe_file": str(plan.recipe.source_file.resolve()) if plan.recipe.source_file else None,
        "rows": rows,
        "base": _identity(plan.base),
        "sources": [_identity(s) for s in plan.sources[1:]],
        **({"world_size": plan.world_size, "resharded": plan.reshard.describe(plan.base)} if plan.reshard else {}),
    }

