"""Tiny random-weight vision-language models of real mlx-vlm architectures, written as model folders.

Each writer builds mlx-vlm's own model class for a shrunken config of the real checkpoint (real vocabulary
size and special token ids, real chat template, real processor classes with small image sizes), randomises
the weights and writes everything `mlx_vlm.utils.load(path)` reads: config.json, generation_config.json,
model.safetensors (float32), the tokenizer files and chat_template.json (tests/support/vlm_tokenizers.py)
and the processor configs. Nothing is downloaded.

- `write_qwen25_vl`: Qwen2.5-VL (M-RoPE, windowed vision attention). An image becomes
  (round(H/28) * round(W/28)) `<|image_pad|>` tokens after Qwen's smart_resize between
  `QWEN25_VL_MIN_PIXELS` and `QWEN25_VL_MAX_PIXELS`: 56x56 gives 4, 224x224 and anything larger about 64.
- `write_gemma3`: Gemma 3 (a sliding-window layer and a global one, SigLIP tower, pooled projector). Every
  image is resized to 112x112 and becomes `GEMMA3_IMAGE_TOKENS` (16) `<image_soft_token>`s.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten, tree_map_with_path

from tests.support.vlm_images import jpeg_bytes, png_bytes, truncated_png_bytes
from tests.support.vlm_tokenizers import (
    write_gemma3_tokenizer,
    write_qwen25_vl_tokenizer,
)

# The image helpers live in vlm_images.py; tests that build a model usually want them too.
__all__ = ["GEMMA3_CONFIG", "GEMMA3_IMAGE_TOKENS", "GEMMA3_IMAGE_TOKEN_ID", "QWEN25_VL_CONFIG",
           "QWEN25_VL_IMAGE_TOKEN_ID", "QWEN25_VL_MAX_PIXELS", "QWEN25_VL_MIN_PIXELS", "jpeg_bytes", "png_bytes",
           "truncated_png_bytes", "write_gemma3", "write_qwen25_vl"]

# ---- Qwen2.5-VL (shapes of Qwen2.5-VL-3B-Instruct, shrunk; token ids and template are the real ones)
QWEN25_VL_IMAGE_TOKEN_ID = 151655
QWEN25_VL_PATCH = 14
QWEN25_VL_MERGE = 2
QWEN25_VL_MIN_PIXELS = 4 * (QWEN25_VL_PATCH * QWEN25_VL_MERGE) ** 2  # 56 x 56: 4 image tokens
QWEN25_VL_MAX_PIXELS = 64 * (QWEN25_VL_PATCH * QWEN25_VL_MERGE) ** 2  # 224 x 224: 64 image tokens

QWEN25_VL_CONFIG: dict[str, Any] = {
    "architectures": ["Qwen2_5_VLForConditionalGeneration"],
    "model_type": "qwen2_5_vl",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    # head_dim 16: the sections cover its 8 frequencies as the real [16, 24, 24] cover 64.
    "rope_scaling": {"type": "mrope", "rope_type": "default", "mrope_section": [2, 3, 3]},
    "max_position_embeddings": 128000,
    "vocab_size": 151936,
    "tie_word_embeddings": True,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "vision_start_token_id": 151652,
    "vision_end_token_id": 151653,
    "vision_token_id": 151654,
    "image_token_id": QWEN25_VL_IMAGE_TOKEN_ID,
    "video_token_id": 151656,
    "torch_dtype": "float32",
    "vision_config": {
        "depth": 2,
        "hidden_act": "silu",
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "in_chans": 3,
        "out_hidden_size": 64,
        "patch_size": QWEN25_VL_PATCH,
        "spatial_merge_size": QWEN25_VL_MERGE,
        "spatial_patch_size": QWEN25_VL_PATCH,
        "temporal_patch_size": 2,
        "tokens_per_second": 2,
        # 112 px windows = 4x4 merged tokens: block 0 attends within windows, block 1 over the whole image.
        "window_size": 112,
        "fullatt_block_indexes": [1],
    },
}

# ---- Gemma 3 (shapes of gemma-3-4b-it, shrunk; token ids and template are the real ones)
GEMMA3_IMAGE_TOKEN_ID = 262144
GEMMA3_IMAGE_SIZE = 112  # 8x8 patches of 14 px
GEMMA3_PATCH = 14
GEMMA3_IMAGE_TOKENS = 16  # the projector average-pools the 8x8 patches 2x2 into 4x4 soft tokens

GEMMA3_CONFIG: dict[str, Any] = {
    "architectures": ["Gemma3ForConditionalGeneration"],
    "model_type": "gemma3",
    "boi_token_index": 255999,
    "eoi_token_index": 256000,
    "image_token_index": GEMMA3_IMAGE_TOKEN_ID,
    "mm_tokens_per_image": GEMMA3_IMAGE_TOKENS,
    # mlx-vlm divides image features by sqrt(hidden_size) before the text model multiplies every embedding
    # by sqrt(text hidden size): equal sizes cancel, as they do in Hugging Face's Gemma 3.
    "hidden_size": 64,
    "eos_token_id": [1, 106],
    "initializer_range": 0.02,
    "torch_dtype": "float32",
    "text_config": {
        "model_type": "gemma3_text",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "query_pre_attn_scalar": 16,
        "rms_norm_eps": 1e-6,
        "rope_local_base_freq": 10000.0,
        "rope_theta": 1000000.0,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
        # Layer 0 slides over a 32-token window, layer 1 is global (the real model: 5 sliding, then 1 global).
        "sliding_window": 32,
        "sliding_window_pattern": 2,
        "max_position_embeddings": 131072,
        "vocab_size": 262208,
        "mm_tokens_per_image": GEMMA3_IMAGE_TOKENS,
    },
    "vision_config": {
        "model_type": "siglip_vision_model",
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "image_size": GEMMA3_IMAGE_SIZE,
        "patch_size": GEMMA3_PATCH,
        "num_channels": 3,
        "layer_norm_eps": 1e-6,
        "vision_use_head": False,
    },
}


# ---- model folders
def write_qwen25_vl(out_dir: str | Path, seed: int = 0, scale: float = 4.0) -> Path:
    """A Qwen2.5-VL folder: 2 text layers of width 64, a 2-block vision tower of width 32, the real vocab."""
    out = _prepare(out_dir)
    config = copy.deepcopy(QWEN25_VL_CONFIG)
    _write_weights(out, config, seed, scale, embed_scale=scale)
    _write_json(out / "config.json", config)
    _write_json(out / "generation_config.json",
                {"bos_token_id": 151643, "eos_token_id": [151645, 151643], "pad_token_id": 151643})
    write_qwen25_vl_tokenizer(out, config["vocab_size"], seed)
    image_processor = {
        "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": "Qwen2_5_VLProcessor",
        "do_convert_rgb": True,
        "do_normalize": True,
        "do_rescale": True,
        "do_resize": True,
        "rescale_factor": 1 / 255,
        "resample": 3,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
        "min_pixels": QWEN25_VL_MIN_PIXELS,
        "max_pixels": QWEN25_VL_MAX_PIXELS,
        "size": {"shortest_edge": QWEN25_VL_MIN_PIXELS, "longest_edge": QWEN25_VL_MAX_PIXELS},
        "patch_size": QWEN25_VL_PATCH,
        "temporal_patch_size": 2,
        "merge_size": QWEN25_VL_MERGE,
    }
    _write_json(out / "preprocessor_config.json", image_processor)
    _write_json(out / "video_preprocessor_config.json",
                dict(image_processor, video_processor_type="Qwen2VLVideoProcessor", fps=2.0,
                     min_frames=4, max_frames=16))
    _write_json(out / "processor_config.json", {"processor_class": "Qwen2_5_VLProcessor"})
    return out


def write_gemma3(out_dir: str | Path, seed: int = 0, scale: float = 4.0, sliding_window: int = 32) -> Path:
    """A Gemma 3 folder: 2 text layers of width 64 (one sliding, one global), a 2-layer SigLIP of width 32.

    The default 32-token window is shorter than most prompts with an image, so the sliding layer's cache
    evicts (mlx-vlm's RotatingKVCache); a window longer than the prompts never does.
    """
    out = _prepare(out_dir)
    config = copy.deepcopy(GEMMA3_CONFIG)
    config["text_config"]["sliding_window"] = sliding_window
    # Gemma multiplies embeddings by sqrt(hidden size) and normalises every sublayer's output, so with
    # MLX's initial norm weights the embedding drowns the layers and the tied head echoes the input token.
    # Its RMSNorm scales by 1 + weight: 3.0 makes the sublayer outputs and the final logits 4x larger.
    _write_weights(out, config, seed, scale, embed_scale=1.0, vector_values={
        "post_attention_layernorm.weight": 3.0,
        "post_feedforward_layernorm.weight": 3.0,
        "language_model.model.norm.weight": 3.0,
    })
    _write_json(out / "config.json", config)
    _write_json(out / "generation_config.json",
                {"bos_token_id": 2, "eos_token_id": [1, 106], "pad_token_id": 0})
    write_gemma3_tokenizer(out, seed)
    _write_json(out / "preprocessor_config.json", {
        "image_processor_type": "Gemma3ImageProcessor",
        "processor_class": "Gemma3Processor",
        "do_convert_rgb": None,
        "do_normalize": True,
        "do_rescale": True,
        "do_resize": True,
        "do_pan_and_scan": None,
        "pan_and_scan_max_num_crops": None,
        "pan_and_scan_min_crop_size": None,
        "pan_and_scan_min_ratio_to_activate": None,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "image_seq_length": GEMMA3_IMAGE_TOKENS,
        "resample": 2,
        "rescale_factor": 1 / 255,
        "size": {"height": GEMMA3_IMAGE_SIZE, "width": GEMMA3_IMAGE_SIZE},
    })
    _write_json(out / "processor_config.json",
                {"image_seq_length": GEMMA3_IMAGE_TOKENS, "processor_class": "Gemma3Processor"})
    return out


# ---- shared writers
def _prepare(out_dir: str | Path) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    return out


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2))


def _write_weights(out: Path, config: dict[str, Any], seed: int, scale: float, embed_scale: float,
                   vector_values: dict[str, float] | None = None) -> None:
    """Build mlx-vlm's Model for `config` as `mlx_vlm.utils.load_model` does, randomise it, save float32.

    `scale` multiplies every matrix but the token embedding (`embed_scale`): peakier next-token
    distributions, so greedy decoding of a random model does not just repeat one token. Matrices MLX
    initialises to ones (Gemma 3's projector) get random values, or every image would project onto one
    direction. `vector_values` sets the 1-D weights whose names end with a key to that value.
    """
    from mlx_vlm.utils import get_model_and_args, update_module_configs

    model_config = copy.deepcopy(config)
    model_config.setdefault("text_config", {})
    model_config.setdefault("vision_config", {})
    model_config.setdefault("audio_config", {})
    arch, _ = get_model_and_args(model_config)
    args = arch.ModelConfig.from_dict(model_config)
    args = update_module_configs(args, arch, model_config, ["text", "vision", "perceiver", "projector", "audio"])
    mx.random.seed(seed)
    model = arch.Model(args)

    def randomise(path: str, param: mx.array) -> mx.array:
        if param.ndim < 2:
            value = next((v for suffix, v in (vector_values or {}).items() if path.endswith(suffix)), None)
            return param if value is None else mx.full(param.shape, value, dtype=param.dtype)
        if path.endswith("embed_tokens.weight"):
            return param * embed_scale
        if bool(mx.all(param == 1)):
            return mx.random.normal(param.shape, scale=scale * param.shape[0] ** -0.5)
        return param * scale

    model.update(tree_map_with_path(randomise, model.parameters()))
    weights = {k: v.astype(mx.float32) for k, v in tree_flatten(model.parameters())}
    if config["model_type"] == "gemma3":
        weights.pop("language_model.lm_head.weight")  # tied: Gemma 3 checkpoints have none, sanitize() adds it
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})


