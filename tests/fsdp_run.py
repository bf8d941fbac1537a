"""A real FSDP2 training run that saves PyTorch Distributed Checkpoints, as torchtitan lays them out:
`python tests/fsdp_run.py OUT SPEC_KEY WORLD [LAYOUT]` (LAYOUT "hf": as the HF Trainer lays them out).

On WORLD gloo processes (CPU), the run's model (`RunSpec`, fp32) is sharded with `fully_shard` per block
and at the root and trained with AdamW over the HF Trainer's two param groups (decay, no decay) on the
run's own batches; every `save_every` steps `dcp.save({"model": ..., "optim": ...})` of `get_state_dict`
writes `OUT/step-N`. Before the last save, the run's `blow_up` parameters (whole names) are set to NaN
through the model's own DTensors and their `exp_avg_sq` to NaN through the optimizer's state (a layer
that blew up, as the real optimizer state holds it). The losses go to `OUT/losses.json`; `OUT/spec.json`
is written last: the run is made.

The HF Trainer's layout (LAYOUT "hf") writes `OUT/checkpoint-N` as the Trainer's `_save_checkpoint` does under
FSDP2 with SHARDED_STATE_DICT: Accelerate's own `save_fsdp_model` and `save_fsdp_optimizer` (the Trainer's
calls; a real `Accelerator` and `FullyShardedDataParallelPlugin(fsdp_version=2)`) write `pytorch_model_fsdp_0/`
and `optimizer_0/`, beside `scheduler.pt`, `rng_state_R.pth` and `trainer_state.json` as the Trainer writes them.
The Trainer itself does not run FSDP on CPU (Accelerate keeps a CPU run at MULTI_CPU, which wraps in DDP).
"""

from __future__ import annotations

import json
import os
import re
import sys


def sharded_model(rank: int, world: int, port: int, spec):
    """This process as rank `rank` of a gloo group of `world` meeting at `port`, and the fp32 model of `spec` (a
    RunSpec) sharded over a CPU mesh of them as FSDP2 runs shard one: each block, then the whole."""
    import torch.distributed as dist
    from run_models import build_model
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    model = build_model(spec).float()
    mesh = init_device_mesh("cpu", (world,))
    for block in [m for name, m in model.named_modules() if re.search(r"(^|\.)layers\.\d+$", name)]:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _rank(rank: int, world: int, port: int, spec, out: str, layout: str) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from run_models import batch_inputs, param_groups
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model = sharded_model(rank, world, port, spec)
    opt = torch.optim.AdamW(param_groups(model), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
    generator = torch.Generator().manual_seed(spec.seed)
    losses = []
    for step in range(1, spec.steps + 1):
        ids = torch.randint(0, spec.vocab, (2, 8), generator=generator)
        loss = model(**batch_inputs(spec, ids)).loss
        loss.backward()
        opt.step()
        scheduler.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
        if step % spec.save_every:
            continue
        if step == spec.steps and spec.blow_up:
            params = dict(model.named_parameters())
            with torch.no_grad():
                for name in spec.blow_up:
                    params[name].to_local().fill_(float("nan"))
                    opt.state[params[name]]["exp_avg_sq"].to_local().fill_(float("nan"))
        if layout == "hf":
            _save_as_trainer(os.path.join(out, f"checkpoint-{step}"), model, opt, scheduler, rank, step, losses)
            continue
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(out, f"step-{step}"))
    if rank == 0:
        with open(os.path.join(out, "losses.json"), "w") as f:
            json.dump(losses, f)
    dist.barrier()
    dist.destroy_process_group()
    # Leave without the interpreter's teardown, where C++ threads of torch's distributed stack were at times
    # destroyed still joinable ("terminate called without an active exception", SIGABRT) once the work was all
    # written: as the demo's ranks leave (`tailor_tui.demo.ranks`)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _save_as_trainer(folder: str, model, opt, scheduler, rank: int, step: int, losses: list[float]) -> None:
    """What the HF Trainer's `_save_checkpoint` writes under FSDP2 (SHARDED_STATE_DICT), by the functions it calls."""
    import random

    import numpy as np
    import torch
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import save_fsdp_model, save_fsdp_optimizer

    accelerator = Accelerator(cpu=True)
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type="SHARDED_STATE_DICT")
    save_fsdp_model(plugin, accelerator, model, folder)
    save_fsdp_optimizer(plugin, accelerator, opt, model, folder)
    torch.save({"python": random.getstate(), "numpy": np.random.get_state(), "cpu": torch.random.get_rng_state()},
               os.path.join(folder, f"rng_state_{rank}.pth"))
    if rank == 0:
        torch.save(scheduler.state_dict(), os.path.join(folder, "scheduler.pt"))
        state = {"global_step": step, "max_steps": None, "log_history": [
            {"step": i + 1, "loss": loss} for i, loss in enumerate(losses)]}
        with open(os.path.join(folder, "trainer_state.json"), "w") as f:
            json.dump(state, f, indent=2)


def make_fsdp_run(out: str, key: str, world: int, layout: str = "torchtitan") -> None:
    """The run of the spec whose key is `key` trained on `world` ranks into `out` (`_rank`). The ranks are forked
    from the import server the ZeRO-3 runs' ranks are (`tailor_tui.demo.ranks.spawn_ranks`): spawned, each imported
    torch and transformers anew."""
    import dataclasses

    from runs import RunSpec

    from tailor_tui.demo.ranks import spawn_ranks

    os.makedirs(out, exist_ok=True)
    spawn_ranks(_rank, dataclasses.replace(RunSpec.from_key(key), world_size=world), out, layout)
    with open(os.path.join(out, "spec.json"), "w") as f:
        f.write(key + "\n")


if __name__ == "__main__":
    import fsdp_run  # this file as the module `fsdp_run`: where the ranks find the function they run

    fsdp_run.make_fsdp_run(sys.argv[1], sys.argv[2], int(sys.argv[3]), *sys.argv[4:5])
