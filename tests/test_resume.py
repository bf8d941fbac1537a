"""Composed checkpoints resume with real DeepSpeed (and the real HF Trainer for HF layouts).

The state DeepSpeed loads from the output, saved again, equals the output bit for bit,
and one more training step gives a finite loss.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
from conftest import checkpoints_of
from helpers import assert_optim_states_equal, compose, parity_picks
from runs import resume_and_step
from zero_reader import model_states


@pytest.mark.parametrize("name", ["hf_bf16_2", "hf_fp32_3_tied", "ds_bf16_3_subgroups"])
def test_resume_from_composed_checkpoint(real_run, tmp_path, name):
    run, spec = real_run(name)
    ckpts = checkpoints_of(run, spec)
    out, _ = compose(tmp_path, ckpts, parity_picks(spec, ckpts))

    losses = resume_and_step(out, spec, tmp_path / "resume")
    assert losses and all(math.isfinite(x) for x in losses)

    resaved = tmp_path / "resume" / "resaved"
    assert_optim_states_equal(out, resaved)
    for mine, theirs in zip(model_states(out), model_states(resaved), strict=True):
        assert mine["global_steps"] == theirs["global_steps"] == spec.steps
        assert mine["frozen_param_fragments"].keys() == theirs["frozen_param_fragments"].keys()
        for k, v in mine["frozen_param_fragments"].items():
            assert torch.equal(v, theirs["frozen_param_fragments"][k])


def test_ranks_are_forked_from_an_import_server_started_in_the_environment_they_are_started_in():
    """Ranks are forked from a server that imported torch and DeepSpeed once (`runs.ranks`), under the
    environment the ranks are started in: a variable read at import (such as ATEN_CPU_CAPABILITY) set or
    removed since the server started stops it, and the next one starts under the environment as it is;
    pytest's per-test variable, tailor-tui's own and what the imports set themselves change nothing. (In a
    process of its own: this one's server started under whatever environment an earlier test left.)"""
    import subprocess
    import sys

    script = (
        "import os, time\n"
        "from multiprocessing import forkserver\n"
        "from tailor_tui.demo import ranks\n"
        "import multiprocessing\n"  # (the servers import nothing: when one is started anew is what is looked at)
        "multiprocessing.set_forkserver_preload = lambda modules: None\n"
        "def server():\n"
        "    assert ranks._start_method() == 'forkserver'\n"
        "    pid = forkserver._forkserver._forkserver_pid\n"
        "    while b'forkserver import main' not in open(f'/proc/{pid}/cmdline', 'rb').read():\n"
        "        time.sleep(0.01)\n"  # (until then, /proc shows the environment its parent started with)
        "    with open(f'/proc/{pid}/environ', 'rb') as f:\n"
        "        aten = b'ATEN_CPU_CAPABILITY=default' in f.read().split(b'\\0')\n"
        "    return f'{pid}:{aten}'\n"
        "os.environ['DS_ACCELERATOR'] = 'cpu'\n"  # as spawn_ranks sets it before it starts any rank
        "said = [server()]\n"
        "os.environ['PYTEST_CURRENT_TEST'] = 'another test'\n"  # pytest's, changed for each test: left out
        "said.append(server())\n"
        "os.environ['TAILOR_TUI_CACHE'] = '/elsewhere'\n"  # tailor-tui's own, read where used: left out
        "said.append(server())\n"
        "from transformers import Trainer\n"  # sets TORCHINDUCTOR_CACHE_DIR, as the server's imports did
        "said.append(server())\n"
        "os.environ['ATEN_CPU_CAPABILITY'] = 'default'\n"
        "said.append(server())\n"
        "said.append(server())\n"
        "del os.environ['ATEN_CPU_CAPABILITY']\n"
        "said.append(server())\n"
        "print(' '.join(said))\n")
    env = {k: v for k, v in os.environ.items() if k not in ("ATEN_CPU_CAPABILITY", "PYTEST_CURRENT_TEST",
                                                          "TORCHINDUCTOR_CACHE_DIR")}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    pids, aten = zip(*(x.split(":") for x in done.stdout.split()))
    assert aten == ("False", "False", "False", "False", "True", "True", "False")
    assert pids[0] == pids[1] == pids[2] == pids[3] != pids[4] == pids[5] != pids[6] and pids[6] != pids[0]
