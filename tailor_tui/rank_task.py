"""One rank's task: compose its optim_states and model_states files, each by the writer
it needs. Streaming (`rank_stream`, no torch) whenever it can; `rank_torch` (imported only
then) for a partial base, a legacy-format base or model_states that take frozen fragments
or buffers from other checkpoints.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from .events import ByteCounter, Emit, TaskOptions
from .fileio import copy_file, output_error
from .plan import RankJob
from .ptfile import check_crcs, file_format
from .rank_stream import stream_optim_states


def merge_rank(job: RankJob, out_tag_dir: Path, emit: Emit, cancelled: Callable[[], bool],
               options: TaskOptions = TaskOptions()) -> None:
    """Compose rank `job.rank`'s model_states and optim_states files into `out_tag_dir`."""
    counter = ByteCounter(f"rank {job.rank}", job.total_bytes, emit, cancelled, options)
    base_files = job.files[0]
    out_optim = out_tag_dir / base_files.optim_states.name
    if base_files.rows is not None:  # a partial base has no optim file to copy: build it
        from .rank_torch import build_optim_states_from_skeleton

        build_optim_states_from_skeleton(job, out_optim, counter)
    elif not stream_optim_states(job, out_optim, counter):
        from .rank_torch import reserialise_optim_states

        reserialise_optim_states(job, out_optim, counter)

    out_model = out_tag_dir / base_files.model_states.name
    if job.frozen or job.buffers or file_format(base_files.model_states) != "zip":
        from .rank_torch import merge_model_states

        merge_model_states(job, out_model, counter)  # (a legacy-format base's is re-saved as zip)
    else:
        check_crcs(base_files.model_states)
        try:
            copy_file(base_files.model_states, out_model, counter.add, options.durable)
        except OSError as exc:
            raise output_error(exc, out_model) from None
    counter.finish()


