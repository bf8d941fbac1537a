"""A real FSDP2 consumer of a DCP checkpoint: `python tests/fsdp_loop.py CKPT SPEC_FILE WORLD OUT.pt`.

On WORLD gloo processes (CPU), the run's model (`RunSpec`, fp32) is sharded with `fully_shard` per
block and at the root, the run's optimizer (`make_optimizer`) is made with the param groups the checkpoint lists (by name, read with
`_load_state_dict_from_keys`), and `dcp.load` + `set_state_dict` load model and optimizer (an HF Trainer's FSDP
checkpoint, `pytorch_model_fsdp_0/` and `optimizer_0/`: Accelerate's `load_fsdp_model` and `load_fsdp_optimizer`,
as the Trainer's resume_from_checkpoint calls them). Rank 0 then
saves (`OUT.pt`) the full state as loaded, every rank saves it again with `dcp.save` (`OUT.pt.dcp`:
what FSDP2 itself writes of this model and optimizer) (`get_state_dict` with full_state_dict): weights, each
parameter's optimizer state and the param groups; then every rank trains one step and rank 0 records its
loss and whether every weight stayed finite.
"""

from __future__ import annotations

import os
import sys


def load_rank(rank: int, world: int, port: int, spec, ckpt: str, out: str) -> None:
    """Rank `rank` of `world` (`tailor_tui.demo.ranks.spawn_ranks`' signature: forked from the test process's
    server of imports, as the runs' ranks are) loading `ckpt` into the model and optimizer of `spec` (a RunSpec)."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from fsdp_run import sharded_model
    from run_models import batch_inputs
    from run_optimizers import make_optimizer
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    model = sharded_model(rank, world, port, spec)
    trainer = os.path.isdir(os.path.join(ckpt, "pytorch_model_fsdp_0"))
    folder, top = (os.path.join(ckpt, "optimizer_0"), "optimizer") if trainer else (ckpt, "optim")
    reader = dcp.FileSystemReader(folder)
    keys = sorted(k for k in reader.read_metadata().state_dict_metadata if k.startswith(f"{top}.param_groups."))
    saved = _load_state_dict_from_keys(keys=set(keys), checkpoint_id=folder)[top]["param_groups"]
    params = dict(model.named_parameters())
    groups = [{"params": [params[name] for name in g["params"]]} for g in saved]
    opt = make_optimizer(spec.optimizer, groups, amsgrad=spec.amsgrad)
    if trainer:
        from accelerate import Accelerator
        from accelerate.utils import FullyShardedDataParallelPlugin
        from accelerate.utils.fsdp_utils import load_fsdp_model, load_fsdp_optimizer

        accelerator = Accelerator(cpu=True)
        plugin = FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type="SHARDED_STATE_DICT")
        load_fsdp_model(plugin, accelerator, model, ckpt)
        load_fsdp_optimizer(plugin, accelerator, opt, model, ckpt)
        msd, osd = get_state_dict(model, opt)
    else:
        msd, osd = get_state_dict(model, opt)
        # a PEFT run's export holds its adapters, not the pretrained base weights the model was built with
        partial = dcp.DefaultLoadPlanner(allow_partial_load=True) if spec.peft else None
        dcp.load({"model": msd, "optim": osd}, checkpoint_id=ckpt, planner=partial)
        set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=out + ".dcp")  # what FSDP2 itself saves of it
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    msd, osd = get_state_dict(model, opt, options=full)
    if rank == 0:
        torch.save({"model": msd, "optim": osd}, out)
    torch.manual_seed(0)
    ids = torch.randint(0, spec.vocab, (2, 8))
    loss = model(**batch_inputs(spec, ids)).loss
    loss.backward()
    opt.step()
    msd, _ = get_state_dict(model, opt, options=full)
    if rank == 0:
        finite = all(bool(torch.isfinite(t).all()) for t in msd.values() if t.is_floating_point())
        loss = loss.detach()
        torch.save({"loss": float(loss), "finite": finite}, out + ".step")
    dist.barrier()  # no rank leaves while another is still in a collective
    dist.destroy_process_group()
    # Leave without the interpreter's teardown, where C++ threads of torch's distributed stack were at times
    # destroyed still joinable ("terminate called without an active exception", SIGABRT) once the work was all
    # written: as the demo's ranks leave (`tailor_tui.demo.ranks`)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def load_in_fsdp2(ckpt: str | os.PathLike, spec_file: str | os.PathLike, world: int, out: str | os.PathLike) -> None:
    """`ckpt` loaded on `world` gloo processes into the model and optimizer of the run whose spec `spec_file`
    holds; what each saw written to `out` and beside it (see above)."""
    import dataclasses

    from runs import RunSpec

    from tailor_tui.demo.ranks import spawn_ranks

    with open(spec_file) as f:
        spec = RunSpec.from_key(f.read())
    spawn_ranks(load_rank, dataclasses.replace(spec, world_size=world), str(ckpt), str(out))


if __name__ == "__main__":
    import fsdp_loop  # this file as the module `fsdp_loop`: where the ranks find the function they run

    fsdp_loop.load_in_fsdp2(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4])
