"""The models and Trainer saves of the demo and test runs (tailor_tui.runs.demo_run).

Every model is tiny and built from its config with random weights (nothing is downloaded):
Llama (with the frozen / buffer / tied variants of RunSpec), OPT, BERT (masked LM), T5,
GPT-NeoX and BEiT (a vision encoder classifying 16x16 images, each block holding its layer-scale
factors itself), optionally wrapped with a PEFT LoRA adapter. `RunTrainer` is the HF Trainer of the
HF-layout runs: it writes the model file as the spec says, sharded (`max_shard_size`) and/or as
`pytorch_model.bin` the way transformers 4.x did with `save_safetensors=False`.

transformers, torch and peft are imported inside the functions: importing demo_run stays cheap.
"""

from __future__ import annotations

import json
import os
from functools import cache
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # for annotations only (see above)
    import torch
    from transformers import PreTrainedModel

ARCHS = ("llama", "opt", "bert", "t5", "gpt_neox", "beit", "llava")
HEADS = 4
MAX_POSITIONS = 64
IMAGE, LABELS = 16, 4  # the vision models': 16x16 images, 4 classes
IMAGE_TOKENS = (IMAGE // 4) ** 2  # a Llava's image tokens: one per 4x4 patch (its CLS dropped)


def model_config(spec):
    """The transformers config of `spec.arch` (`spec.vocab`, `spec.hidden`, `spec.layers`, 4 heads)."""
    import transformers as tf

    inter = spec.intermediate or spec.hidden * 3 // 2
    common = dict(vocab_size=spec.vocab, tie_word_embeddings=spec.tied)
    if spec.arch == "llama":
        return tf.LlamaConfig(**common, hidden_size=spec.hidden, intermediate_size=inter,
                              num_hidden_layers=spec.layers, num_attention_heads=HEADS, num_key_value_heads=2,
                              max_position_embeddings=MAX_POSITIONS)
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
    if spec.arch == "llava":  # a CLIP vision tower, a projector and a Llama; 16 image tokens per image
        vision = tf.CLIPVisionConfig(hidden_size=spec.hidden, intermediate_size=inter,
                                     num_hidden_layers=spec.vision_layers or 2,
                                     num_attention_heads=HEADS, image_size=IMAGE, patch_size=4)
        text = tf.LlamaConfig(vocab_size=spec.vocab, hidden_size=spec.hidden, intermediate_size=inter,
                              num_hidden_layers=spec.layers, num_attention_heads=HEADS, num_key_value_heads=2,
                              max_position_embeddings=MAX_POSITIONS)
        return tf.LlavaConfig(vision_config=vision, text_config=text, image_token_index=spec.vocab - 1,
                              tie_word_embeddings=spec.tied)
    raise ValueError(f"unknown arch {spec.arch!r}: one of {', '.join(ARCHS)}")


def base_model(spec):
    """The transformers model of `spec`, seeded (without the PEFT wrapper of `build_model`)."""
    import torch
    import transformers as tf

    cls = {"llama": tf.LlamaForCausalLM, "opt": tf.OPTForCausalLM, "bert": tf.BertForMaskedLM,
           "t5": tf.T5ForConditionalGeneration, "gpt_neox": tf.GPTNeoXForCausalLM,
           "beit": tf.BeitForImageClassification, "llava": tf.LlavaForConditionalGeneration}[spec.arch]
    torch.manual_seed(spec.seed)
    model = cls(model_config(spec))
    for name, p in model.named_parameters():
        if name in spec.frozen:
            p.requires_grad_(False)
    if spec.buffer:
        if spec.arch != "llama":
            raise ValueError("RunSpec.buffer is Llama-only")
        model.model.norm.register_buffer("tailor_scale", torch.linspace(0.5, 1.5, spec.hidden), persistent=True)
    return model


def lora_config():
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"],
                      modules_to_save=["lm_head"], task_type="CAUSAL_LM")


def build_model(spec):
    """The model a run trains: `base_model`, wrapped with LoRA (`lora_config`) when `spec.peft`."""
    model = base_model(spec)
    if not spec.peft:
        return model
    from peft import get_peft_model

    return get_peft_model(model, lora_config())


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
    `ids`; BERT the tokens of every 4th position, masked (id vocab-1); T5 `ids` reversed."""
    if spec.arch == "bert":
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
    if spec.arch == "llava":  # 16 image tokens, then the text; the loss on the text alone
        import torch

        rows = ids.reshape(-1, ids.shape[-1]) % (spec.vocab - 1)
        images = torch.stack([torch.randn(3, IMAGE, IMAGE, generator=torch.Generator().manual_seed(int(r.sum())))
                              for r in rows])
        tokens = torch.cat([torch.full((rows.shape[0], IMAGE_TOKENS), spec.vocab - 1), rows], dim=1)
        labels = torch.cat([torch.full((rows.shape[0], IMAGE_TOKENS), -100), rows], dim=1)
        one = ids.dim() == 1
        return {"input_ids": tokens[0] if one else tokens, "labels": labels[0] if one else labels,
                "pixel_values": images[0] if one else images}
    return {"input_ids": ids, "labels": ids}


def training_batches(spec, count: int, rank: int):
    """Token-id batches (2 x 8) of the DeepSpeed-layout runs (`batch_inputs` makes the inputs)."""
    import torch

    g = torch.Generator().manual_seed(1000 + spec.seed * 100 + rank)
    return [torch.randint(0, spec.vocab, (2, 8), generator=g) for _ in range(count)]


def trainer_dataset(spec):
    import torch

    g = torch.Generator().manual_seed(1000 + spec.seed)
    ids = torch.randint(0, spec.vocab, (256, 8), generator=g)
    return [batch_inputs(spec, row) for row in ids]


def make_trainer(spec, args, callbacks=(), eval_dataset=None):
    """The HF Trainer (`RunTrainer`) of an HF-layout run of `spec`, on a fresh `build_model`."""
    return run_trainer_class()(model=build_model(spec), args=args, train_dataset=trainer_dataset(spec),
                               eval_dataset=eval_dataset, callbacks=list(callbacks), run_spec=spec)


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
