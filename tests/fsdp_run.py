"""A real FSDP2 training run that saves PyTorch Distributed Checkpoints, as torchtitan lays them out:
`python tests/fsdp_run.py OUT SPEC_KEY WORLD`.

On WORLD gloo processes (CPU), the run's model (`RunSpec`, fp32) is sharded with `fully_shard` per block
and at the root and trained with AdamW over the HF Trainer's two param groups (decay, no decay) on the
run's own batches; every `save_every` steps `dcp.save({"model": ..., "optim": ...})` of `get_state_dict`
writes `OUT/step-N`. Before the last save, the run's `blow_up` parameters (whole names) are set to NaN
through the model's own DTensors and their `exp_avg_sq` to NaN through the optimizer's state (a layer
that blew up, as the real optimizer state holds it). The losses go to `OUT/losses.json`; `OUT/spec.json`
is written last: the run is made.
"""

from __future__ import annotations

import json
import os
import re
import sys


def _rank(rank: int, world: int, out: str, key: str, port: int) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from tailor_tui.runs.demo_run import RunSpec
    from tailor_tui.runs.models import batch_inputs, build_model, param_groups

    spec = RunSpec.from_key(key)
    model = build_model(spec).float()
    mesh = init_device_mesh("cpu", (world,))
    for name, module in model.named_modules():
        if re.search(r"(^|\.)layers\.\d+$", name):
            fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(param_groups(model), lr=1e-3)
    generator = torch.Generator().manual_seed(spec.seed)
    losses = []
    for step in range(1, spec.steps + 1):
        ids = torch.randint(0, spec.vocab, (2, 8), generator=generator)
        loss = model(**batch_inputs(spec, ids)).loss
        loss.backward()
        opt.step()
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
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(out, f"step-{step}"))
    if rank == 0:
        with open(os.path.join(out, "losses.json"), "w") as f:
            json.dump(losses, f)
    dist.barrier()
    dist.destroy_process_group()


def make_fsdp_run(out: str, key: str, world: int) -> None:
    import socket

    import torch.multiprocessing as mp

    os.makedirs(out, exist_ok=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank, args=(world, out, key, port), nprocs=world)
    with open(os.path.join(out, "spec.json"), "w") as f:
        f.write(key + "\n")


if __name__ == "__main__":
    make_fsdp_run(sys.argv[1], sys.argv[2], int(sys.argv[3]))
