"""The models and Trainer saves of the tests' runs (`runs.RunSpec`): test code.

Every model is tiny and built from its config with random weights (nothing is downloaded):
Llama (with the frozen / buffer / tied variants of RunSpec), OPT, BERT (masked LM), T5,
GPT-NeoX, BEiT (a vision encoder classifying 16x16 images, each block holding its layer-scale
factors itself) and the vision-language models Llava, Qwen2-VL, Qwen2.5-VL and Mllama (tiny images
beside image tokens), optionally wrapped with a PEFT LoRA adapter. `RunTrainer` is the HF Trainer of the
HF-layout runs: it writes the model file as the spec says, sharded (`max_shard_size`) and/or as
`pytorch_model.bin` the way transformers 4.x did with `save_safetensors=False`.

transformers, torch and peft are imported inside the functions: importing the runs stays cheap.
"""

from __future__ import annotations

import json
import os
from functools import cache
from typing import TYPE_CHECKING, Any

from tailor_tui.demo.demo_run import HEADS, MAX_POSITIONS, llama_config, token_rows

if TYPE_CHECKING:  # for annotations only (see above)
    import torch
    from transformers import PreTrainedModel

ARCHS = ("llama", "opt", "bert", "t5", "gpt_neox", "beit", "llava", "llava_next", "qwen2_vl", "qwen2_5_vl",
         "mllama", "zamba2", "albert")
IMAGE, LABELS = 16, 4  # the vision models': 16x16 images, 4 classes
IMAGE_TOKENS = (IMAGE // 4) ** 2  # a Llava's image tokens: one per 4x4 patch (its CLS dropped)
# Qwen2-VL / Qwen2.5-VL: 4x4 patches of 2 frames (a still image repeated, as their processor does),
# merged 2x2 into one image token: a 16x16 image is a 1x4x4 grid of 16 patches and 4 image tokens
QWEN_PATCH, QWEN_FRAMES, QWEN_MERGE = 4, 2, 2
QWEN_GRID = (1, IMAGE // QWEN_PATCH, IMAGE // QWEN_PATCH)
QWEN_IMAGE_TOKENS = QWEN_GRID[1] * QWEN_GRID[2] // QWEN_MERGE**2
MLLAMA_IMAGE = 8  # Mllama: one 8x8 tile per image (4 patches and a CLS), read by cross-attention
# LLaVA-NeXT: its one grid pinpoint is the image's size, so an image is two 16x16 patches (the image
# resized, and its one tile): 16 features of the first, 16 of the tile and a newline per tile row
NEXT_IMAGE_TOKENS = 2 * IMAGE_TOKENS + IMAGE // 4
VISION_LMS = ("llava", "llava_next", "qwen2_vl", "qwen2_5_vl", "mllama")


def model_config(spec):
    """The transformers config of `spec.arch` (`spec.vocab`, `spec.hidden`, `spec.layers`, 4 heads)."""
    import transformers as tf

    inter = spec.intermediate or spec.hidden * 3 // 2
    common = dict(vocab_size=spec.vocab, tie_word_embeddings=spec.tied)
    if spec.arch == "llama":  # the demo's
        return llama_config(vocab=spec.vocab, hidden=spec.hidden, layers=spec.layers, intermediate=inter,
                            tied=spec.tied)
    if spec.arch == "opt":
        return tf.OPTConfig(**common, hidden_size=spec.hidden, word_embed_proj_dim=spec.hidden, ffn_dim=inter,
                            num_hidden_layers=spec.layers, num_attention_heads=HEADS,
                            max_position_embeddings=MAX_POSITIONS, dropout=0.0, attention_dropout=0.0)
    if spec.arch == "bert":
        return tf.BertConfig(**common, hidden_size=spec.hidden, intermediate_size=inter,
                             num_hidden_layers=spec.layers, num_attention_heads=HEADS,
                             max_position_embeddings=MAX_POSITIONS, hidden_dropout_prob=0.0,
                             attention_probs_dropout_prob=0.0, pad_token_id=0)
    if spec.arch == "t5":
        # the decoder has one block fewer than the encoder: their layer counts are distinct
        return tf.T5Config(**common, d_model=spec.hidden, d_kv=spec.hidden // HEADS, d_ff=inter,
                           num_layers=spec.layers, num_decoder_layers=max(1, spec.layers - 1), num_heads=HEADS,
                           relative_attention_num_buckets=8, relative_attention_max_distance=16,
                           dropout_rate=0.0, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
    if spec.arch == "gpt_neox":
        # lm_head untied: transformers 5 saves it as the checkpoint name `embed_out.weight`
        return tf.GPTNeoXConfig(vocab_size=spec.vocab, tie_word_embeddings=False, hidden_size=spec.hidden,
                                intermediate_size=inter, num_hidden_layers=spec.layers,
                                num_attention_heads=HEADS, max_position_embeddings=MAX_POSITIONS,
                                rotary_pct=0.5, hidden_dropout=0.0, attention_dropout=0.0)
    if spec.arch == "beit":  # layer scale: each block holds parameters of its own (lambda_1, lambda_2)
        return tf.BeitConfig(image_size=IMAGE, patch_size=4, num_channels=3, hidden_size=spec.hidden,
                             intermediate_size=inter, num_hidden_layers=spec.layers, num_attention_heads=HEADS,
                             hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, drop_path_rate=0.0,
                             layer_scale_init_value=0.1, use_mean_pooling=True, num_labels=LABELS)
    if spec.arch in ("llava", "llava_next"):  # a CLIP vision tower, a projector and a Llama; 16 image tokens
        # per image (LLaVA-NeXT: its images tiled, NEXT_IMAGE_TOKENS, a learnt image_newline)
        vision = tf.CLIPVisionConfig(hidden_size=spec.hidden, intermediate_size=inter,
                                     num_hidden_layers=spec.vision_layers or 2,
                                     num_attention_heads=HEADS, image_size=IMAGE, patch_size=4)
        text = tf.LlamaConfig(vocab_size=spec.vocab, hidden_size=spec.hidden, intermediate_size=inter,
                              num_hidden_layers=spec.layers, num_attention_heads=HEADS, num_key_value_heads=2,
                              max_position_embeddings=MAX_POSITIONS)
        if spec.arch == "llava_next":
            return tf.LlavaNextConfig(vision_config=vision, text_config=text, image_token_index=spec.vocab - 1,
                                      image_grid_pinpoints=[[IMAGE, IMAGE]], tie_word_embeddings=spec.tied)
        return tf.LlavaConfig(vision_config=vision, text_config=text, image_token_index=spec.vocab - 1,
                              tie_word_embeddings=spec.tied)
    if spec.arch in ("qwen2_vl", "qwen2_5_vl"):  # a ViT (2 blocks) and a patch merger, then a Qwen2
        half = spec.hidden // HEADS // 2  # multimodal RoPE: the head's frequencies split in (t, h, w)
        text = dict(vocab_size=spec.vocab, hidden_size=spec.hidden, intermediate_size=inter,
                    num_hidden_layers=spec.layers, num_attention_heads=HEADS, num_key_value_heads=2,
                    max_position_embeddings=MAX_POSITIONS, bos_token_id=None, eos_token_id=None,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                     "mrope_section": [half - 2 * (half // 4), half // 4, half // 4]})
        depth = spec.vision_layers or 2
        vision = dict(depth=depth, num_heads=HEADS, patch_size=QWEN_PATCH, temporal_patch_size=QWEN_FRAMES,
                      spatial_merge_size=QWEN_MERGE)
        ids = dict(image_token_id=spec.vocab - 1, video_token_id=spec.vocab - 2,
                   vision_start_token_id=spec.vocab - 3, vision_end_token_id=spec.vocab - 4,
                   tie_word_embeddings=spec.tied)
        if spec.arch == "qwen2_vl":
            vision.update(embed_dim=spec.hidden, hidden_size=spec.hidden, mlp_ratio=2)
            return tf.Qwen2VLConfig(vision_config=vision, text_config=text, **ids)
        # Qwen2.5-VL: gated MLPs, RMS norms, windowed attention but in its last block (full)
        vision.update(hidden_size=spec.hidden, out_hidden_size=spec.hidden, intermediate_size=inter,
                      window_size=2 * QWEN_PATCH * QWEN_MERGE, fullatt_block_indexes=[depth - 1])
        return tf.Qwen2_5_VLConfig(vision_config=vision, text_config=text, **ids)
    if spec.arch == "mllama":  # a tiled ViT (2 local and 2 gated global blocks), a projector, a Llama whose
        # second layer is a cross-attention layer reading the image
        vision = tf.MllamaVisionConfig(hidden_size=spec.hidden, num_hidden_layers=spec.vision_layers or 2,
                                       num_global_layers=spec.vision_layers or 2,
                                       attention_heads=HEADS, intermediate_size=inter,
                                       vision_output_dim=2 * spec.hidden, intermediate_layers_indices=[0],
                                       image_size=MLLAMA_IMAGE, patch_size=4, max_num_tiles=1,
                                       supported_aspect_ratios=[[1, 1]])
        text = tf.MllamaTextConfig(vocab_size=spec.vocab, hidden_size=spec.hidden, intermediate_size=inter,
                                   num_hidden_layers=spec.layers, num_attention_heads=HEADS, num_key_value_heads=2,
                                   max_position_embeddings=MAX_POSITIONS, cross_attention_layers=[1],
                                   bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=spec.tied)
        return tf.MllamaConfig(vision_config=vision, text_config=text, image_token_index=spec.vocab - 1)
    if spec.arch == "zamba2":  # a hybrid: Mamba2 layers, and every second one also runs the one shared attention+MLP
        # block (`shared_transformer`, with an MLP adapter per layer running it); torch's Mamba2 path on CPU
        return tf.Zamba2Config(**common, hidden_size=spec.hidden, intermediate_size=inter,
                               num_hidden_layers=spec.layers,
                               layers_block_type=["hybrid" if i % 2 else "mamba" for i in range(spec.layers)],
                               num_attention_heads=HEADS, num_key_value_heads=HEADS,
                               attention_head_dim=2 * spec.hidden // HEADS, mamba_d_state=8, mamba_headdim=8,
                               n_mamba_heads=2 * spec.hidden // 8, mamba_ngroups=1, num_mem_blocks=1,
                               adapter_rank=4, use_mem_rope=False, max_position_embeddings=MAX_POSITIONS)
    if spec.arch == "albert":  # one layer group that every layer runs: ALBERT's cross-layer sharing
        return tf.AlbertConfig(**common, embedding_size=spec.hidden // 2, hidden_size=spec.hidden,
                               intermediate_size=inter, num_hidden_layers=spec.layers, num_attention_heads=HEADS,
                               num_hidden_groups=1, max_position_embeddings=MAX_POSITIONS, hidden_dropout_prob=0.0,
                               attention_probs_dropout_prob=0.0, classifier_dropout_prob=0.0, pad_token_id=0)
    raise ValueError(f"unknown arch {spec.arch!r}: one of {', '.join(ARCHS)}")


def base_model(spec):
    """The transformers model of `spec`, seeded (without the PEFT wrapper of `build_model`)."""
    import torch
    import transformers as tf

    cls = {"llama": tf.LlamaForCausalLM, "opt": tf.OPTForCausalLM, "bert": tf.BertForMaskedLM,
           "t5": tf.T5ForConditionalGeneration, "gpt_neox": tf.GPTNeoXForCausalLM,
           "beit": tf.BeitForImageClassification, "llava": tf.LlavaForConditionalGeneration,
           "llava_next": tf.LlavaNextForConditionalGeneration,
           "qwen2_vl": tf.Qwen2VLForConditionalGeneration, "qwen2_5_vl": tf.Qwen2_5_VLForConditionalGeneration,
           "mllama": tf.MllamaForConditionalGeneration, "zamba2": tf.Zamba2ForCausalLM,
           "albert": tf.AlbertForMaskedLM}[spec.arch]
    torch.manual_seed(spec.seed)
    config = model_config(spec)
    # A model of sub-models (a vision-language model: its vision tower, its language model) is made
    # as transformers makes one from a config, `_from_config`: under ZeRO-3 the whole model then is
    # made inside zero.Init, as from_pretrained makes it. Made by its class alone, transformers still
    # makes the sub-models inside zero.Init (their `_from_config`), in the training dtype and
    # partitioned, but not the parameters of the model itself (lm_head, a projector), left in fp32:
    # DeepSpeed then takes the model for one made by zero.Init, casts nothing, and its ZeRO-3
    # optimizer finds two dtypes in one parameter group (`defragment`'s assertion) under bf16.
    model = cls._from_config(config) if config.sub_configs else cls(config)
    for name, p in model.named_parameters():
        if is_frozen(spec, name):
            p.requires_grad_(False)
    if spec.buffer:
        if spec.arch != "llama":
            raise ValueError("RunSpec.buffer is Llama-only")
        model.model.norm.register_buffer("tailor_scale", torch.linspace(0.5, 1.5, spec.hidden), persistent=True)
    return model


def is_frozen(spec, name: str) -> bool:
    """Whether `spec.frozen` freezes parameter `name`: it names the parameter, or a module it lies in
    (`model.vision_tower`: the whole vision tower)."""
    return any(name == f or name.startswith(f + ".") for f in spec.frozen)


# A vision-language model's LoRA adapts both of its stacks and what joins them: the vision tower's
# attention (q/v, or its fused qkv) and MLP fc1 (a gated MLP's gate and up projections), the projector's
# (first) linear; and the language model's q/v. LLaVA-NeXT has Llava's modules (its image_newline, a bare
# parameter, stays frozen)
_LORA_LLAVA = (r"model\.vision_tower\..*\.(q_proj|v_proj|fc1)", r"model\.multi_modal_projector\.linear_1")
LORA_VISION = {"llava": _LORA_LLAVA, "llava_next": _LORA_LLAVA,
               "qwen2_vl": (r"model\.visual\.blocks\..*\.(qkv|fc1)", r"model\.visual\.merger\.mlp\.0"),
               "qwen2_5_vl": (r"model\.visual\.blocks\..*\.(qkv|gate_proj|up_proj)", r"model\.visual\.merger\.mlp\.0"),
               "mllama": (r"model\.vision_model\..*\.(q_proj|v_proj|fc1)", r"model\.multi_modal_projector")}


def lora_config(spec=None):
    """The LoRA adapter of a PEFT run: Llama's attention q/v projections; a vision-language model's
    (`LORA_VISION`: Llava, LLaVA-NeXT, Qwen2-VL, Qwen2.5-VL, Mllama) adapts its vision tower, projector and language model."""
    from peft import LoraConfig

    targets: list[str] | str = ["q_proj", "v_proj"]
    if spec is not None and spec.arch in LORA_VISION:
        stacks = [*LORA_VISION[spec.arch], r"model\.language_model\..*\.(q_proj|v_proj)"]
        targets = "|".join(f"(?:{t})" for t in stacks)
    return LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=targets,
                      modules_to_save=["lm_head"], task_type="CAUSAL_LM")


def build_model(spec):
    """The model a run trains: `base_model`, wrapped with LoRA (`lora_config`) when `spec.peft`."""
    model = base_model(spec)
    if not spec.peft:
        return model
    from peft import get_peft_model

    return get_peft_model(model, lora_config(spec))


def param_groups(model, weight_decay: float = 0.1):
    """HF Trainer's split: decay for matrices, none for norms and biases."""
    decay: list[torch.nn.Parameter] = []
    no_decay: list[torch.nn.Parameter] = []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if ("norm" in name or name.endswith(".bias")) else decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def batch_inputs(spec, ids):
    """The model's keyword inputs for token ids `ids` (one row or a batch): causal LMs predict
    `ids`; BERT (and ALBERT) the tokens of every 4th position, masked (id vocab-1); T5 `ids` reversed."""
    if spec.arch in ("bert", "albert"):
        import torch

        pos = torch.arange(ids.shape[-1])
        start = int(ids.reshape(-1)[0]) % 4  # which positions: varies from row to row
        masked = (pos % 4) == start
        masked = masked.expand_as(ids)
        return {"input_ids": ids.masked_fill(masked, spec.vocab - 1),
                "labels": ids.masked_fill(~masked, -100)}
    if spec.arch == "t5":
        return {"input_ids": ids, "labels": ids.flip(-1)}
    if spec.arch == "beit":  # an image drawn from the ids (a seed), its class the first id's
        import torch

        rows = ids.reshape(-1, ids.shape[-1])
        images = [torch.randn(3, IMAGE, IMAGE, generator=torch.Generator().manual_seed(int(r.sum()) * 31 + int(r[0])))
                  for r in rows]
        pixels, labels = torch.stack(images), rows[:, 0] % LABELS
        return ({"pixel_values": pixels[0], "labels": labels[0]} if ids.dim() == 1
                else {"pixel_values": pixels, "labels": labels})
    if spec.arch in VISION_LMS:
        return _vision_lm_inputs(spec, ids)
    return {"input_ids": ids, "labels": ids}


def _vision_lm_inputs(spec, ids):
    """A vision-language model's inputs: an image drawn from each row of ids (a seed), its image
    tokens (id vocab-1) before the text (the ids, less that id); the loss on the text alone.
    Llava: 16 image tokens, a 16x16 image (LLaVA-NeXT: 36, its image twice: resized and its one tile,
    with `image_sizes`). Qwen2-VL / Qwen2.5-VL: the image as their processor
    gives it, its patches flattened (`pixel_values` of the batch's images one after the other, one
    `image_grid_thw` row each), 4 image tokens marked in `mm_token_type_ids`. Mllama: one image of
    one 8x8 tile (`aspect_ratio_ids`, `aspect_ratio_mask`), one image token, every token reading
    the image by cross-attention (`cross_attention_mask`)."""
    import torch

    rows = ids.reshape(-1, ids.shape[-1]) % (spec.vocab - 1)
    n = rows.shape[0]
    side = MLLAMA_IMAGE if spec.arch == "mllama" else IMAGE
    images = torch.stack([torch.randn(3, side, side, generator=torch.Generator().manual_seed(int(r.sum())))
                          for r in rows])
    count = {"llava": IMAGE_TOKENS, "llava_next": NEXT_IMAGE_TOKENS, "mllama": 1}.get(spec.arch, QWEN_IMAGE_TOKENS)
    tokens = torch.cat([torch.full((n, count), spec.vocab - 1), rows], dim=1)
    labels = torch.cat([torch.full((n, count), -100), rows], dim=1)
    out = {"input_ids": tokens, "labels": labels}
    if spec.arch == "llava":
        out["pixel_values"] = images
    elif spec.arch == "llava_next":  # the image resized and its one tile: the same 16x16 twice
        out.update(pixel_values=images[:, None].repeat(1, 2, 1, 1, 1), image_sizes=torch.tensor([[side, side]] * n))
    elif spec.arch == "mllama":  # (batch, images, tiles, channels, height, width)
        out.update(pixel_values=images[:, None, None], aspect_ratio_ids=torch.ones(n, 1, dtype=torch.long),
                   aspect_ratio_mask=torch.ones(n, 1, 1, dtype=torch.long),
                   cross_attention_mask=torch.ones(n, tokens.shape[1], 1, 1, dtype=torch.long))
    else:
        out.update(mm_token_type_ids=(tokens == spec.vocab - 1).long(), image_grid_thw=torch.tensor([QWEN_GRID] * n))
    if ids.dim() == 1:
        out = {k: v[0] for k, v in out.items()}
    if spec.arch in ("qwen2_vl", "qwen2_5_vl"):  # not per row: every image's patches, one after another
        out["pixel_values"] = torch.cat([qwen_patches(image) for image in images])
        if ids.dim() == 1:
            out["image_grid_thw"] = out["image_grid_thw"][None]
    return out


def qwen_patches(image):
    """A still image (channels, height, width) as Qwen2-VL's image processor flattens it: repeated
    to QWEN_FRAMES frames, cut into patches in the order of their 2x2 merge windows, one row each."""
    (t, h, w), m, p = QWEN_GRID, QWEN_MERGE, QWEN_PATCH
    frames = image[None].repeat(QWEN_FRAMES, 1, 1, 1)
    patches = frames.reshape(t, QWEN_FRAMES, image.shape[0], h // m, m, p, w // m, m, p)
    patches = patches.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return patches.reshape(t * h * w, image.shape[0] * QWEN_FRAMES * p * p)


def collate(spec):
    """The Trainer's data collator for `spec`: None (transformers' default, stacking each input)
    but for Qwen2-VL / Qwen2.5-VL, whose image patches and grids are concatenated, as their processor
    batches them."""
    if spec.arch not in ("qwen2_vl", "qwen2_5_vl"):
        return None
    import torch

    def collate_rows(rows: list[dict]) -> dict:
        return {k: (torch.cat if k in ("pixel_values", "image_grid_thw") else torch.stack)([r[k] for r in rows])
                for k in rows[0]}

    return collate_rows


def training_batches(spec, count: int, rank: int):
    """Token-id batches (2 x 8) of the DeepSpeed-layout runs (`batch_inputs` makes the inputs)."""
    import torch

    g = torch.Generator().manual_seed(1000 + spec.seed * 100 + rank)
    return [torch.randint(0, spec.vocab, (2, 8), generator=g) for _ in range(count)]


def trainer_dataset(spec):
    """The HF Trainer's rows: the demo's token rows (`token_rows`), as `spec`'s model takes them."""
    return [batch_inputs(spec, row) for row in token_rows(spec.vocab, spec.seed)]


@cache
def run_trainer_class():
    from transformers import Trainer

    class RunTrainer(Trainer):
        """Trainer whose model saves follow the spec: `save_safetensors=False` writes
        pytorch_model.bin (`save_torch_pretrained`); `max_shard_size` shards the model file."""

        def __init__(self, *args, run_spec, **kwargs):
            super().__init__(*args, **kwargs)
            self.run_spec = run_spec

        def _save(self, output_dir=None, state_dict=None):
            spec = self.run_spec
            if spec.save_safetensors and spec.max_shard_size is None:
                return super()._save(output_dir, state_dict)
            import torch
            from transformers.trainer import TRAINING_ARGS_NAME

            output_dir = output_dir if output_dir is not None else self.args.output_dir
            if not self.args.should_save:
                return
            os.makedirs(output_dir, exist_ok=True)
            model = self.accelerator.unwrap_model(self.model, keep_torch_compile=False)
            if state_dict is None:
                state_dict = model.state_dict()
            if spec.peft:  # PeftModel.save_pretrained has no max_shard_size
                model.save_pretrained(output_dir, state_dict=state_dict, safe_serialization=spec.save_safetensors)
            elif spec.save_safetensors:
                model.save_pretrained(output_dir, state_dict=state_dict, max_shard_size=spec.max_shard_size)
            else:
                save_torch_pretrained(model, output_dir, state_dict, spec.max_shard_size or "5GB")
            torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))

    return RunTrainer


def save_torch_pretrained(model, output_dir, state_dict, max_shard_size="5GB") -> None:
    """Write `state_dict` as transformers 4.x's `save_pretrained(safe_serialization=False)` did:
    `pytorch_model.bin`, or `pytorch_model-0000K-of-0000N.bin` shards with
    `pytorch_model.bin.index.json` ({"metadata": {"total_size"}, "weight_map"}), by torch.save.

    As in 4.x, tied weights are NOT deduplicated (4.x removed aliases only for safetensors):
    every name of the state dict is written, tied names sharing one storage (in one shard);
    `_keys_to_ignore_on_save` are dropped. Names are the checkpoint names (transformers 5's
    `revert_weight_conversion`, e.g. GPT-NeoX `embed_out.weight`), which 4.x's modules had."""
    import torch
    from huggingface_hub import split_torch_state_dict_into_shards

    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # transformers 4.x: module names are the checkpoint names already
        def revert_weight_conversion(model: PreTrainedModel, state_dict: dict[str, torch.Tensor]) -> Any:
            return state_dict

    model.config.architectures = [type(model).__name__]
    model.config.save_pretrained(output_dir)
    if model.can_generate():
        model.generation_config.save_pretrained(output_dir)
    state_dict = dict(state_dict)
    for key in getattr(model, "_keys_to_ignore_on_save", None) or ():
        state_dict.pop(key, None)
    state_dict = revert_weight_conversion(model, state_dict)
    split = split_torch_state_dict_into_shards(state_dict, filename_pattern="pytorch_model{suffix}.bin",
                                               max_shard_size=max_shard_size)
    for filename, names in split.filename_to_tensors.items():
        torch.save({name: state_dict[name].contiguous() for name in names}, os.path.join(output_dir, filename))
    if split.is_sharded:
        index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
        with open(os.path.join(output_dir, "pytorch_model.bin.index.json"), "w", encoding="utf-8") as f:
            f.write(json.dumps(index, indent=2, sort_keys=True) + "\n")
