"""What an output records of how it was made (`tailor_provenance.json`), and the digest every
process of a job agrees on before composing: the recipe, the rows' sources, and the identity
of every checkpoint's files (sizes, times)."""

from __future__ import annotations

import hashlib
import json
import os
import time

from tailor_tui import __version__
from tailor_tui.checkpoints.checkpoint import Checkpoint, tied_partner
from tailor_tui.planning.plan import ComposePlan


def plan_digest(plan: ComposePlan) -> str:
    """What every process of a job must agree on: the recipe, the output, every checkpoint's
    files (sizes, times) and what is taken from where."""
    record = provenance(plan)
    del record["created"]
    return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()


def _identity(ckpt: Checkpoint) -> dict:
    files = {}
    for f, size in sorted(ckpt.sizes.items()):
        st = f.stat()
        files[os.path.relpath(f, ckpt.path)] = {"bytes": size, "mtime": st.st_mtime}
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

