"""One rank's task: compose its optim_states and model_states files, each by the writer
it needs. Streaming (`rank_stream`, no torch) whenever it can, a partial base's optim file
from its skeleton (`rank_partial`, no torch); `rank_torch` (imported only then) for a
legacy-format base or model_states that take frozen fragments or buffers from other checkpoints.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Callable

from tailor_tui.compose.rank_partial import build_optim_states_from_skeleton
from tailor_tui.compose.rank_stream import stream_optim_states
from tailor_tui.events import ByteCounter, Emit, TaskOptions
from tailor_tui.fileio import Folder, copy_file, output_error
from tailor_tui.formats.nonfinite import ITEMSIZE, Census, Region
from tailor_tui.formats.pickled import dtype_name
from tailor_tui.formats.ptfile import check_crcs, file_format, frozen_fragment_bytes
from tailor_tui.planning.jobs import RankJob


def compose_rank(job: RankJob, out_tag_dir: Folder, emit: Emit, cancelled: Callable[[], bool],
               options: TaskOptions = TaskOptions()) -> Counter:
    """Compose rank `job.rank`'s model_states and optim_states files into `out_tag_dir`; the
    number of non-finite values each row's slices of this rank hold in the output (counted
    while the writers read the data anyway: for CRC checks, or in memory)."""
    counter = ByteCounter.for_job(job, emit, cancelled, options)
    base_files = job.files[0]
    out_optim = out_tag_dir / base_files.optim_states.name
    if base_files.rows is not None:  # a partial base has no optim file to copy: build it
        nonfinite = build_optim_states_from_skeleton(job, out_optim, counter)
    elif (streamed := stream_optim_states(job, out_optim, counter)) is not None:
        nonfinite = streamed
    else:
        from tailor_tui.compose.rank_torch import reserialise_optim_states

        nonfinite = reserialise_optim_states(job, out_optim, counter)

    out_model = out_tag_dir / base_files.model_states.name
    if job.frozen or job.buffers or file_format(base_files.model_states) != "zip":
        from tailor_tui.compose.rank_torch import compose_model_states

        nonfinite += compose_model_states(job, out_model, counter)  # (a legacy-format base's is re-saved as zip)
    else:
        census = _frozen_census(base_files.model_states, job.frozen_rows)
        check_crcs(base_files.model_states, census.inspect if census else None)
        if census is not None:
            nonfinite += census.counts
        try:
            copy_file(base_files.model_states, out_model, counter.add, options.durable)
        except OSError as exc:
            raise output_error(exc, out_model) from None
    counter.finish()
    return nonfinite


def _frozen_census(path: Path, frozen_rows) -> Census | None:
    """A census of the frozen parameters' fragments in a model_states file (None: none)."""
    if not frozen_rows:
        return None
    fragments = frozen_fragment_bytes(path, [name for _row, name, _source in frozen_rows])
    regions = []
    for row, name, _source in frozen_rows:
        tb = fragments[name]
        dtype = dtype_name(tb.dtype)
        if dtype in ITEMSIZE:
            regions.append(Region(tb.offset, tb.numel * tb.itemsize, row, dtype))
    return Census(regions)


