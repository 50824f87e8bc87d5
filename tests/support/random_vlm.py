"""Random-weight vision-language model folders of real shapes, loadable with ``mlx_vlm.load`` (and Orchard's
``model_type: multimodal``).

    python -m tests.support.random_vlm OUT --shape qwen2.5-vl-3b [--dtype bfloat16] [--vision-dtype float32] [--check]

The folder holds what a converted Qwen2.5-VL checkpoint holds: config.json (the real model's fields), bf16
safetensors built in place by mlx-vlm's own model class (random weights: throughput does not depend on their
values), a WordLevel tokenizer in which every id decodes (word "tN" is token N, Qwen's special tokens at their
real ids, so a K-word question is K tokens and image placeholders expand as in the real model), Qwen2.5-VL's
chat template (chat_template.json, and in tokenizer_config.json for text-only loaders) and its image
processor settings (preprocessor_config.json). `--check` loads the folder with `mlx_vlm.utils.load` and
generates a few tokens for a synthetic image (seconds for `tiny-vl` on a CPU).
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path
from typing import Any, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map_with_path

# Qwen2 / Qwen2.5-VL special tokens at their real ids (the tokenizer's added tokens 151643-151664); the
# model's vocabulary is padded to 151936, and every other id is an ordinary word here.
QWEN_VL_SPECIAL_TOKENS: dict[int, str] = {
    151643: "<|endoftext|>", 151644: "<|im_start|>", 151645: "<|im_end|>", 151646: "<|object_ref_start|>",
    151647: "<|object_ref_end|>", 151648: "<|box_start|>", 151649: "<|box_end|>", 151650: "<|quad_start|>",
    151651: "<|quad_end|>", 151652: "<|vision_start|>", 151653: "<|vision_end|>", 151654: "<|vision_pad|>",
    151655: "<|image_pad|>", 151656: "<|video_pad|>", 151657: "<tool_call>", 151658: "</tool_call>",
    151659: "<|fim_prefix|>", 151660: "<|fim_middle|>", 151661: "<|fim_suffix|>", 151662: "<|fim_pad|>",
    151663: "<|repo_name|>", 151664: "<|file_sep|>",
}

# Qwen2.5-VL-*-Instruct's chat_template.json: OpenAI-style content lists ({"type": "image"}, {"type":
# "image_url"}, {"type": "text"}) and plain string content; a default system turn when none is given.
QWEN2_5_VL_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Qwen2.5-VL's preprocessor_config.json (the processor resizes to multiples of patch * merge = 28 px).
QWEN2_5_VL_PREPROCESSOR = {
    "min_pixels": 3136,
    "max_pixels": 12845056,
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "image_processor_type": "Qwen2VLImageProcessor",
    "processor_class": "Qwen2_5_VLProcessor",
}

# The fields every Qwen2.5-VL config.json shares (Qwen2.5-VL-3B-Instruct's values).
_QWEN2_5_VL_COMMON: dict[str, Any] = {
    "model_type": "qwen2_5_vl",
    "architectures": ["Qwen2_5_VLForConditionalGeneration"],
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "vision_start_token_id": 151652,
    "vision_end_token_id": 151653,
    "vision_token_id": 151654,
    "image_token_id": 151655,
    "video_token_id": 151656,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "max_position_embeddings": 128000,
    "max_window_layers": 70,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "sliding_window": 32768,
    "use_sliding_window": False,
    "use_cache": True,
    "tie_word_embeddings": True,
    "vocab_size": 151936,
}

SHAPES: dict[str, dict[str, Any]] = {
    "qwen2.5-vl-3b": {  # Qwen/Qwen2.5-VL-3B-Instruct
        **_QWEN2_5_VL_COMMON,
        "hidden_size": 2048,
        "num_hidden_layers": 36,
        "intermediate_size": 11008,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},  # sums to head_dim / 2 = 64
        "vision_config": {
            "depth": 32,
            "hidden_act": "silu",
            "hidden_size": 1280,
            "intermediate_size": 3420,
            "num_heads": 16,
            "in_chans": 3,
            "out_hidden_size": 2048,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "spatial_patch_size": 14,
            "window_size": 112,
            "fullatt_block_indexes": [7, 15, 23, 31],
            "tokens_per_second": 2,
            "temporal_patch_size": 2,
        },
    },
    "tiny-vl": {  # the same architecture, a few MB (most of it the 151,936-row embedding), for CPU smoke tests
        **_QWEN2_5_VL_COMMON,
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "intermediate_size": 64,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "max_position_embeddings": 32768,
        "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},  # head_dim 16
        "vision_config": {
            "depth": 2,
            "hidden_act": "silu",
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 2,
            "in_chans": 3,
            "out_hidden_size": 32,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "spatial_patch_size": 14,
            "window_size": 112,
            "fullatt_block_indexes": [1],
            "tokens_per_second": 2,
            "temporal_patch_size": 2,
        },
    },
}


def vlm_config(shape: str, dtype: str = "bfloat16") -> dict[str, Any]:
    """The config.json of a shape."""
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; choose from {sorted(SHAPES)}")
    return {**copy.deepcopy(SHAPES[shape]), "torch_dtype": dtype}


def _init_param(path: str, param: mx.array, dtype: mx.Dtype) -> mx.array:
    """Norm scales 1 (`norm*`, the merger's `ln_q`), biases 0, other weights N(0, 1/fan_in) so activations
    stay O(1); a convolution's fan-in is all its input dimensions."""
    name = path.split(".")
    if any("norm" in part or part.startswith("ln_") for part in name):
        return mx.ones(param.shape, dtype=dtype) if name[-1] == "weight" else mx.zeros(param.shape, dtype=dtype)
    if name[-1] == "bias":
        return mx.zeros(param.shape, dtype=dtype)
    fan_in = 1
    for size in param.shape[1:]:
        fan_in *= size
    return mx.random.normal(param.shape, dtype=dtype, scale=fan_in**-0.5)


def build_random_vlm(config: dict[str, Any], dtype: str, seed: int, vision_dtype: str | None = None) -> nn.Module:
    """mlx-vlm's own Model for the config (its package resolved by mlx_vlm.utils.get_model_and_args, its
    configs built as mlx_vlm.utils.load_model builds them), with lazy random weights in `dtype`."""
    from mlx_vlm.utils import get_model_and_args, update_module_configs

    config = copy.deepcopy(config)
    module, _ = get_model_and_args(config)
    model_config = module.ModelConfig.from_dict(config)
    model_config = update_module_configs(model_config, module, config, ["text", "vision"])
    model = module.Model(model_config)
    mx.random.seed(seed)
    mx_dtype, tower_dtype = getattr(mx, dtype), getattr(mx, vision_dtype or dtype)
    model.update(tree_map_with_path(
        lambda p, w: _init_param(p, w, tower_dtype if p.startswith("vision_tower.") else mx_dtype), model.parameters()
    ))
    return model


def write_vl_tokenizer(out_dir: Path, vocab_size: int) -> None:
    """WordLevel over the whole vocabulary: the specials at their ids, word "tN" for every other id N; decoded
    like Qwen's byte-level BPE (tokens concatenated), so servers detokenize it as they do the real model's."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {QWEN_VL_SPECIAL_TOKENS.get(i, f"t{i}"): i for i in range(vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<|endoftext|>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.decoder = decoders.ByteLevel()
    # Special tokens are matched before pre-tokenization: "<|vision_start|><|image_pad|>..." splits into them.
    specials = [AddedToken(t, special=True, normalized=False) for t in QWEN_VL_SPECIAL_TOKENS.values()]
    tokenizer.add_special_tokens(specials)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": "<|endoftext|>",
        "model_max_length": 131072,
        "clean_up_tokenization_spaces": False,
        "chat_template": QWEN2_5_VL_CHAT_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    special_map = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "unk_token": "<|endoftext|>"}
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2))
    (out_dir / "chat_template.json").write_text(json.dumps({"chat_template": QWEN2_5_VL_CHAT_TEMPLATE}, indent=2))
    (out_dir / "preprocessor_config.json").write_text(json.dumps(QWEN2_5_VL_PREPROCESSOR, indent=2))


def make_random_vlm(
    out_dir: str | Path, shape: str = "qwen2.5-vl-3b", dtype: str = "bfloat16", seed: int = 0,
    vision_dtype: str | None = None,
) -> Path:
    """vision_dtype: the vision tower's (default: dtype). On MLX 0.32.4's CUDA backend a bf16 or fp16 Qwen2.5-VL vision
    tower dies in its forward (SIGFPE, in mlx_vlm.server as in Orchard); float32 runs."""
    """Write config.json, safetensors (mlx-vlm's own writer), the tokenizer and the processor settings."""
    from mlx_vlm.utils import save_weights

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = vlm_config(shape, dtype)
    model = build_random_vlm(config, dtype, seed, vision_dtype)
    save_weights(out, model, donate_weights=True)  # each shard materialised once, the model never held twice
    (out / "config.json").write_text(json.dumps(config, indent=2))
    write_vl_tokenizer(out, config["vocab_size"])
    return out


def check_folder(path: str | Path, image_size: int = 224, max_tokens: int = 8) -> str:
    """Load the folder with mlx-vlm and generate `max_tokens` greedy tokens for a synthetic image."""
    from mlx_vlm import generate
    from mlx_vlm.prompt_utils import apply_chat_template
    from mlx_vlm.utils import load

    from deployments.chat.synthetic_images import synthetic_image

    model, processor = load(str(path))
    prompt = apply_chat_template(processor, model.config, "t1 t2 t3 t4", num_images=1)
    image = synthetic_image(image_size, image_size, seed=0)
    result = generate(model, processor, prompt, image=[image], max_tokens=max_tokens, temperature=0.0, verbose=False)
    return f"prompt {result.prompt_tokens} tokens, generated {result.generation_tokens}: {result.text[:80]!r}"


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="output folder")
    parser.add_argument("--shape", default="qwen2.5-vl-3b", choices=sorted(SHAPES))
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--vision-dtype", default=None, choices=["bfloat16", "float16", "float32"],
                        help="the vision tower's weights (default: --dtype)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--check", action="store_true", help="then load it with mlx-vlm and generate for an image")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    path = make_random_vlm(args.out, args.shape, args.dtype, args.seed, args.vision_dtype)
    size = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
    print(f"wrote {path} ({size / 2**20:.1f} MiB) in {time.perf_counter() - start:.1f} s", flush=True)
    if args.check:
        print(f"mlx-vlm: {check_folder(path)}")


if __name__ == "__main__":
    main()
