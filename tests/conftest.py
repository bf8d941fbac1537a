"""Real DeepSpeed ZeRO-3 runs, made once per test session (and cached between sessions).

Every checkpoint the tests read was written by real DeepSpeed on CPU; the HF runs by
the real HF Trainer. Set TAILOR_RUN_CACHE to choose the cache folder; the cache key
covers the run spec, the source of every tailor_tui module making a run can execute, and
the DeepSpeed, transformers and torch versions, so a stale cache is never used.
TAILOR_RUN_CACHE_ANY_SOURCE=1 leaves the sources out of the key: for iterating on code that
does not change what a run writes (never set in CI: the key then cannot see such a change).

Runs are made with the installed DeepSpeed, or with another release (`real_run(name,
deepspeed="0.16.9")`): that release is installed once into a folder of its own
(`pip install --target`, no C++ ops built) that is put first on the path of the
processes that train and resume, beside this environment's torch and transformers.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from faults import inject

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import runs  # noqa: E402
from runs import DEMO_RUN, RunSpec  # noqa: E402

from tailor_tui.demo import demo_run  # noqa: E402
from tailor_tui.formats.ds_format import parse_version  # noqa: E402

pytest_plugins = ["groups"]  # the tests sharing a module's fixture, grouped for `--dist loadgroup`

RUNS_SCRIPT = Path(runs.__file__)  # `python RUNS_SCRIPT make OUT SPEC`: a run made by another interpreter or release

RUNS = {
    # HF Trainer layout, 2 ranks, bf16, separate lm_head
    "hf_bf16_2": RunSpec(),
    # the demo run (`tailor-tui --make-demo`): the same, with layers.2 blown up before its step-6 save,
    # pinned (known values at every save: tailor_tui/demo/pinned.py), as are the other runs whose numbers a snapshot
    # or a sample shows: no test expects a float that training computed on this CPU
    "demo": DEMO_RUN,
    # another training of the same model (other initial weights and data order): another run
    "hf_bf16_2_seed1": RunSpec(seed=1),
    # the same model but for one thing each, which a recipe cannot mix with hf_bf16_2's (one save each)
    "hf_bf16_2_wider_mlp": RunSpec(intermediate=64, steps=2, save_every=2),  # shapes (48 by default)
    "hf_bf16_2_frozen": RunSpec(frozen=("model.layers.2.mlp.down_proj.weight",), steps=2, save_every=2),
    "hf_bf16_2_subgroups": RunSpec(sub_group_size=2000, steps=2, save_every=2),  # the optimizer's sub-groups
    # HF Trainer layout, 3 ranks (sizes that do not divide), fp32, tied embeddings, a frozen param
    "hf_fp32_3_tied": RunSpec(
        world_size=3, dtype="fp32", tied=True, frozen=("model.layers.2.mlp.down_proj.weight",)
    ),
    # DeepSpeed save_dir layout, 3 ranks, bf16, sub_group_size splits groups, a frozen param
    "ds_bf16_3_subgroups": RunSpec(
        world_size=3,
        layout="deepspeed",
        sub_group_size=2000,
        frozen=("model.layers.1.mlp.up_proj.weight",),
    ),
    # The same run at 4 ranks: sub-group boundaries move with the world size (resharding)
    "ds_bf16_4_subgroups": RunSpec(
        world_size=4,
        layout="deepspeed",
        sub_group_size=2000,
        frozen=("model.layers.1.mlp.up_proj.weight",),
    ),
    # Selective checkpointing (tailor_tui.selective.saver, parity): OUT/run holds a full save at step 2
    # and partial saves at steps 4 and 6; OUT/reference full saves of the same run at 2, 4, 6
    "ds_selective_parity": RunSpec(
        world_size=3,
        layout="deepspeed",
        sub_group_size=2000,
        frozen=("model.layers.1.mlp.up_proj.weight",),
        selective="parity",
    ),
    # The same through the HF Trainer callback (tailor_tui.selective.hf): 3 ranks, bf16 (16-bit
    # weights cast from fp32 masters), tied embeddings and a frozen parameter (both in model files)
    "hf_selective_parity": RunSpec(
        world_size=3,
        tied=True,
        frozen=("model.layers.2.mlp.down_proj.weight",),
        selective="parity",
        pinned=True,  # a snapshot shows its numbers
    ),
    # HF Trainer + the selective callback inside the Trainer's machinery: evaluation at every save
    # with load_best_model_at_end (the best at step 4, which Parity would save partially),
    # save_total_limit=2, 10 steps (saves at 2, 4, …, 10)
    "hf_selective_best_limit": RunSpec(selective="parity", best_at=4, save_total_limit=2, steps=10),
    # DeepSpeed save_dir layout, 2 ranks, fp16 (DynamicLossScaler), sub-groups, a frozen param,
    # the DeepSpeed config passed as a file path (model_states records the path, not a dict);
    # made with every DeepSpeed release in test_compat.py, beside hf_bf16_2
    "ds_fp16_2_config_file": RunSpec(
        layout="deepspeed",
        dtype="fp16",
        sub_group_size=2000,
        frozen=("model.layers.1.mlp.up_proj.weight",),
        config_file=True,
    ),
    # DeepSpeed writing torch's legacy (non-zip) format (checkpoint_serialization: false)
    "ds_legacy_serialization": RunSpec(layout="deepspeed", zip_serialization=False),
    # A model of real depth for the composer at scale: 80 layers (83 rows), two checkpoints
    "hf_80_layers": RunSpec(layers=80, hidden=8, steps=4, save_every=2, pinned=True),
    # LLMTailor's examples/Llama_cut.yaml as it is (tests/test_mergekit.py): 32 layers, untied lm_head, saves at
    # steps 1 and 2 (checkpoint-1, checkpoint-2, the names it gives); not pinned: every row moves between saves
    "hf_32_layers": RunSpec(layers=32, hidden=8, steps=2, save_every=1),
    # A run whose layers.2 blew up just before the last save, at step 6 (NaN masters, +Inf
    # exp_avg_sq, set through DeepSpeed's own ZeRO-3 API); steps 2 and 4 are healthy
    "ds_blown_up": RunSpec(layout="deepspeed", blow_up=(
        "model.layers.2.self_attn.q_proj.weight", "model.layers.2.mlp.down_proj.weight"), blow_up_step=6,
        pinned=True),
    # Optimizers other than AdamW (tests/test_optimizers.py), each with its own state per element, two saves (steps
    # 2 and 4): AdamW with amsgrad (max_exp_avg_sq besides Adam's two moments), SGD with momentum (momentum_buffer),
    # Adagrad (sum), RMSprop with momentum (square_avg, momentum_buffer), Adafactor (unfactored on ZeRO-3's flat
    # partitions: exp_avg_sq), Lion (exp_avg alone)
    "ds_amsgrad": RunSpec(layout="deepspeed", steps=4, amsgrad=True),
    "ds_sgd": RunSpec(layout="deepspeed", steps=4, optimizer="sgd"),
    "ds_adagrad": RunSpec(layout="deepspeed", steps=4, optimizer="adagrad"),
    "ds_rmsprop": RunSpec(layout="deepspeed", steps=4, optimizer="rmsprop"),
    "ds_adafactor": RunSpec(layout="deepspeed", steps=4, optimizer="adafactor"),
    "ds_lion": RunSpec(layout="deepspeed", steps=4, optimizer="lion"),
    # The selective saver on an AMSGrad run (parity): a full save at step 2, partial ones at 4 and 6 holding
    # max_exp_avg_sq beside the moments; OUT/reference full saves at 2, 4, 6
    "ds_selective_amsgrad": RunSpec(layout="deepspeed", amsgrad=True, selective="parity"),
    # Zamba2 saved selectively: its shared block (layers 1 and 3 run it) a row the saver saves whole or not at all
    "ds_zamba2_selective": RunSpec(layout="deepspeed", arch="zamba2", tied=True, selective="parity"),
    # HF layout with a persistent buffer (model.norm.tailor_scale): save_pretrained writes it
    "hf_buffer": RunSpec(buffer=True),
    # A frozen parameter (no optimizer state: its values live in model_states' fragments) of
    # layers.1 turns NaN just before the step-4 save
    # Beyond Llama, through the HF Trainer with ZeRO-3 (tests/test_architectures.py): OPT, BERT
    # (masked LM, its decoder tied to the word embeddings), T5 (3 encoder and 2 decoder blocks, its
    # head tied to `shared`), GPT-NeoX (transformers 5 saves its lm_head as embed_out), a PEFT LoRA
    # Llama (adapter_model.safetensors), safetensors shards, and transformers 4.x's pytorch_model.bin
    "hf_opt": RunSpec(arch="opt", layers=3, steps=4, save_every=2),
    "hf_bert": RunSpec(arch="bert", tied=True, layers=3, steps=4, save_every=2),
    "hf_t5": RunSpec(arch="t5", layers=3, steps=4, save_every=2),
    "hf_gpt_neox": RunSpec(arch="gpt_neox", layers=3, steps=4, save_every=2),
    # Zamba2: layers 1 and 3 run one shared attention+MLP block (tied by transformers where embeddings are)
    "hf_zamba2": RunSpec(arch="zamba2", tied=True, steps=4, save_every=2),
    # ALBERT: one layer group every layer runs
    "hf_albert": RunSpec(arch="albert", tied=True, steps=4, save_every=2),
    # a vision encoder (BEiT, 16x16 images): each block holds its layer-scale factors itself, and
    # transformers 5 saves `beit.layers.N` as `beit.encoder.layer.N` (its conversion mapping)
    "hf_beit": RunSpec(arch="beit", layers=3, steps=4, save_every=2),
    # a vision-language model (Llava: CLIP vision tower, projector, Llama), saved by transformers 5 under
    # its legacy names (`language_model.model.layers.N`), in bf16 (the model made whole inside zero.Init:
    # models.base_model)
    "hf_llava": RunSpec(arch="llava", layers=3, steps=4, save_every=2),
    # LLaVA-NeXT: Llava's stacks and its learnt image_newline (a row of its own), images tiled (anyres)
    "hf_llava_next": RunSpec(arch="llava_next", layers=3, steps=4, save_every=2),
    # a vision-language model of real depth for the grouped grid: 24 vision and 28 language blocks
    # (pinned: the losses in its headers are the same on every CPU)
    "hf_llava_deep": RunSpec(arch="llava", dtype="fp32", layers=28, vision_layers=24, hidden=16, steps=4,
                             save_every=2, pinned=True),
    # Qwen2-VL and Qwen2.5-VL (a ViT of 2 blocks and a patch merger before a Qwen2; images as their
    # processor flattens them, `image_grid_thw`, M-RoPE) and Mllama (a tiled ViT with local and gated
    # global blocks, a projector, and a Llama whose layers.1 is a cross-attention layer), in bf16: the
    # runs make a model of sub-models whole inside zero.Init (run_models.base_model)
    "hf_qwen2_vl": RunSpec(arch="qwen2_vl", layers=3, steps=4, save_every=2),
    "hf_qwen2_5_vl": RunSpec(arch="qwen2_5_vl", layers=3, steps=4, save_every=2),
    "hf_mllama": RunSpec(arch="mllama", layers=3, steps=4, save_every=2),
    # Llavas beyond plain composition (tests/test_vision_language.py): the whole vision tower frozen
    # (`frozen` names a module: every parameter in it; no optimizer state, its values in model_states),
    # one frozen vision block turning NaN just before the last save, so that its checkpoints differ;
    # a LoRA adapter on both stacks and the projector (models.lora_config); a trainable vision block
    # that blows up just before the last save (NaN masters, +Inf exp_avg_sq), for --stats and --heal
    "hf_llava_frozen_vision": RunSpec(arch="llava", dtype="fp32", layers=2, steps=4, save_every=2,
                                      frozen=("model.vision_tower",),
                                      blow_up=("model.vision_tower.encoder.layers.1.mlp.fc1.weight",),
                                      blow_up_step=4),
    "hf_llava_lora": RunSpec(arch="llava", dtype="fp32", layers=2, steps=4, save_every=2, peft=True),
    # the same beyond Llava: LLaVA-NeXT's, Qwen2-VL's, Qwen2.5-VL's and Mllama's whole vision tower frozen
    # (a frozen block turning NaN before the last save), and their LoRA on both stacks and the projector
    # (models.LORA_VISION)
    "hf_llava_next_frozen_vision": RunSpec(arch="llava_next", dtype="fp32", layers=2, steps=4, save_every=2,
                                           frozen=("model.vision_tower",),
                                           blow_up=("model.vision_tower.encoder.layers.1.mlp.fc1.weight",),
                                           blow_up_step=4),
    "hf_qwen2_vl_frozen_vision": RunSpec(arch="qwen2_vl", dtype="fp32", layers=2, steps=4, save_every=2,
                                         frozen=("model.visual",),
                                         blow_up=("model.visual.blocks.1.mlp.fc1.weight",), blow_up_step=4),
    "hf_qwen2_5_vl_frozen_vision": RunSpec(arch="qwen2_5_vl", dtype="fp32", layers=2, steps=4, save_every=2,
                                           frozen=("model.visual",),
                                           blow_up=("model.visual.blocks.1.mlp.up_proj.weight",), blow_up_step=4),
    "hf_mllama_frozen_vision": RunSpec(arch="mllama", dtype="fp32", layers=2, steps=4, save_every=2,
                                       frozen=("model.vision_model",),
                                       blow_up=("model.vision_model.transformer.layers.1.mlp.fc1.weight",),
                                       blow_up_step=4),
    "hf_llava_next_lora": RunSpec(arch="llava_next", dtype="fp32", layers=2, steps=4, save_every=2, peft=True),
    "hf_qwen2_vl_lora": RunSpec(arch="qwen2_vl", dtype="fp32", layers=2, steps=4, save_every=2, peft=True),
    "hf_qwen2_5_vl_lora": RunSpec(arch="qwen2_5_vl", dtype="fp32", layers=2, steps=4, save_every=2, peft=True),
    "hf_mllama_lora": RunSpec(arch="mllama", dtype="fp32", layers=2, steps=4, save_every=2, peft=True),
    # a Llava saved as transformers 4.x did (save_safetensors=False): pytorch_model.bin, legacy names
    "hf_llava_bin": RunSpec(arch="llava", dtype="fp32", layers=2, steps=4, save_every=2, save_safetensors=False),
    "hf_llava_vision_blown_up": RunSpec(arch="llava", dtype="fp32", layers=2, steps=4, save_every=2,
                                        blow_up=("model.vision_tower.encoder.layers.1.mlp.fc1.weight",),
                                        blow_up_step=4),
    # a Llava saved selectively (the HF callback, parity): checkpoint-2 full, partial-step4 the rows it
    # saved; its model file names are transformers 5's legacy ones (language_model.model.layers.N)
    "hf_llava_selective": RunSpec(arch="llava", dtype="fp32", layers=2, steps=4, save_every=2, selective="parity"),
    "hf_peft_lora": RunSpec(peft=True, layers=3, steps=4, save_every=2),
    "hf_sharded_safetensors": RunSpec(max_shard_size="20KB", layers=3, steps=4, save_every=2),
    "hf_bin": RunSpec(save_safetensors=False, layers=3, steps=4, save_every=2),
    "hf_peft_lora_bin": RunSpec(peft=True, save_safetensors=False, layers=3, steps=4, save_every=2),
    "hf_bin_tied": RunSpec(save_safetensors=False, tied=True, layers=3, steps=4, save_every=2),
    # Accelerate's save_state with the DeepSpeed plugin: checkpoints/checkpoint_N, each with the
    # tag folder `pytorch_model`, scheduler.bin and random_states_<rank>.pkl
    "accelerate_ds": RunSpec(layout="accelerate", layers=3, steps=4, save_every=2),
    "hf_bin_sharded": RunSpec(save_safetensors=False, max_shard_size="20KB", dtype="fp32", layers=3, steps=4,
                              save_every=2),
    "ds_frozen_blown_up": RunSpec(layout="deepspeed", steps=4, frozen=("model.layers.1.mlp.up_proj.weight",),
                                  blow_up=("model.layers.1.mlp.up_proj.weight",), blow_up_step=4),
}


INSTALLED_DEEPSPEED = importlib.metadata.version("deepspeed")
OLDEST_DEEPSPEED = "0.14.4"  # the oldest release tests make runs with (docs/formats.md: DeepSpeed releases)


def _cache_root() -> Path:
    root = os.environ.get("TAILOR_RUN_CACHE")
    return Path(root) if root else Path(__file__).resolve().parent.parent / ".tailor-cache" / "runs"


def _run_modules() -> list[Path]:
    """The source of every module a run's making can execute: the tests' runs (`runs`, its models and optimizers,
    the Accelerate runs of `accelerate_run`, beside this file) and the tailor_tui modules they import, transitively
    (the demo's training, the selective savers, the model-file layout record, run_saves, …)."""
    here, root = Path(__file__).parent, Path(demo_run.__file__).parent.parent.parent
    mine = [here / f"{name}.py" for name in ("runs", "run_models", "run_optimizers", "accelerate_run")]

    def imported(path: Path) -> list[str]:
        text = path.read_text()
        return [*re.findall(r"^\s*from (tailor_tui[\w.]*) import", text, flags=re.M),
                *(f"{package}.{name.strip()}" for package, names in
                  re.findall(r"^\s*from (tailor_tui[\w.]*) import ([\w, ]+)$", text, flags=re.M)
                  for name in names.split(","))]

    seen: set[Path] = set()
    todo = [name for path in mine for name in imported(path)]
    while todo:
        path = root / (todo.pop().replace(".", "/") + ".py")
        if path in seen or not path.is_file():
            continue
        seen.add(path)
        todo += imported(path)
    return [*mine, *sorted(seen)]


def _key(spec: RunSpec, ds_version: str) -> str:
    import torch
    import transformers

    h = hashlib.sha256()
    h.update(spec.key().encode())
    for module in [] if os.environ.get("TAILOR_RUN_CACHE_ANY_SOURCE") == "1" else _run_modules():
        h.update(module.read_bytes())
    h.update(f"{ds_version} {transformers.__version__} {torch.__version__}".encode())
    return h.hexdigest()[:16]


@contextlib.contextmanager
def _made_by_one(folder: Path):
    """Hold an exclusive lock on `folder`'s lock file: one process makes a cached run or release
    at a time; the others wait, then find it made."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.with_name(folder.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def deepspeed_env(version: str) -> Path | None:
    """The folder that holds DeepSpeed `version` (installed on first use), or None for the
    installed release. Releases ship as sdists whose setup.py imports torch: built without
    build isolation against this environment's torch, with no C++ ops (DS_BUILD_OPS=0)."""
    if version == INSTALLED_DEEPSPEED:
        return None
    import torch

    py = f"py{sys.version_info.major}.{sys.version_info.minor}"
    folder = _cache_root().parent / "deepspeed" / f"{version}-{py}-torch{torch.__version__}"
    with _made_by_one(folder):
        _install_release(version, folder)
    return folder


def _install_release(version: str, folder: Path) -> None:
    if not (folder / "deepspeed" / "__init__.py").is_file():
        partial = folder.with_name(folder.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        done = subprocess.run(
            [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-deps",
             "--no-build-isolation", "--target", str(partial), f"deepspeed=={version}"],
            env={**os.environ, "DS_BUILD_OPS": "0"}, capture_output=True, text=True)
        assert done.returncode == 0, f"installing deepspeed=={version} failed:\n{done.stderr[-3000:]}"
        shutil.rmtree(folder, ignore_errors=True)
        partial.rename(folder)


def with_deepspeed(version: str, *args: str) -> subprocess.CompletedProcess:
    """Run `python tests/runs.py ARGS` with DeepSpeed `version` (see runs.main)."""
    env = dict(os.environ)
    folder = deepspeed_env(version)
    if folder is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(folder), env.get("PYTHONPATH")]))
    if parse_version(version) < (0, 16, 0):
        # Before 0.16 DeepSpeed loads its own checkpoints with torch.load's default, which torch
        # 2.6 made weights_only=True: it then refuses its own ZeroStageEnum. Users of those
        # releases resume with torch's documented switch back to the old default, as here.
        env["TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"] = "1"
    done = subprocess.run([sys.executable, str(RUNS_SCRIPT), *args], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"deepspeed {version}: runs {args[0]} failed:\n{done.stderr[-4000:]}"
    return done


def resume_with(version: str, ckpt: Path, spec: RunSpec, resave: Path) -> list[float]:
    """runs.resume_and_step, run by DeepSpeed `version`: the losses of one more step."""
    if version == INSTALLED_DEEPSPEED:
        return runs.resume_and_step(ckpt, spec, resave)
    out = with_deepspeed(version, "resume", str(ckpt), spec.key(), str(resave)).stdout
    return json.loads(out.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def xfs(tmp_path_factory):
    """A loop-mounted XFS with reflink (1 GiB) for a module's tests of shared blocks (`cloning`); the
    test is skipped, saying why, where one cannot be mounted (root and xfsprogs are needed)."""
    from scratch_xfs import loop_xfs, unavailable

    if (why := unavailable()) is not None:
        pytest.skip(f"no loop-mounted XFS: {why}")
    folder = tmp_path_factory.mktemp("xfs")
    try:
        with loop_xfs(folder / "image", folder / "mnt", size=1 << 30) as mounted:
            yield mounted
    except RuntimeError as exc:
        pytest.skip(f"no loop-mounted XFS: {exc}")


@pytest.fixture
def slow_tasks(monkeypatch):
    """slow_tasks(seconds): from the call on, every task of the test, in its own process and in the
    workers it starts, sleeps `seconds` a progress step and then looks at the cancel flag, so that a
    cancel lands mid-way on the tests' tiny checkpoints (faults/inject.py: the rule the processes
    tests start follow too). Called once what should not be slowed (a scan's statistics) is done;
    undone at the test's end."""
    def slow(seconds: float) -> None:
        for name, value in inject.environment(slow=seconds).items():
            monkeypatch.setenv(name, value)  # spawned workers: a fresh interpreter loads faults/sitecustomize
        inject.slow_tasks(seconds, monkeypatch.setattr)  # this process, and the workers it forks

    return slow


@pytest.fixture(scope="session", autouse=True)
def statistics_cache(tmp_path_factory):
    """Row statistics (the composer's, --stats, the guard's suggestions) and the names a model's
    loading gives its saved tensors are cached in a folder of this session, never in the user's
    ~/.cache; the CLI inherits it. The session's test processes (pytest -n) share it, as a user's
    commands do theirs (its writes are atomic): a run's first read, which imports transformers to
    learn the names of a model of another layout, is made once, not once per process. A test that
    needs a cache of its own sets one."""
    base = tmp_path_factory.getbasetemp()
    folder = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "statistics-cache"
    folder.mkdir(exist_ok=True)
    os.environ["TAILOR_TUI_CACHE"] = str(folder)


def other_python() -> tuple[str, str] | None:
    """(path, version) of an installed interpreter other than this one that can run this environment's
    packages (the same major.minor: compiled packages are built per minor release), such as Debian 12's
    /usr/bin/python3 (3.11.2) beside a 3.11.7 venv; None if the machine has none."""
    mine = sys.version.split()[0]
    minor = f"{sys.version_info.major}.{sys.version_info.minor}"
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3", f"/usr/bin/python{minor}",
                      f"/usr/local/bin/python{minor}"):
        if not os.access(candidate, os.X_OK):
            continue
        said = subprocess.run([candidate, "-c", "import sys; print(sys.version.split()[0])"], capture_output=True,
                              text=True, timeout=60)
        version = said.stdout.strip()
        if said.returncode == 0 and version != mine and version.rsplit(".", 1)[0] == minor:
            return candidate, version
    return None


def python_env(python: str, version: str) -> Path:
    """The interpreter of a venv of `python` (made on first use, without pip) that sees this environment's
    packages, tailor-tui's editable install among them (a .pth file adds this venv's site-packages)."""
    import sysconfig

    folder = _cache_root().parent / "python" / f"{version}-beside-{sys.version.split()[0]}"
    with _made_by_one(folder):
        if not (folder / "made").is_file():
            shutil.rmtree(folder, ignore_errors=True)
            subprocess.run([python, "-m", "venv", "--without-pip", str(folder)], check=True, capture_output=True)
            site = subprocess.run([folder / "bin" / "python", "-c", "import sysconfig; print(sysconfig.get_paths()"
                                   "['purelib'])"], check=True, capture_output=True, text=True).stdout.strip()
            (Path(site) / "tailor_tui_tests.pth").write_text(
                f"import site; site.addsitedir({sysconfig.get_paths()['purelib']!r})\n")
            (folder / "made").write_text(version + "\n")
    return folder / "bin" / "python"


def cached_run(name: str, deepspeed: str = INSTALLED_DEEPSPEED, python: tuple[str, str] | None = None) -> Path:
    """The folder of the run RUNS[name] made with DeepSpeed `deepspeed` (the installed release by
    default) under the interpreter `python` ((path, version): `other_python`; this one by default),
    trained on first use into the cache and reused after (docs/samples.py uses it too)."""
    spec = RUNS[name]
    folder = _cache_root() / f"{name}-{_key(spec, deepspeed)}"
    if python is not None:
        folder = folder.with_name(f"{folder.name}-python{python[1]}")
    # made in place (a run records paths inside it, such as a config file's); it counts as
    # made once its last file, tailor_demo_spec.json, is written: a run killed midway is remade
    with _made_by_one(folder):  # test processes running side by side (pytest -n) make it once
        if not (folder / "tailor_demo_spec.json").is_file():
            shutil.rmtree(folder, ignore_errors=True)
            if spec.layout == "accelerate":
                from accelerate_run import make_accelerate_run

                make_accelerate_run(folder, spec)
            elif python is not None:
                assert deepspeed == INSTALLED_DEEPSPEED, "another interpreter makes runs with the installed DeepSpeed"
                done = subprocess.run([python_env(*python), str(RUNS_SCRIPT), "make", str(folder),
                                       spec.key()], capture_output=True, text=True, timeout=600)
                assert done.returncode == 0, f"python {python[1]}: runs make failed:\n{done.stderr[-4000:]}"
            elif name == "demo" and deepspeed == INSTALLED_DEEPSPEED:  # as `tailor-tui --make-demo` makes it
                demo_run.make_run(folder, demo_run.DEMO)
            elif deepspeed == INSTALLED_DEEPSPEED:
                runs.make_run(folder, spec)
            else:
                with_deepspeed(deepspeed, "make", str(folder), spec.key())
    return folder


# Real FSDP2 runs (tests/fsdp_run.py): the spec of the model and training, the world size (and the layout:
# "hf", the HF Trainer's checkpoint-N folders, written by Accelerate's save functions)
FSDP_RUNS: dict[str, tuple] = {
    # the tiny Llama, 2 ranks, DCP saves at steps 2, 4, 6; layers.1's down_proj NaN (and its exp_avg_sq)
    # before the last save
    "fsdp_llama": (RunSpec(layers=3, steps=6, save_every=2, blow_up=("model.layers.1.mlp.down_proj.weight",)), 2),
    # the same model trained on 3 ranks (another seed): its saves chunk every tensor in three
    "fsdp_llama_3": (RunSpec(layers=3, steps=4, save_every=2, seed=1), 3),
    # the ZeRO-3 runs' model (4 layers: hf_bf16_2's, ds_blown_up's), 2 ranks, DCP saves at steps 2 and 4: rows for
    # ZeRO-3 compositions (tests/test_mixed_formats.py)
    "fsdp_llama_4": (RunSpec(steps=4, save_every=2, seed=3), 2),
    # the ZeRO-3 runs' model, 2 ranks, the HF Trainer's FSDP checkpoints at steps 2, 4; layers.1 blown up before the last
    "fsdp_llama_hf": (RunSpec(steps=4, save_every=2, seed=2, blow_up=("model.layers.1.mlp.down_proj.weight",)), 2,
                      "hf"),
}


@pytest.fixture(scope="session")
def fsdp_run():
    """fsdp_run(name) -> (run folder, spec): FSDP_RUNS[name] trained on first use, cached as the others are."""
    import torch

    def get(name: str) -> tuple[Path, RunSpec]:
        spec, world, *layout = FSDP_RUNS[name]
        maker = Path(__file__).with_name("fsdp_run.py")
        h = hashlib.sha256(f"{spec.key()} {world} {layout} {torch.__version__}".encode() + maker.read_bytes())
        for module in [] if os.environ.get("TAILOR_RUN_CACHE_ANY_SOURCE") == "1" else _run_modules():
            h.update(module.read_bytes())
        folder = _cache_root() / f"{name}-{h.hexdigest()[:16]}"
        with _made_by_one(folder):
            if not (folder / "spec.json").is_file():
                from fsdp_run import make_fsdp_run

                shutil.rmtree(folder, ignore_errors=True)
                make_fsdp_run(str(folder), spec.key(), world, *layout)
        return folder, spec

    return get


@pytest.fixture(scope="session")
def real_run():
    """real_run(name, deepspeed=VERSION, python=(PATH, VERSION)) -> (run folder, spec); trains the run on
    first use, with the installed DeepSpeed or the given release, under this interpreter or the given one."""
    made: dict[tuple, Path] = {}

    def get(name: str, deepspeed: str = INSTALLED_DEEPSPEED,
            python: tuple[str, str] | None = None) -> tuple[Path, RunSpec]:
        if (name, deepspeed, python) not in made:
            made[name, deepspeed, python] = cached_run(name, deepspeed, python)
        return made[name, deepspeed, python], RUNS[name]

    return get


def checkpoints_of(run: Path, spec: RunSpec) -> list[Path]:
    """The run's checkpoint folders as a recipe names them, oldest first."""
    steps = range(spec.save_every, spec.steps + 1, spec.save_every)
    if spec.layout == "accelerate":  # save_state's automatic naming counts the saves
        return [run / "checkpoints" / f"checkpoint_{i}" for i in range(len(steps))]
    if spec.layout == "hf":
        return [run / f"checkpoint-{s}" for s in steps]
    return [run / f"global_step{s}" for s in steps]


def tree_digest(*roots: Path) -> dict[str, str]:
    """sha256 of every file under `roots`: proof that sources were not modified."""
    out = {}
    for root in roots:
        for f in sorted(Path(root).rglob("*")):
            if f.is_file():
                out[str(f)] = hashlib.sha256(f.read_bytes()).hexdigest()
    return out


def pytest_addoption(parser):
    parser.addoption(
        "--deepspeed-releases", default="ci",
        help="DeepSpeed releases test_compat.py makes runs with: 'ci' (the oldest and the newest), "
             "'all', or a comma-separated list such as 0.16.9,0.17.4")


def pytest_collection_finish(session):
    """What collecting imported (torch, transformers, Textual, DeepSpeed: millions of objects) is left out of the
    cycle collector, whose full collections walked it all, in every test after."""
    import gc

    gc.freeze()
