"""One rank's task: compose its optim_states and model_states files, each by the writer
it needs. Streaming (`rank_stream`, no torch) whenever it can, a partial base's optim file
from its skeleton (`rank_partial`, no torch); `rank_torch` (imported only then) for a
legacy-format base or model_states that take frozen fragments or buffers from other checkpoints.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from tailor_tui.checked.ranges import RegionCrcs
from tailor_tui.compose.rank_partial import build_optim_states_from_skeleton
from tailor_tui.compose.rank_stream import stream_optim_states
from tailor_tui.compose.taken import FROZEN, Looks, RankComposed, rows_taken, written
from tailor_tui.events import ByteCounter, Emit, TaskOptions
from tailor_tui.fileio import Folder, copy_file, output_error
from tailor_tui.formats.nonfinite import ITEMSIZE, Census, Region
from tailor_tui.formats.pickled import dtype_name
from tailor_tui.formats.ptfile import check_crcs, file_format, frozen_fragment_bytes
from tailor_tui.planning.jobs import SKELETON, STREAM, RankJob, optim_writer


def compose_rank(job: RankJob, out_tag_dir: Folder, emit: Emit, cancelled: Callable[[], bool],
               options: TaskOptions = TaskOptions()) -> RankComposed:
    """Compose rank `job.rank`'s model_states and optim_states files into `out_tag_dir`: the
    number of non-finite values each row's slices of this rank hold in the output (counted
    while the writers read the data anyway: for CRC checks, or in memory) and the CRC-32s of what
    each row took (`compose.taken`)."""
    counter = ByteCounter.for_job(job, emit, cancelled, options)
    base_files = job.files[0]
    out_optim = out_tag_dir / base_files.optim_states.name
    writer = optim_writer(base_files)
    if writer == SKELETON:  # a partial base has no optim file to copy: build it
        nonfinite, parts = build_optim_states_from_skeleton(job, out_optim, counter)
    elif writer == STREAM and (streamed := stream_optim_states(job, out_optim, counter)) is not None:
        nonfinite, parts = streamed
    else:
        from tailor_tui.compose.rank_torch import reserialise_optim_states

        nonfinite, parts = reserialise_optim_states(job, out_optim, counter)

    out_model = out_tag_dir / base_files.model_states.name
    if job.frozen or job.buffers or file_format(base_files.model_states) != "zip":
        from tailor_tui.compose.rank_torch import compose_model_states

        frozen_counts, frozen_parts = compose_model_states(job, out_model, counter)  # (a legacy-format base's:
        nonfinite += frozen_counts  # re-saved as zip)
        parts.update(frozen_parts)
    else:
        looks = _frozen_looks(base_files.model_states, job.frozen_rows)
        check_crcs(base_files.model_states, looks.inspect if looks else None)
        if looks is not None:
            nonfinite += looks.counts
            parts.update(looks.parts.found())
        try:
            copy_file(base_files.model_states, out_model, counter.add, options.durable)
        except OSError as exc:
            raise output_error(exc, out_model) from None
    counter.finish()
    return RankComposed(job.rank, nonfinite, rows_taken(parts), written(out_optim, out_model))


def _frozen_looks(path: Path, frozen_rows) -> Looks | None:
    """A census of the frozen parameters' fragments in a model_states file and their CRC-32s (None: none)."""
    if not frozen_rows:
        return None
    fragments = frozen_fragment_bytes(path, [name for _row, name, _source, _valid in frozen_rows])
    regions, parts = [], []
    for i, (row, name, _source, valid) in enumerate(frozen_rows):
        tb = fragments[name]
        dtype = dtype_name(tb.dtype)
        if dtype in ITEMSIZE:  # the values, not the fragment's padding
            regions.append(Region(tb.offset, min(tb.numel, valid) * tb.itemsize, row, dtype))
        parts.append((tb.offset, tb.numel * tb.itemsize, (row, FROZEN, (i, 0))))
    return Looks(Census(regions), RegionCrcs(parts))


