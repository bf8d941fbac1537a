"""A composition plan: all the work a checked recipe takes, computed once when the plan is made (a job
per output rank, a job per weight file, the files copied from the base), its totals and its
description. `build.build_plan` checks a recipe against its checkpoints and makes one.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path

from tailor_tui.checked.files import FileIdentity
from tailor_tui.checkpoints.checkpoint import MODEL_FILE_INDEX, Checkpoint, tied_members, tied_partner
from tailor_tui.checkpoints.model_layout import ModelFileLayout
from tailor_tui.checkpoints.weight_files import FileFate
from tailor_tui.cloning import may_share
from tailor_tui.formats.ds_format import TENSORS, bytes_per_element, describe_state
from tailor_tui.planning.file_plan import (
    copied_files,
    describe_files,
    file_fates,
    root_of,
    weight_jobs,
)
from tailor_tui.planning.jobs import (
    STREAM,
    FrozenRow,
    RankJob,
    RowSlot,
    SliceCopy,
    WeightJob,
    optim_writer,
)
from tailor_tui.planning.recipe import Recipe
from tailor_tui.resharding.partition import (
    Reshard,
    ReshardJob,
    output_names,
    renamed_for,
    reshard_jobs,
)
from tailor_tui.units import size


@dataclass(frozen=True)
class ComposePlan:
    """A recipe checked against its checkpoints, and all the work it takes, computed once when
    the plan is made (the writers take their jobs from it and never call back into it)."""

    recipe: Recipe
    base: Checkpoint
    sources: tuple[Checkpoint, ...]  # sources[0] is the base
    picks: dict[str, int]  # every non-tied row -> index into sources
    output: Path
    force: bool = False
    warnings: tuple[str, ...] = ()  # worth a look, not a reason to refuse (`warning: ...` lines)
    reshard: Reshard | None = None  # composing into another world size (`--world-size`)
    # the flat tensors of every sub-group a row's slices lie in: the fp32 masters, then the optimizer's state kept
    # per element (`RankReader.keys`), the same in every checkpoint (`build`)
    keys: tuple[str, ...] = TENSORS
    _jobs: tuple[RankJob | ReshardJob, ...] = field(init=False, repr=False)
    _model_layout: ModelFileLayout | None = field(init=False, repr=False)
    _model_jobs: tuple[WeightJob, ...] = field(init=False, repr=False)
    _other_files: tuple[tuple[Path, Path], ...] = field(init=False, repr=False)
    _shares: str | None = field(init=False, repr=False)
    _identities: dict[Path, FileIdentity] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        layout = self._read_model_layout()
        jobs: tuple[RankJob | ReshardJob, ...]
        if self.reshard is not None:
            jobs = reshard_jobs(self.base, self.sources, self.source_of_param(), self.reshard, self.keys)
        else:
            src, owner = self.source_of_param(), self.base.param_to_row()  # worked out once, not per rank
            buffers = tuple(self.buffer_sources().items())
            held: dict[int, tuple] = {}  # ranks that hold the same elements share their slots' lists
            jobs = tuple(self._rank_job(r, src, owner, buffers, held) for r in range(self.base.world_size))
        model_jobs = weight_jobs(self.base, self.sources, self.picks, layout)
        for name, value in (("_jobs", jobs),
                            ("_model_layout", layout),
                            ("_model_jobs", model_jobs),
                            ("_other_files", self._list_other_files()),
                            ("_shares", may_share(self.base.path, self.output.parent)),
                            ("_identities", self._record_identities(model_jobs))):
            object.__setattr__(self, name, value)

    def identities(self) -> dict[Path, FileIdentity]:
        """Every source file's identity as the plan knows it (`checked.files.FileIdentity`): its checkpoint's rank
        and model files as they were when it was opened, its other weight files (`.bin`) as the plan found
        them. What a composition's tasks check the files they read against (`checked.files.PlannedFiles`)."""
        return self._identities

    def identities_of(self, paths) -> dict[Path, FileIdentity]:
        """The identities the plan recorded of `paths` (those it knows: `identities`), each once."""
        return {f: self._identities[f] for f in dict.fromkeys(paths) if f in self._identities}

    def _record_identities(self, model_jobs: tuple[WeightJob, ...]) -> dict[Path, FileIdentity]:
        known = {f: i for s in self.sources for f, i in s.identities.items()}
        for job in model_jobs:  # weight files the checkpoints do not list (torch's format)
            for f in (job.base_file, *job.source_paths()):
                if f is not None and f not in known:
                    with contextlib.suppress(OSError):
                        known[f] = FileIdentity.of(f.stat())
        return known

    # --- per rank work ---------------------------------------------------------------

    def source_of_param(self) -> dict[str, int]:
        return {p: self.picks[row.name] for row in self.base.rows for p in (*row.params, *row.buffers)}

    def buffer_sources(self) -> dict[str, int]:
        """Every buffer of a row picked from another checkpoint -> that checkpoint's index."""
        return {b: self.picks[row.name] for row in self.base.rows for b in row.buffers if self.picks[row.name]}

    def rank_jobs(self) -> tuple[RankJob | ReshardJob, ...]:
        """One job per output rank: RankJobs, or ReshardJobs when resharding."""
        return self._jobs

    @property
    def world_size(self) -> int:
        """The output's data-parallel world size."""
        return self.reshard.world_size if self.reshard else self.base.world_size

    def output_rank_files(self) -> tuple[tuple[str, str], ...]:
        """(model_states, optim_states) file names of every output rank, in its tag folder."""
        if self.reshard is not None:
            return output_names(self.base, self.world_size)
        return tuple((f.model_states.name, f.optim_states.name) for f in self.base.ranks)

    def _rank_job(self, rank: int, src: dict[str, int], owner: dict[str, str],
                  buffers: tuple[tuple[str, int], ...], held: dict[int, tuple]) -> RankJob:
        layout = self.base.layout
        key = layout.same_holdings(rank)
        if key not in held:
            held[key] = self._slices(rank, src, owner)
        row_slots, copies, padding = held[key]
        frozen = tuple((n, src[n]) for n, _ in layout.frozen if src.get(n, 0))
        used = {c.source for c in copies} | {s for _, s in frozen} | {s for _, s in buffers}
        files = {0: self.base.ranks[rank]} | {s: self.sources[s].ranks[rank] for s in sorted(used)}
        # every byte of the base, and the whole record of each full source's sub-group a slice
        # comes from (its stored CRC-32 covers the whole record); a partial's slices alone
        sizes = layout.group_sizes()
        read = self.base.rank_bytes(rank) + bytes_per_element(self.keys) * sum(
            files[s].elements_checked({c.group for c in copies if c.source == s},
                                      sum(c.length for c in copies if c.source == s), sizes)
            for s in sorted({c.source for c in copies}))
        valid = layout.frozen_valid(rank)
        frozen_rows = tuple(FrozenRow(owner[n], n, src.get(n, 0), valid[n]) for n, _ in layout.frozen)
        return RankJob(
            row_slots=row_slots,
            frozen_rows=frozen_rows,
            rank=rank,
            files=files,
            group_sizes=tuple(layout.group_sizes()),
            copies=copies,
            padding=padding,
            frozen=frozen,
            buffers=buffers,
            read_bytes=read,
            write_bytes=self._rank_output_bytes(rank),
            keys=self.keys,
        )

    def _slices(self, rank: int, src: dict[str, int], owner: dict[str, str]) -> tuple[tuple, tuple, tuple]:
        """(row_slots, copies, padding) of `rank`: where each slot's elements come from."""
        layout = self.base.layout
        copies: list[SliceCopy] = []
        padding: list[list[int]] = []  # [group, offset, length]
        row_slots: list[RowSlot] = []
        for slot in layout.slots:
            valid = slot.valid(rank)
            if valid:
                row_slots.append(RowSlot(owner[slot.name], slot.name, slot.group, slot.offset, valid,
                                         src.get(slot.name, 0)))
            s = src.get(slot.name, 0)
            if valid and self.sources[s].saved.sliced:
                # a partial checkpoint keeps each parameter's slice apart; a partial base has no
                # optim file to start from, so every slice is listed, the base's own included
                copies.append(SliceCopy(slot.group, slot.offset, valid, s, slot.name))
            elif s and valid:
                last = copies[-1] if copies else None
                if (last and last.source == s and last.param is None and last.group == slot.group
                        and last.offset + last.length == slot.offset):
                    copies[-1] = SliceCopy(slot.group, last.offset, last.length + valid, s)
                else:
                    copies.append(SliceCopy(slot.group, slot.offset, valid, s))
            if valid < slot.part:  # neighbours joined: past a parameter's elements a rank holds only padding
                if padding and padding[-1][0] == slot.group and sum(padding[-1][1:]) == slot.offset + valid:
                    padding[-1][2] += slot.part - valid
                else:
                    padding.append([slot.group, slot.offset + valid, slot.part - valid])
        return tuple(row_slots), tuple(copies), tuple(tuple(p) for p in padding)

    def _rank_output_bytes(self, rank: int) -> int:
        if not self.base.saved.sliced:
            return self.base.rank_bytes(rank)
        files = self.base.ranks[rank]  # its optim file written whole
        return self.base.sizes[files.model_states] + sum(self.base.layout.group_sizes()) * bytes_per_element(self.keys)

    # --- the 16-bit model files ------------------------------------------------------

    def model_layout(self):
        """The layout (names, headers, index) of the output's model files, or None.

        A full base's own files; a partial HF base's recorded layout or, if its save
        recorded none, any full HF source's (every checkpoint of a run has the same)."""
        return self._model_layout

    def _read_model_layout(self):
        if self.base.model_files:
            return ModelFileLayout.of_files(self.base.model_files)
        if not self.base.folder.weights_per_row:
            return None
        if self.base.saved.model_layout is not None:
            return ModelFileLayout.read(self.base.saved.model_layout)
        for src in self.sources:
            if src.model_files:
                return ModelFileLayout.of_files(src.model_files)
        return None

    def model_file_jobs(self) -> tuple[WeightJob, ...]:
        """One job per weight file of the output (`file_plan.weight_jobs`): safetensors
        (`ModelFileJob`), torch's format (`BinFileJob`)."""
        return self._model_jobs

    # --- totals and description -------------------------------------------------------

    def other_files(self) -> tuple[tuple[Path, Path], ...]:
        """Base files copied unchanged into the output: (where in the base folder, where in the
        output). The same place but for the RNG states of a resharded HF checkpoint
        (`reshard.renamed_for`)."""
        return self._other_files

    def file_fates(self) -> tuple[FileFate, ...]:
        """What happens to every file of the base folder but its rank files (`file_plan`)."""
        return file_fates(self.model_file_jobs(), self.other_files())

    def _list_other_files(self) -> tuple[tuple[Path, Path], ...]:
        found = copied_files(self.base, self.picks)
        if self.reshard is None:
            return tuple((p, p) for p in found)
        pairs = ((p, renamed_for(p, self.world_size)) for p in found)
        return tuple((p, q) for p, q in pairs if q is not None)

    def other_files_root(self) -> Path:
        return root_of(self.base)

    def bytes_to_write(self) -> int:
        """Every byte of the output but its provenance record: rank files, model files, the
        base's other files, and the `latest` file and model index the composition writes itself."""
        root = self.other_files_root()
        others = sum((root / p).stat().st_size for p, _q in self.other_files())
        models = sum(j.size for j in self.model_file_jobs())
        own = sum(len(text.encode()) for text in self.own_files().values())
        return sum(j.write_bytes for j in self.rank_jobs()) + models + others + own

    def own_files(self) -> dict[str, str]:
        """The files the composition writes itself, neither composed per row nor copied from the base, by
        their path in the output: `latest`, naming the tag, where the base is a DeepSpeed save_dir or a
        partial save (an HF base's is among its files), and the model files' index a partial base's
        layout records. The writer writes them, `--verify` checks them, the plan counts them: this rule."""
        own = {}
        if not self.base.in_folder or not self.base.saved.keeps_latest:
            own["latest"] = self.base.tag
        layout = self.model_layout()
        if self.base.saved.masters_only and layout is not None and layout.index is not None:
            own[MODEL_FILE_INDEX] = layout.index
        return own

    def rewritten_files(self) -> int:
        """How many rank files torch writes anew (their size known only once written): a
        partial base's optim files, model_states holding frozen fragments or buffers, and every
        file of a base in torch's legacy format. The others are byte-exact in the plan."""
        from tailor_tui.formats.ptfile import file_format

        if self.reshard is not None:
            return 2 * self.world_size  # every rank file: its structure written by torch
        n = 0
        for job in self.rank_jobs():
            assert isinstance(job, RankJob), "not resharding: every rank's job is a RankJob"
            base = job.files[0]
            legacy = file_format(base.model_states) != "zip"
            n += optim_writer(base) != STREAM
            n += bool(job.frozen or job.buffers or legacy)
        return n

    def bytes_to_read(self) -> int:
        """Base bytes copied plus the slices read from other sources."""
        models = sum(j.size for j in self.model_file_jobs())
        return sum(j.read_bytes for j in self.rank_jobs()) + models

    def progress_bytes(self) -> int:
        """What the progress bars count: the bytes of every rank file and weight file written."""
        return sum(j.progress_bytes for j in (*self.rank_jobs(), *self.model_file_jobs()))

    def shares(self, *, clone: bool = True) -> str | None:
        """Where the output may share the base's blocks ("the base's xfs filesystem", found once with
        the plan: `cloning.may_share`); None where it cannot, or `clone` is False (--no-clone)."""
        return self._shares if clone else None

    def progress_unit(self, *, clone: bool = True) -> str:
        """What the progress of this plan's tasks counts, as every bar and line says it: bytes
        "written", or "composed" where the output may share the base's blocks (a clone's bytes are
        done without being written: each task's last line, and the log's, say how many were)."""
        return "composed" if self.shares(clone=clone) else "written"

    def describe(self, show=str, every_file: bool = True, clone: bool = True) -> list[str]:
        """The plan as text lines, what matters first: output, base, totals, then only the rows
        that do not come from the base, runs of layers grouped (`layers.40–59 ← checkpoint-8`).
        `show` formats paths (the TUI shows them relative to the run); `clone`: whether output
        files may start as clones of the base's (False: --no-clone)."""
        shares = self.shares(clone=clone)
        rewritten = self.rewritten_files()
        lines = [
            f"output: {show(self.output)}",
            f"base:   {show(self.base.path)} (step {self.base.step}, {self.base.world_size} ranks, "
            f"{self.base.dtype}, {self.base.kind} layout)",
            *([f"reshard: {self.reshard.describe(self.base)}"] if self.reshard else []),
            f"read:   {size(self.bytes_to_read())}  write: {'~' if rewritten else ''}{size(self.bytes_to_write())}"
            + (f" (about: torch writes {rewritten} file(s) anew, their size known once written)" if rewritten else ""),
            f"        (the progress bars count bytes {self.progress_unit(clone=clone)}: {size(self.progress_bytes())} "
            "of rank and weight files; the other files are copied)",
            *([f"blocks: the output is on {shares}: {'model' if self.reshard else 'rank and model'} files start as "
               "clones of the base's, "
               "only what the recipe replaces is written (the log says how much; --no-clone writes every byte)"]
              if shares else []),
            *(f"warning: {w}" for w in self.warnings),
        ]
        rows = [r for r in self.base.rows if not r.tied]
        moved = [r.name for r in rows if self.picks[r.name]]
        if moved:
            lines.append(f"rows from other checkpoints ({len(moved)} of {len(rows)}):")
            groups = row_groups([(r.name, self.picks[r.name]) for r in rows])
            width = max(len(label) for label, s in groups if s)
            for label, s in groups:
                if s:
                    src = self.sources[s]
                    lines.append(f"  {label:<{width}}  ← {show(src.path)} (step {src.step})")
            lines.append("every other row: the base")
        else:
            lines.append(f"rows: all {len(rows)} from the base")
        states = describe_state(self.keys[1:]) if len(self.keys) > 1 else "no other state kept per element"
        lines.append(f"optimizer state per row: fp32 masters, {states}; each sub-group's step and the rest: the "
                     "base's")
        tied = [f"{r.name} tied to {tied_partner(self.base, r)}" for r in self.base.rows if r.tied]
        if tied:
            lines.append("; ".join(tied))
        if self.base.folder.weights_per_row and self.base.saved.masters_only and self.model_layout() is None:
            lines.append("model files: none (the partial base recorded no 16-bit model-file layout and no source "
                         "in the recipe is a full HF checkpoint; DeepSpeed and the HF Trainer resume without them)")
        for row in self.base.rows:
            for alias, target, partner in tied_members(self.base, row):
                lines.append(f"note: {alias} (in row {row.name}) is tied to {target}: it has no weights of its "
                             f"own and comes with row {partner}")
        lines += describe_files(self.file_fates(), len(self.output_rank_files()), every_file)
        return lines


def row_groups(rows: list[tuple[str, int]]) -> list[tuple[str, int]]:
    """Consecutive rows from the same source, in model order, as (label, source): a run of
    layers reads `layers.40–59`; other rows stand alone."""
    groups: list[tuple[str, int, int, int]] = []  # (label, source, first layer, last layer)
    for name, source in rows:
        number = name.rsplit(".", 1)[-1]
        layer = int(number) if name.startswith("layers.") and number.isascii() and number.isdigit() else None
        if groups and layer is not None:
            label, s, first, last = groups[-1]
            if s == source and first >= 0 and last == layer - 1:
                groups[-1] = (f"layers.{first}–{layer}", s, first, layer)
                continue
        groups.append((name, source, layer if layer is not None else -1, layer if layer is not None else -1))
    return [(label, s) for label, s, _first, _last in groups]
