"""A tiny random-weight KittenTTS (mlx-audio's kitten_tts architecture and layout) written as a model folder: a
text-to-speech model served by mlx-audio, for the protocol (voices, speed, formats), not for intelligible speech."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

VOICES = ("expr-voice-5-m", "expr-voice-2-f")  # the first is generate()'s default voice


def _config(n_token: int) -> dict:
    return {
        "model_type": "kitten_tts", "hidden_dim": 32, "max_conv_dim": 32, "max_dur": 8, "n_layer": 1, "n_mels": 80,
        "n_token": n_token, "style_dim": 128,  # 128: the model splits a voice row at 128
        "text_encoder_kernel_size": 3, "asr_res_dim": 16, "decoder_out_dim": 32, "sample_rate": 24000,
        "voices_path": "voices.npz", "speed_priors": {}, "voice_aliases": {"default": VOICES[0]},
        "plbert": {"num_hidden_layers": 1, "num_attention_heads": 2, "hidden_size": 32, "intermediate_size": 64,
                   "max_position_embeddings": 512, "embedding_size": 16, "inner_group_num": 1,
                   "num_hidden_groups": 1, "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0,
                   "type_vocab_size": 2, "layer_norm_eps": 1e-12},
        "istftnet": {"resblock_kernel_sizes": [3], "upsample_rates": [10, 6], "upsample_initial_channel": 32,
                     "resblock_dilation_sizes": [[1, 3, 5]], "upsample_kernel_sizes": [20, 12],
                     "gen_istft_n_fft": 20, "gen_istft_hop_size": 5},
    }


def write_tiny_kitten(folder: Path, seed: int = 0) -> Path:
    from mlx_audio.tts.models.kitten_tts import Model, ModelConfig
    from mlx_audio.tts.models.kitten_tts.kitten_tts import TextCleaner

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = _config(len(TextCleaner().word_index_dictionary) + 1)
    mx.random.seed(seed)
    weights = dict(tree_flatten(Model(ModelConfig.from_dict(config)).parameters()))
    # Weight-normed convs start with all-ones directions: every channel alike, and the iSTFT's exp() overflows.
    weights.update({k: mx.random.normal(v.shape) for k, v in weights.items() if k.endswith("weight_v")})
    weights["decoder.generator.conv_post.weight_g"] *= 0.1
    mx.save_safetensors(str(folder / "model.safetensors"), weights)
    (folder / "config.json").write_text(json.dumps(config))
    rng = np.random.default_rng(seed)
    np.savez(folder / "voices.npz", **{v: (0.1 * rng.standard_normal((64, 256))).astype(np.float32) for v in VOICES})
    return folder
