"""Starting a run's ranks: one process per rank (torch.multiprocessing), each with DeepSpeed on
the CPU accelerator over gloo, as DeepSpeed's launcher would set it up.

The ranks are forked from a server process that imported torch, DeepSpeed and the HF Trainer once
(multiprocessing's forkserver, `rank_imports`): those imports take most of a small run's time, and
a spawned rank would make them anew. A rank is still a fresh process of its own (nothing of the
parent's state, no threads), given the caller's environment as it is when it starts. The server's
imports saw the environment it started with (variables such as ATEN_CPU_CAPABILITY are read at
import): where the caller's differs, the server is stopped and started anew under the caller's (one
set of imports, where spawning would make them for each rank of each run). Left out of that comparison (`_NOT_COMPARED`, `_OURS`): the variable pytest sets to
the test running, which no import reads, those torch and DeepSpeed set themselves when imported, as
the server's imports did, and tailor-tui's own, read where they are used.

Two settings keep a run to seconds instead of minutes of C++ op builds: a client optimizer
(no `optimizer` block in the DeepSpeed config, `demo_run`) and the shared-memory comm op
disabled before init_distributed (`setup_rank`). A rank leaves what the imports made out of Python's cycle
collector (`gc.freeze`), which the Trainer runs at every save.
"""

from __future__ import annotations

import gc
import os
import socket


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def setup_rank(rank: int, world: int, port: int) -> None:
    """This process as rank `rank` of `world`, meeting the others at `port`."""
    os.environ.update(
        DS_ACCELERATOR="cpu",
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        # DeepSpeed's own launcher sets it; without it the CPU accelerator of DeepSpeed 0.14 and
        # 0.15 counts devices by calling `numactl`, which most machines lack
        LOCAL_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        TOKENIZERS_PARALLELISM="false",
        OMP_NUM_THREADS="1",
    )
    import deepspeed
    import torch

    torch.set_num_threads(1)
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")


def quiet() -> None:
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    except ImportError:
        pass


def _run_rank(rank: int, env: dict[str, str], fn, *args) -> None:
    os.environ.clear()
    os.environ.update(env)  # the caller's, as it was when it started the ranks (a forked rank has the server's)
    # What the imports made (torch, transformers, DeepSpeed: millions of objects) is left out of the cycle
    # collector: the Trainer's every save calls gc.collect, which walked them all (0.3 s each, a third of a
    # tiny run's rank)
    gc.freeze()
    fn(rank, *args)
    # Once every rank is done, leave without the interpreter's teardown: there, C++ threads of
    # torch's distributed stack were at times destroyed still joinable ("terminate called
    # without an active exception", SIGABRT), failing a run whose work was all written. Files
    # are closed by now; an exception in `fn` never gets here and is reported by mp.spawn.
    import sys

    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn_ranks(fn, spec, *args) -> None:
    """Run `fn(rank, world, port, spec, *args)` in one process per rank of `spec` (a `demo_run.DemoSpec`)."""
    import torch.multiprocessing as mp

    os.environ["DS_ACCELERATOR"] = "cpu"
    mp.start_processes(_run_rank, args=(dict(os.environ), fn, spec.world_size, free_port(), spec, *args),
                       nprocs=spec.world_size, start_method=_start_method())


# The environment the fork server of this process started with (empty until it starts): the record of
# a server that exists, not a switch; ranks are forked from it only while the environment is the same
# (it is started anew where it is not)
_SERVER_ENV: dict[str, str] = {}
# Left out of the comparison: pytest's name of the test running (changed for each, read by no import),
# what torch and DeepSpeed set themselves when first imported, which the server's imports set too (a caller
# that imports them after the server started has them then, and nothing else changed), and tailor-tui's
# own variables (`_OURS`: each read where it is used, never at import; tests set their own per test)
_NOT_COMPARED = frozenset({"PYTEST_CURRENT_TEST", "TORCHINDUCTOR_CACHE_DIR", "PYTORCH_NVML_BASED_CUDA_CHECK"})
_OURS = "TAILOR_"


def _compared(env) -> dict[str, str]:
    return {k: v for k, v in env.items() if k not in _NOT_COMPARED and not k.startswith(_OURS)}


def _start_method() -> str:
    import multiprocessing
    from multiprocessing import forkserver

    if "forkserver" not in multiprocessing.get_all_start_methods():
        return "spawn"
    now = _compared(os.environ)
    if _SERVER_ENV and now != _SERVER_ENV:  # started under another environment: stopped, to start under this one
        stop = getattr(forkserver._forkserver, "_stop", None)  # (the standard library's own tests stop it so)
        if stop is None:
            return "spawn"
        stop()
        _SERVER_ENV.clear()
    if not _SERVER_ENV:  # started now, and its environment recorded with it
        multiprocessing.set_forkserver_preload(["tailor_tui.demo.rank_imports"])
        forkserver.ensure_running()
        _SERVER_ENV.update(now)
    return "forkserver"
