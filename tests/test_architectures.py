"""Every file of the output composed per row or copied from the base, for models beyond Llama.

Real runs under the HF Trainer with ZeRO-3 (tiny configs, random weights): OPT, BERT (masked LM),
T5 (encoder-decoder), GPT-NeoX, BEiT (a vision encoder whose blocks hold their layer-scale factors
themselves, saved under transformers 5's conversion-mapping names), the vision-language models Llava,
Qwen2-VL, Qwen2.5-VL and Mllama (rows of the vision stack and of the language model picked from two
checkpoints each; Mllama's vision encoder holds two block lists, its language model a cross-attention
layer among its layers), a PEFT LoRA Llama (its adapter in safetensors and with torch.save),
sharded safetensors, and transformers 4.x's pytorch_model.bin (one file, sharded, tied). For each:
the rows the model's own structure gives; a per-layer recipe taking rows from two checkpoints,
applied through the real CLI; every parameter and Adam moment (DeepSpeed's zero_to_fp32 reader)
and every tensor of every weight file (safetensors, torch.load) equal the checkpoint picked for
its row, the rows told by this test's own table; the output resumed by the real Trainer; and
`--verify` fails, naming the file and the row, when one weight file is the base's instead. What
cannot be composed is refused by name before anything is written.
"""

from __future__ import annotations

import math
import re
import shutil

import pytest
import torch
from conftest import checkpoints_of
from helpers import (
    ComposedCase,
    assert_one_line_error,
    assert_optim_states_equal,
    tailor,
    tensors,
    weight_files,
    write_recipe,
)
from runs import resume_and_step
from safetensors import safe_open
from zero_reader import read_full_state

from tailor_tui.checkpoints.checkpoint import open_checkpoint

QWEN2_VL_ROWS = [(r"(?:model\.)?visual\.blocks\.(\d+)\.", r"vision.blocks.\1"),
                 (r"(?:model\.)?visual\.(\w+)\.", r"vision.\1"),
                 (r"model\.(?:language_model\.)?layers\.(\d+)\.", r"layers.\1"),
                 (r"model\.(?:language_model\.)?(\w+)\.", r"\1"), (r"lm_head\.", "lm_head")]

# Llava's (and LLaVA-NeXT's): its vision tower, projector and language model under their names in the
# model (`model.vision_tower.…`) and as transformers 5 saves them (`vision_tower.…`, `language_model.model.…`)
LLAVA_ROWS = [(r"(?:model\.)?vision_tower\.encoder\.layers\.(\d+)\.", r"vision.layers.\1"),
              (r"(?:model\.)?vision_tower\.(\w+)\.", r"vision.\1"),
              (r"(?:model\.)?multi_modal_projector\.", "multi_modal_projector"),
              (r"(?:model\.language_model|language_model\.model)\.layers\.(\d+)\.", r"layers.\1"),
              (r"(?:model\.language_model|language_model\.model)\.(\w+)\.", r"\1"),
              (r"(?:language_model\.)?lm_head\.", "lm_head")]

# Each architecture's rows, and the row of a parameter or weight-file tensor by this test's own
# rules (regular expressions over the names transformers gives; independent of tailor_tui.checkpoints.rows)
ARCHS = {
    "hf_opt": (
        ["embed_tokens", "embed_positions", "final_layer_norm", "layers.0", "layers.1", "layers.2", "lm_head"],
        [(r"model\.decoder\.layers\.(\d+)\.", r"layers.\1"), (r"model\.decoder\.(\w+)\.", r"\1"),
         (r"lm_head\.", "lm_head")],
    ),
    "hf_bert": (
        ["embeddings", "layer.0", "layer.1", "layer.2", "cls"],
        [(r"bert\.encoder\.layer\.(\d+)\.", r"layer.\1"), (r"bert\.embeddings\.", "embeddings"),
         (r"cls\.predictions\.decoder\.weight", "embeddings"), (r"cls\.", "cls")],
    ),
    "hf_t5": (
        ["shared", "encoder.embed_tokens", "encoder.block.0", "encoder.block.1", "encoder.block.2",
         "encoder.final_layer_norm", "decoder.embed_tokens", "decoder.block.0", "decoder.block.1",
         "decoder.final_layer_norm", "lm_head"],  # T5 ties its head to `shared` whatever the config says
        [(r"(encoder|decoder)\.block\.(\d+)\.", r"\1.block.\2"),
         (r"(encoder|decoder)\.final_layer_norm\.", r"\1.final_layer_norm"),
         (r"(encoder\.|decoder\.)?embed_tokens\.|shared\.|lm_head\.", "shared")],
    ),
    "hf_gpt_neox": (
        ["embed_in", "layers.0", "layers.1", "layers.2", "final_layer_norm", "lm_head"],
        [(r"gpt_neox\.layers\.(\d+)\.", r"layers.\1"), (r"gpt_neox\.(\w+)\.", r"\1"),
         (r"(lm_head|embed_out)\.", "lm_head")],  # transformers 5 saves lm_head as embed_out
    ),
    # parameters `beit.layers.N.…` (each block's own lambda_1, lambda_2 among them), saved as
    # `beit.encoder.layer.N.…` with attention.query as attention.attention.query, and so on
    "hf_beit": (
        ["embeddings", "layers.0", "layers.1", "layers.2", "pooler", "classifier"],
        [(r"beit\.(?:layers|encoder\.layer)\.(\d+)\.", r"layers.\1"), (r"beit\.(embeddings|pooler)\.", r"\1"),
         (r"classifier\.", "classifier")],
    ),
    # parameters `model.vision_tower.…`, `model.multi_modal_projector.…`, `model.language_model.…`,
    # `lm_head`; saved as `vision_tower.…`, `multi_modal_projector.…`, `language_model.model.…` and
    # `language_model.lm_head` (transformers 5 reverses its conversion mapping)
    "hf_llava": (
        ["vision.embeddings", "vision.pre_layrnorm", "vision.layers.0", "vision.layers.1", "vision.post_layernorm",
         "multi_modal_projector", "embed_tokens", "layers.0", "layers.1", "layers.2", "norm", "lm_head"],
        LLAVA_ROWS,
    ),
    # parameters `model.visual.…` and `model.language_model.…`, `lm_head`; saved as `visual.…` and
    # `model.layers.N.…`, `model.embed_tokens`, `model.norm` (transformers 5's conversion mapping)
    "hf_qwen2_vl": (
        ["vision.patch_embed", "vision.blocks.0", "vision.blocks.1", "vision.merger", "embed_tokens", "layers.0",
         "layers.1", "layers.2", "norm", "lm_head"],
        QWEN2_VL_ROWS,
    ),
    "hf_qwen2_5_vl": (
        ["vision.patch_embed", "vision.blocks.0", "vision.blocks.1", "vision.merger", "embed_tokens", "layers.0",
         "layers.1", "layers.2", "norm", "lm_head"],
        QWEN2_VL_ROWS,
    ),
    # parameters `model.vision_model.…` (two block lists, `transformer.layers` and `global_transformer.layers`,
    # and tensors of its own: `class_embedding`), `model.language_model.…` (layers.1 a cross-attention layer),
    # `model.multi_modal_projector`, `lm_head`; saved as `vision_model.…`, `language_model.model.…`,
    # `multi_modal_projector.…` and `language_model.lm_head`
    "hf_mllama": (
        ["vision.class_embedding", "vision.patch_embedding", "vision.gated_positional_embedding",
         "vision.pre_tile_positional_embedding", "vision.post_tile_positional_embedding", "vision.layernorm_pre",
         "vision.layernorm_post", "vision.transformer.layers.0", "vision.transformer.layers.1",
         "vision.global_transformer.layers.0", "vision.global_transformer.layers.1", "embed_tokens", "layers.0",
         "layers.1", "layers.2", "norm", "multi_modal_projector", "lm_head"],
        [(r"(?:model\.)?vision_model\.((?:global_)?transformer)\.layers\.(\d+)\.", r"vision.\1.layers.\2"),
         (r"(?:model\.)?vision_model\.(\w+)(?:\.|$)", r"vision.\1"),
         *LLAVA_ROWS[2:]],  # the projector and the language model as Llava's
    ),
    # LLaVA-NeXT: Llava's layout and its learnt image_newline (`model.image_newline`, saved as `image_newline`)
    "hf_llava_next": (
        ["image_newline", "vision.embeddings", "vision.pre_layrnorm", "vision.layers.0", "vision.layers.1",
         "vision.post_layernorm", "multi_modal_projector", "embed_tokens", "layers.0", "layers.1", "layers.2",
         "norm", "lm_head"],
        [(r"(?:model\.)?image_newline$", "image_newline"), *LLAVA_ROWS],
    ),
    # the Trainer saves a PEFT model's trainable parameters only: LoRA's and modules_to_save's
    "hf_peft_lora": (
        ["layers.0", "layers.1", "layers.2", "lm_head"],
        [(r"base_model\.model\.model\.layers\.(\d+)\.", r"layers.\1"), (r"base_model\.model\.lm_head\.", "lm_head")],
    ),
    # transformers 4.x's pytorch_model.bin (save_safetensors=False), one file and sharded
    "hf_bin": (
        ["embed_tokens", "layers.0", "layers.1", "layers.2", "norm", "lm_head"],
        [(r"model\.layers\.(\d+)\.", r"layers.\1"), (r"model\.(\w+)\.", r"\1"), (r"lm_head\.", "lm_head")],
    ),
    "hf_bin_sharded": (
        ["embed_tokens", "layers.0", "layers.1", "layers.2", "norm", "lm_head"],
        [(r"model\.layers\.(\d+)\.", r"layers.\1"), (r"model\.(\w+)\.", r"\1"), (r"lm_head\.", "lm_head")],
    ),
    "hf_sharded_safetensors": (
        ["embed_tokens", "layers.0", "layers.1", "layers.2", "norm", "lm_head"],
        [(r"model\.layers\.(\d+)\.", r"layers.\1"), (r"model\.(\w+)\.", r"\1"), (r"lm_head\.", "lm_head")],
    ),
    # a hybrid whose layers 1 and 3 run one attention+MLP block (`shared_transformer`, with an adapter per layer
    # running it): the block is a row of its own, named for where it is first held; layer 3's names of it are
    # aliases, saved under them too
    "hf_zamba2": (
        ["embed_tokens", "layers.0", "layers.1", "layers.1.shared_transformer", "layers.2", "layers.3",
         "final_layernorm", "lm_head"],
        [(r"model\.layers\.\d+\.shared_transformer\.", "layers.1.shared_transformer"),
         (r"model\.layers\.(\d+)\.", r"layers.\1"), (r"model\.(\w+)\.", r"\1"), (r"lm_head\.", "embed_tokens")],
    ),
    # ALBERT: one layer group that every layer runs, a row as any block is
    "hf_albert": (
        ["embeddings", "embedding_hidden_mapping_in", "albert_layer_groups.0", "predictions"],
        [(r"albert\.encoder\.albert_layer_groups\.(\d+)\.", r"albert_layer_groups.\1"),
         (r"albert\.encoder\.embedding_hidden_mapping_in\.", "embedding_hidden_mapping_in"),
         (r"albert\.embeddings\.", "embeddings"), (r"predictions\.decoder\.weight", "embeddings"),
         (r"predictions\.", "predictions")],
    ),
}
TIED = {"hf_t5": {"encoder.embed_tokens", "decoder.embed_tokens", "lm_head"}, "hf_zamba2": {"lm_head"}}


def row_of(run: str, name: str) -> str:
    for pattern, row in ARCHS[run][1]:
        m = re.match(pattern, name)
        if m:
            return m.expand(row)
    raise AssertionError(f"{run}: no row for {name}")


def picks_for(run: str, oldest):
    """Every other block, the first row and the last from the oldest checkpoint (the rest from
    the base)."""
    rows = [r for r in ARCHS[run][0] if r not in TIED.get(run, set())]
    blocks = [r for r in rows if re.search(r"\.\d+$", r)]
    return {r: oldest for r in [rows[0], *blocks[1::2], rows[-1]]}


@pytest.fixture(scope="module", params=list(ARCHS))
def composed(request, real_run, tmp_path_factory):
    run, spec = real_run(request.param)
    ckpts = checkpoints_of(run, spec)
    tmp = tmp_path_factory.mktemp(request.param)
    picks = picks_for(request.param, ckpts[0])
    recipe = write_recipe(tmp, ckpts[-1], picks)
    applied = tailor("--apply", recipe)
    assert applied.returncode == 0, applied.stderr
    return ComposedCase(spec, ckpts, tmp / "composed", picks=picks, recipe=recipe, name=request.param)


def test_rows_come_from_the_models_own_structure(composed):
    name, ckpts = composed.name, composed.ckpts
    ckpt = open_checkpoint(ckpts[-1])
    assert ckpt.row_names() == ARCHS[name][0]
    assert {r.name for r in ckpt.rows if r.tied} == TIED.get(name, set())


def test_every_parameter_and_moment_is_its_rows_pick(composed):
    name, ckpts, picks, out = composed.name, composed.ckpts, composed.picks, composed.out
    got = read_full_state(out)
    states = {c: read_full_state(c) for c in ckpts}
    used = set()
    for key in ("fp32", "exp_avg", "exp_avg_sq"):
        assert got[key].keys() == states[ckpts[-1]][key].keys()
        for param, value in got[key].items():
            source = picks.get(row_of(name, param), ckpts[-1])
            used.add(source)
            assert torch.equal(value, states[source][key][param]), (key, param)
    assert used == set(ckpts)


def test_every_weight_file_tensor_is_its_rows_pick(composed):
    name, ckpts, picks, out = composed.name, composed.ckpts, composed.picks, composed.out
    files = weight_files(ckpts[-1])
    assert files and weight_files(out) == files
    if name == "hf_peft_lora":
        assert files == ["adapter_model.safetensors"]
    used = set()
    for file in files:
        mine = tensors(out / file)
        assert list(mine) == list(tensors(ckpts[-1] / file))
        for tensor, value in mine.items():
            source = picks.get(row_of(name, tensor), ckpts[-1])
            used.add(source)
            ref = tensors(source / file)[tensor]
            assert value.dtype == ref.dtype and torch.equal(value, ref), (file, tensor)
    assert used == set(ckpts)
    for other in ckpts[-1].iterdir():  # run-level files: the base's, byte for byte
        if other.is_file() and other.name not in files:
            assert (out / other.name).read_bytes() == other.read_bytes(), other.name


def test_plan_names_the_fate_of_every_file(composed):
    ckpts, recipe = composed.ckpts, composed.recipe
    dry = tailor("--apply", recipe, "--dry-run", "--force")
    assert dry.returncode == 0, dry.stderr
    text = dry.stdout + dry.stderr
    composed_line = next(line for line in text.splitlines() if line.startswith("composed per row:"))
    assert all(f in composed_line for f in weight_files(ckpts[-1]))
    copied_line = next(line for line in text.splitlines() if "copied from the base:" in line)
    for f in ("trainer_state.json", "scheduler.pt", "rng_state_0.pth"):
        assert f in copied_line


def test_output_resumes_in_the_trainer(composed, tmp_path):
    spec, out = composed.spec, composed.out
    losses = resume_and_step(out, spec, tmp_path / "resume")
    assert losses and all(math.isfinite(x) for x in losses)
    assert_optim_states_equal(out, tmp_path / "resume" / "resaved")


def test_verify_fails_naming_the_file_and_row_of_a_weight_file_from_the_base(composed, tmp_path):
    name, ckpts, picks, recipe, out = composed.name, composed.ckpts, composed.picks, composed.recipe, composed.out
    assert tailor("--verify", recipe).returncode == 0
    file = weight_files(ckpts[-1])[0]
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    (copy / file).unlink()
    shutil.copy(ckpts[-1] / file, copy / file)
    bad = write_recipe(tmp_path, ckpts[-1], picks, output="copy")
    verified = tailor("--verify", bad)
    assert verified.returncode == 7, verified.stdout + verified.stderr
    report = verified.stdout + verified.stderr
    assert file in report
    moved = {row_of(name, t) for t in tensors(ckpts[-1] / file)} & set(picks)
    assert any(row in report for row in moved), report
    fails = [line.split()[1] for line in verified.stdout.splitlines() if line.startswith("FAIL")]
    assert fails and len(fails) == len(set(fails))  # one line a failing row, however many tensors differ
    if name == "hf_opt":  # -v: every difference (how much is printed: the same whatever the architecture)
        detailed = tailor("--verify", bad, "-v")
        assert detailed.returncode == 7 and len(detailed.stdout.splitlines()) > len(verified.stdout.splitlines())


def test_peft_output_loads_as_an_adapter(real_run, composed):
    name, spec, out = composed.name, composed.spec, composed.out
    if name != "hf_peft_lora":
        pytest.skip("PEFT only")
    from peft import PeftModel, get_peft_model_state_dict
    from run_models import base_model

    model = PeftModel.from_pretrained(base_model(spec), str(out))
    state = get_peft_model_state_dict(model)  # the adapter as PEFT loaded it, named as PEFT saves it
    assert any("lora_" in key for key in state)
    with safe_open(out / "adapter_model.safetensors", "pt") as f:
        assert set(f.keys()) == set(state)  # every tensor of the file loaded, and nothing else
        for key in f.keys():
            assert torch.equal(state[key].to(f.get_tensor(key).dtype), f.get_tensor(key)), key


def test_peft_export_is_refused_with_its_reason(real_run, tmp_path):
    run, spec = real_run("hf_peft_lora")
    ckpts = checkpoints_of(run, spec)
    recipe = write_recipe(tmp_path, ckpts[-1], {"layers.1": ckpts[0]})
    result = tailor("--export", recipe, "--to", tmp_path / "hf")
    assert_one_line_error(result, 5, "PEFT", "adapter_model.safetensors")
    assert not (tmp_path / "hf").exists()


def test_bert_tied_decoder_is_explained_in_the_plan(real_run, tmp_path):
    run, spec = real_run("hf_bert")
    ckpts = checkpoints_of(run, spec)
    recipe = write_recipe(tmp_path, ckpts[-1], {"cls": ckpts[0]})
    dry = tailor("--apply", recipe, "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert "cls.predictions.decoder.weight (in row cls) is tied to bert.embeddings.word_embeddings.weight" \
        in dry.stdout + dry.stderr


def test_bin_weights_keep_the_bases_archive_but_for_moved_rows(composed):
    """A composed pytorch_model.bin is torch's archive of the base's pickle (names, shapes, dtypes,
    storage layout) with only the records of moved rows changed: torch loads it as a dict of the
    same tensors, and the shards' index is the base's."""
    name, ckpts, out = composed.name, composed.ckpts, composed.out
    if name not in ("hf_bin", "hf_bin_sharded"):
        pytest.skip(".bin runs only")
    import zipfile

    for file in weight_files(ckpts[-1]):
        with zipfile.ZipFile(out / file) as mine, zipfile.ZipFile(ckpts[-1] / file) as base:
            assert mine.testzip() is None
            assert mine.namelist() == base.namelist()
            pickle = next(n for n in mine.namelist() if n.endswith("data.pkl"))
            assert mine.read(pickle) == base.read(pickle)
    index = ckpts[-1] / "pytorch_model.bin.index.json"
    if name == "hf_bin_sharded":
        assert (out / index.name).read_bytes() == index.read_bytes()


def test_a_bin_run_with_tied_storage_keeps_it_shared(real_run, tmp_path):
    """transformers 4.x wrote tied weights under both names on one storage: the composed file
    keeps them one storage, taken with the row they belong to (embed_tokens)."""
    run, spec = real_run("hf_bin_tied")
    ckpts = checkpoints_of(run, spec)
    recipe = write_recipe(tmp_path, ckpts[-1], {"embed_tokens": ckpts[0], "layers.1": ckpts[0]})
    applied = tailor("--apply", recipe)
    assert applied.returncode == 0, applied.stderr
    got = torch.load(tmp_path / "composed" / "pytorch_model.bin", weights_only=True)
    old = torch.load(ckpts[0] / "pytorch_model.bin", weights_only=True)
    assert got["lm_head.weight"].untyped_storage().data_ptr() == got["model.embed_tokens.weight"].untyped_storage().data_ptr()
    assert torch.equal(got["model.embed_tokens.weight"], old["model.embed_tokens.weight"])
    assert tailor("--verify", recipe).returncode == 0


def test_a_legacy_format_bin_is_refused_when_rows_move(real_run, tmp_path):
    """A pytorch_model.bin in torch's legacy (non-zip) format is not composed: moving a row is refused
    before anything is written, naming the file; with every row from the base it is copied."""
    run, spec = real_run("hf_bin")
    ckpts = checkpoints_of(run, spec)
    copies = []
    for ckpt in ckpts:
        copy = tmp_path / "run" / ckpt.name
        shutil.copytree(ckpt, copy)
        weights = torch.load(ckpt / "pytorch_model.bin", weights_only=True)
        torch.save(weights, copy / "pytorch_model.bin", _use_new_zipfile_serialization=False)
        copies.append(copy)
    moved = write_recipe(tmp_path, copies[-1], {"layers.1": copies[0]})
    assert_one_line_error(tailor("--apply", moved), 5, "pytorch_model.bin", "legacy", "layers.1")
    assert not (tmp_path / "composed").exists()
    same = write_recipe(tmp_path, copies[-1], {})
    assert tailor("--apply", same).returncode == 0
    assert (tmp_path / "composed" / "pytorch_model.bin").read_bytes() == (copies[-1] / "pytorch_model.bin").read_bytes()


def test_a_weight_tensor_of_no_row_is_refused_by_name(real_run, tmp_path):
    """GPT-NeoX's model file names its head embed_out: without config.json, nothing says which row
    it is, so moving a row is refused naming the file, the tensor and the row it is closest to (never
    the base's copy, never advice to delete the model's own file)."""
    run, spec = real_run("hf_gpt_neox")
    ckpts = checkpoints_of(run, spec)
    copies = []
    for ckpt in ckpts:
        copy = tmp_path / "run" / ckpt.name
        shutil.copytree(ckpt, copy)
        (copy / "config.json").unlink()
        copies.append(copy)
    recipe = write_recipe(tmp_path, copies[-1], {"lm_head": copies[0]})
    refused = tailor("--apply", recipe)
    assert_one_line_error(refused, 5, "model.safetensors", "embed_out.weight", "no row", "the closest is")
    assert "remove the file" not in refused.stderr  # the model's own file: its names need reading, not deleting
    assert not (tmp_path / "composed").exists()


def test_a_checkpoint_without_the_bases_adapter_cannot_be_combined(real_run, tmp_path):
    """The one rule the composer and the planner share (checkpoint.incompatibility): a source
    without the base's adapter file is struck through in the grid and refused by the plan."""
    from tailor_tui.checkpoints.checkpoint import incompatibility

    run, spec = real_run("hf_peft_lora")
    ckpts = checkpoints_of(run, spec)
    copy = tmp_path / "run" / ckpts[0].name
    shutil.copytree(ckpts[0], copy)
    (copy / "adapter_model.safetensors").unlink()
    why = incompatibility(open_checkpoint(ckpts[-1]), open_checkpoint(copy))
    assert why and "adapter_model.safetensors" in why
    assert incompatibility(open_checkpoint(ckpts[-1]), open_checkpoint(ckpts[0])) is None
    recipe = write_recipe(tmp_path, ckpts[-1], {"layers.1": copy})
    assert_one_line_error(tailor("--apply", recipe), 5, "adapter_model.safetensors")


def test_a_peft_adapter_saved_with_torch_is_composed_per_row(real_run, tmp_path):
    """PEFT's adapter_model.bin (safe_serialization=False): each row's LoRA tensors from its pick."""
    run, spec = real_run("hf_peft_lora_bin")
    ckpts = checkpoints_of(run, spec)
    assert (ckpts[-1] / "adapter_model.bin").is_file()
    picks = {"layers.1": ckpts[0], "lm_head": ckpts[0]}
    recipe = write_recipe(tmp_path, ckpts[-1], picks)
    applied = tailor("--apply", recipe)
    assert applied.returncode == 0, applied.stderr
    got = torch.load(tmp_path / "composed" / "adapter_model.bin", weights_only=True)
    assert list(got) == list(torch.load(ckpts[-1] / "adapter_model.bin", weights_only=True))
    for name, value in got.items():
        source = picks.get(row_of("hf_peft_lora", name), ckpts[-1])
        assert torch.equal(value, torch.load(source / "adapter_model.bin", weights_only=True)[name]), name
    assert tailor("--verify", recipe).returncode == 0


def test_a_vision_language_recipe_names_rows_short_by_module_path_or_by_earlier_names(real_run, tmp_path):
    """Through the CLI on the real Llava run: a recipe naming a vision block by its full module path, and
    a language block by the name tailor-tui gave it before stacks (`language_model.layers.1`), composes
    the same as one naming them `vision.layers.1` and `layers.1`; --stats shows a line per stack."""
    run, spec = real_run("hf_llava")
    ckpts = checkpoints_of(run, spec)
    for folder in ("short", "long", "bad"):
        (tmp_path / folder).mkdir()
    short = write_recipe(tmp_path / "short", ckpts[-1], {"vision.layers.1": ckpts[0], "layers.1": ckpts[0]})
    long = write_recipe(tmp_path / "long", ckpts[-1], {"model.vision_tower.encoder.layers.1": ckpts[0],
                                                      "language_model.layers.1": ckpts[0]})
    for recipe in (short, long):
        dry = tailor("--apply", recipe, "--dry-run")
        assert dry.returncode == 0, dry.stderr
        assert "vision.layers.1" in dry.stdout and "language_model" not in dry.stdout
        assert tailor("--apply", recipe).returncode == 0
    a, b = read_full_state(tmp_path / "short" / "composed"), read_full_state(tmp_path / "long" / "composed")
    for key in ("fp32", "exp_avg", "exp_avg_sq"):
        assert all(torch.equal(a[key][p], b[key][p]) for p in a[key])
    unknown = write_recipe(tmp_path / "bad", ckpts[-1], {"layers.9": ckpts[0]})
    assert_one_line_error(tailor("--apply", unknown), 3, "unknown row 'layers.9'")
    stats = tailor("--stats", run)
    assert stats.returncode == 0, stats.stderr
    lines = stats.stdout.splitlines()
    assert lines.index("[vision]") < next(i for i, x in enumerate(lines) if x.startswith("vision.layers.0"))
    assert lines.index("[language]") < next(i for i, x in enumerate(lines) if x.startswith("layers.0"))


def test_a_block_several_layers_run_is_picked_alone_for_all_of_them_and_resumes(real_run, tmp_path):
    """Issue 60 (7): Zamba2's layers 1 and 3 run one attention+MLP block. It is a row of its own
    (`layers.1.shared_transformer`, named by its module path in a recipe too): taken alone from the older
    checkpoint, every tensor of it (and its moments) is that checkpoint's, every other row the base's; picking
    `layers.1` never moves it (what layer 3 runs); no plan lists tie notes; the output resumes in the Trainer."""
    run, spec = real_run("hf_zamba2")
    old, base = checkpoints_of(run, spec)[0], checkpoints_of(run, spec)[-1]
    rows = {r.name: r for r in open_checkpoint(base).rows}
    block = rows["layers.1.shared_transformer"]
    assert len(block.params) == 12 and {a.split(".")[2] for a, _t in block.aliases} == {"3"}  # layer 3 runs it
    assert not rows["layers.3"].aliases and not any("shared" in p for p in rows["layers.1"].params)
    for pick, moved in (("model.layers.1.shared_transformer", "layers.1.shared_transformer"), ("layers.1", "layers.1")):
        out = tmp_path / moved
        recipe = write_recipe(tmp_path, base, {pick: old}, output=out.name)
        dry = tailor("--apply", recipe, "--dry-run")
        assert dry.returncode == 0 and "note:" not in dry.stdout, dry.stdout + dry.stderr
        assert tailor("--apply", recipe).returncode == 0
        got, theirs, mine = read_full_state(out), read_full_state(old), read_full_state(base)
        for key in ("fp32", "exp_avg", "exp_avg_sq"):
            for param, value in got[key].items():
                source = theirs if row_of("hf_zamba2", param) == moved else mine
                assert torch.equal(value, source[key][param]), (pick, key, param)
        assert tailor("--verify", recipe).returncode == 0
    losses = resume_and_step(tmp_path / "layers.1.shared_transformer", spec, tmp_path / "resume")
    assert losses and all(math.isfinite(x) for x in losses)
    assert_optim_states_equal(tmp_path / "layers.1.shared_transformer", tmp_path / "resume" / "resaved")
