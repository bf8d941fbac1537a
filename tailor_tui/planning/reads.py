"""What each rank's task of a cloned composition reads, decided once, before any task starts.

A composition whose output is a clone of the base (`cloning`: the output on the base's filesystem of
a kind that shares blocks, the recipe replacing less than half of the rank files' bytes) keeps most of
the base's bytes without writing them. It still reads every byte it keeps and checks it against its
record's CRC-32 (`compose.rank_stream`); what the run's statistics cached of the files (`checkpoints.
file_facts`, looked up by each file's identity now: a stat per file, no rank file read) spares it two
things, per rank:

- counting again the NaN/Inf of the rows a checkpoint gives this rank, where the statistics found those
  rows whole and finite in that checkpoint's files of this rank (`RankJob.vouched`): the CRC-32 checked
  on the way proves the bytes read are the bytes the statistics counted;
- reading the parts of a full source's records it does not take (`RankJob.source_blocks`): the rows it
  takes are read as the 1 MiB blocks that hold them, each checked against the CRC-32 the statistics
  recorded of it (`checked.evidence.read_blocks`).

The decision is made here, once, and carried on each rank's job (`jobs_to_run`); the writers do not
look anything up. Elsewhere (no clone, resharding, no facts cached) the jobs are the plan's, and every
byte is read, checked and counted.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from tailor_tui.checked.crc import RecordBlocks
from tailor_tui.checkpoints import file_facts
from tailor_tui.cloning import worth_it
from tailor_tui.formats.ds_format import bytes_per_element
from tailor_tui.planning.jobs import RankJob
from tailor_tui.planning.plan import ComposePlan


def jobs_to_run(plan: ComposePlan, *, clone: bool, cache: Path | None) -> tuple:
    """The plan's rank jobs as their tasks run them: where the output is a clone (`clone`: not --no-clone),
    each RankJob given what the facts in `cache` spare it (`vouched`, `source_blocks`); else the plan's."""
    jobs = plan.rank_jobs()
    full = [j for j in jobs if isinstance(j, RankJob)]
    if not clone or plan.reshard is not None or plan.shares(clone=clone) is None or len(full) != len(jobs):
        return jobs
    replaced = sum(c.length * bytes_per_element(j.keys) for j in full for c in j.copies)
    if not worth_it(replaced, sum(plan.base.rank_bytes(j.rank) for j in full)):
        return jobs
    facts = file_facts.cached(cache, paths=sorted({j.files[s].state_file for j in full for s in j.files}))
    return tuple(_given(j, facts) for j in full)


def _given(job: RankJob, facts: dict[Path, file_facts.FileFacts]) -> RankJob:
    wanted: dict[int, set[str]] = {}
    for slot in job.row_slots:
        wanted.setdefault(slot.source, set()).add(slot.row)
    for row, _name, source, _valid in job.frozen_rows:
        wanted.setdefault(source, set()).add(row)
    vouched = frozenset(s for s, rows in wanted.items()
                        if (found := facts.get(job.files[s].state_file)) is not None and rows <= found.finite)
    blocks: tuple[tuple[int, RecordBlocks], ...] = tuple(
        (s, b) for s in _full_sources(job) if (found := facts.get(job.files[s].state_file)) is not None
        for b in found.blocks.values())
    return replace(job, vouched=vouched, source_blocks=blocks) if vouched or blocks else job


def _full_sources(job: RankJob) -> list[int]:
    """The full sources the job takes slices from (the base is read whole)."""
    return sorted(s for s in {c.source for c in job.copies} - {0} if job.files[s].whole_records)
