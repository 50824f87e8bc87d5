"""A tiny random-weight FLUX.2 [klein] model folder in the Hugging Face layout (transformer/, text_encoder/, vae/,
tokenizer/ with their config.json), with weights in mflux's own saved format.

The transformer (1 + 1 blocks, 2 heads) and text encoder (hidden size 64; 28 layers, since the prompt encoder reads
layers 9, 18 and 27) are tiny; mflux's FLUX.2 VAE has fixed dimensions (84 M parameters, written in bfloat16:
168 MB). A 64x64 image in 2 steps takes ~2 s on 2 cores with OpenBLAS. write_klein also writes FLUX.2 [klein] 4B's own
shape (the GPU bench's, bench/images.py).
"""

from __future__ import annotations

import json
from pathlib import Path

# Every matrix a multiple of 64 wide, so that mflux can quantize it (Bodega's default for image models: 8 bits).
TRANSFORMER = dict(num_layers=1, num_single_layers=1, num_attention_heads=2, attention_head_dim=32,
                   axes_dims_rope=[8, 8, 8, 8], joint_attention_dim=192)
TEXT_ENCODER = dict(hidden_size=64, num_hidden_layers=28, num_attention_heads=2, num_key_value_heads=1,
                    intermediate_size=128, head_dim=32, max_position_embeddings=1024)
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def write_tokenizer(folder: Path) -> int:
    """A byte-level BPE tokenizer trained on a few words, with Qwen's special tokens and a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(["a puffin standing on a cliff", "user assistant system", "a red dragon"] * 10,
                                  trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "Qwen2Tokenizer", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "model_max_length": 512, "chat_template": CHAT_TEMPLATE}))
    return tokenizer.get_vocab_size()


# FLUX.2 [klein] 4B's own dimensions (mflux's registry entry and Qwen3-4B's config): the GPU bench's random model.
KLEIN_4B = (dict(num_layers=5, num_single_layers=20, num_attention_heads=24, attention_head_dim=128,
                 axes_dims_rope=[32, 32, 32, 32], joint_attention_dim=7680),
            dict(hidden_size=2560, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                 intermediate_size=9728, head_dim=128, max_position_embeddings=40960))
SHAPES = {"tiny": (TRANSFORMER, TEXT_ENCODER), "klein-4b": KLEIN_4B}


def write_tiny_klein(folder: Path, seed: int = 0) -> Path:
    return write_klein(folder, "tiny", seed)


def write_klein(folder: Path, shape: str, seed: int = 0) -> Path:
    """A random FLUX.2 [klein] of one of SHAPES, in bfloat16."""
    import mlx.core as mx
    from mflux.models.flux2.model.flux2_text_encoder.qwen3_text_encoder import Qwen3TextEncoder
    from mflux.models.flux2.model.flux2_transformer.transformer import Flux2Transformer
    from mflux.models.flux2.model.flux2_vae.vae import Flux2VAE
    from mlx.utils import tree_flatten

    transformer, text_encoder = SHAPES[shape]
    vocab_size = write_tokenizer(folder / "tokenizer")
    text_encoder = dict(text_encoder, vocab_size=vocab_size)
    mx.random.seed(seed)
    components = {
        "transformer": (lambda: Flux2Transformer(**dict(transformer, axes_dims_rope=tuple(transformer["axes_dims_rope"]))),
                        transformer),
        "text_encoder": (lambda: Qwen3TextEncoder(**text_encoder), text_encoder),
        "vae": (Flux2VAE, {}),
    }
    metadata = {"mflux_version": "0.24.0", "quantization_level": "None"}
    for name, (build, config) in components.items():  # one component in memory at a time
        (folder / name).mkdir(parents=True, exist_ok=True)
        (folder / name / "config.json").write_text(json.dumps(config))
        weights = {key: value.astype(mx.bfloat16) if value.dtype == mx.float32 else value
                   for key, value in tree_flatten(build().parameters())}
        mx.save_safetensors(str(folder / name / "0.safetensors"), weights, metadata=metadata)
        del weights
    return folder
