"""Random-weight models of real architectures, loadable with ``mlx_lm.load``, and their tokenizers.

Throughput does not depend on weight values, so benchmarks on machines without
the Hugging Face Hub build a model of the right shape in place (seconds on a GPU).

    python -m tests.support.random_model OUT --shape qwen3-0.6b [--bits 4] [--dtype bfloat16] [--byte-tokenizer]

Two tokenizers cover the whole vocabulary, with the ChatML specials at the top three ids:
- `write_tokenizer` (the default): WordLevel, word "tN" is token N, so a K-word prompt is K tokens and
  the load generator counts streamed tokens as words;
- `write_byte_level_tokenizer` (--byte-tokenizer): a synthetic byte-level BPE (256 bytes, JSON fragments,
  digit groups, pseudo-words) whose tokens spell real bytes, for structured output, whose masks depend on them.
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import time
from pathlib import Path
from typing import Any, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map_with_path
from mlx_lm.utils import _get_classes, quantize_model, save_config, save_model

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # the top three ids

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

SHAPES: dict[str, dict[str, Any]] = {
    "qwen3-0.6b": {
        "model_type": "qwen3",
        "architectures": ["Qwen3ForCausalLM"],
        "hidden_size": 1024,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "intermediate_size": 3072,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 40960,
    },
    "qwen3-4b": {
        "model_type": "qwen3",
        "architectures": ["Qwen3ForCausalLM"],
        "hidden_size": 2560,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "intermediate_size": 9728,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 40960,
    },
    "qwen3-8b": {
        "model_type": "qwen3",
        "architectures": ["Qwen3ForCausalLM"],
        "hidden_size": 4096,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "intermediate_size": 12288,
        "vocab_size": 151936,
        "tie_word_embeddings": False,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 40960,
    },
    "llama-3.1-8b": {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "intermediate_size": 14336,
        "vocab_size": 128256,
        "tie_word_embeddings": False,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 131072,
        "attention_bias": False,
        "mlp_bias": False,
    },
    "llama-3.2-1b": {  # Llama 3.1's tokenizer: the 8B shape's draft model
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 2048,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "intermediate_size": 8192,
        "vocab_size": 128256,
        "tie_word_embeddings": True,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 131072,
        "attention_bias": False,
        "mlp_bias": False,
    },
    "tiny": {
        "model_type": "qwen3",
        "architectures": ["Qwen3ForCausalLM"],
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "intermediate_size": 128,
        "vocab_size": 512,
        "tie_word_embeddings": True,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096,
    },
}
# Small enough for the CPU, with the 64-wide heads a quantized KV cache needs (kv_group_size 64).
SHAPES["small-hd64"] = {**SHAPES["tiny"], "hidden_size": 256, "num_hidden_layers": 4, "head_dim": 64,
                        "intermediate_size": 512}

QUANT_GROUP_SIZE = 64


def model_config(shape: str, dtype: str) -> dict[str, Any]:
    """The HF-style config.json for a shape, with special-token ids at the top of the vocab."""
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; choose from {sorted(SHAPES)}")
    config = copy.deepcopy(SHAPES[shape])
    vocab = config["vocab_size"]
    config.update(
        bos_token_id=vocab - 3,  # <|endoftext|>, as Qwen does
        eos_token_id=vocab - 1,  # <|im_end|>
        torch_dtype=dtype,
    )
    return config


def _init_param(path: str, param: mx.array, dtype: mx.Dtype) -> mx.array:
    """Norm scales 1, biases 0, matrices N(0, 1/fan_in) so activations and logits stay O(1)."""
    if "norm" in path:
        return mx.ones(param.shape, dtype=dtype)
    if path.endswith("bias"):
        return mx.zeros(param.shape, dtype=dtype)
    std = param.shape[-1] ** -0.5
    return mx.random.normal(param.shape, dtype=dtype, scale=std)


def build_random_model(config: dict[str, Any], dtype: str, seed: int) -> nn.Module:
    """Instantiate mlx-lm's class for the config with lazy random weights (nothing computed yet)."""
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    mx.random.seed(seed)
    mx_dtype = getattr(mx, dtype)
    # Replacing MLX's default (lazy, fp32) init before anything is evaluated means each
    # weight is materialised exactly once, in the target dtype, when its shard is saved.
    model.update(tree_map_with_path(lambda p, w: _init_param(p, w, mx_dtype), model.parameters()))
    return model


def write_tokenizer(out_dir: Path, vocab_size: int, byte_level_decoder: bool = False) -> None:
    """A WordLevel tokenizer with one word per id ("t0", "t1", ...) so every id decodes.

    With `byte_level_decoder`, tokens decode like a byte-level BPE vocabulary's (Qwen, Llama 3:
    concatenated, no spaces), so servers detokenize it the way they do the real models'.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    num_words = vocab_size - len(SPECIAL_TOKENS)
    vocab = {f"t{i}": i for i in range(num_words)}
    vocab.update({tok: num_words + i for i, tok in enumerate(SPECIAL_TOKENS)})
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<|endoftext|>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))  # already in vocab: ids stay at the top
    if byte_level_decoder:
        tokenizer.decoder = decoders.ByteLevel()
    tokenizer.save(str(out_dir / "tokenizer.json"))  # without a decoder, tokens are joined with spaces
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": "<|endoftext|>",
        "model_max_length": 131072,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHATML_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    special_map = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "unk_token": "<|endoftext|>"}
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2))


# ---- the byte-level tokenizer (structured output needs tokens that spell real bytes)
JSON_FRAGMENTS = ['{"', '"}', '":', '": ', '", "', '","', ', "', '{ "', '" }', "[{", "}]", "},", '": "', "true",
                  "false", "null", " true", " false", " null", "\n", "  ", "    ", "\n  ", '\\"', "\\n"]
LETTERS = "abcdefghijklmnopqrstuvwxyz"


def _pieces(count: int, seed: int) -> list[bytes]:
    """`count` distinct byte strings: bytes, JSON fragments, digit groups, then pseudo-words."""
    pieces: list[bytes] = []
    seen: set[bytes] = set()

    def add(piece: bytes) -> None:
        if piece not in seen:
            seen.add(piece)
            pieces.append(piece)

    for piece in [bytes([b]) for b in range(256)] + [f.encode() for f in JSON_FRAGMENTS]:
        add(piece)
    for number in range(10, 1000):
        add(str(number).encode())
    rng = random.Random(seed)
    while len(pieces) < count:
        word = "".join(rng.choice(LETTERS) for _ in range(rng.randint(2, 9)))
        for variant in (word, " " + word, word.capitalize(), " " + word.capitalize()):
            add(variant.encode())
    return pieces[:count]


def write_byte_level_tokenizer(out_dir: Path, vocab_size: int, seed: int = 0) -> Path:
    """Replaces the folder's tokenizer files with a byte-level BPE of `vocab_size` tokens (no merges: text
    encodes byte by byte, every id decodes)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from engine.token_bytes import bytes_to_unicode  # GPT-2's byte -> printable character map

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    to_unicode = bytes_to_unicode()
    num_pieces = vocab_size - len(SPECIAL_TOKENS)
    vocab = {"".join(to_unicode[b] for b in piece): i for i, piece in enumerate(_pieces(num_pieces, seed))}
    vocab.update({token: num_pieces + i for i, token in enumerate(SPECIAL_TOKENS)})
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    tokenizer.save(str(out_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "model_max_length": 131072,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHATML_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    special_map = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2))
    return out_dir


# ---- the model folder
def make_random_model(
    out_dir: str | Path,
    shape: str = "qwen3-0.6b",
    dtype: str = "bfloat16",
    quantize_bits: Optional[int] = None,
    seed: int = 0,
) -> Path:
    """Write config.json, safetensors and a full-vocabulary tokenizer into out_dir."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = model_config(shape, dtype)
    model = build_random_model(config, dtype, seed)
    if quantize_bits:
        # mlx-lm's own helper, so the "quantization" entry matches what mlx_lm.load expects.
        model, config = quantize_model(model, config, QUANT_GROUP_SIZE, quantize_bits)
    # donate_model frees each shard after writing: the model is never held twice.
    save_model(out, model, donate_model=True)
    save_config(config, out / "config.json")
    write_tokenizer(out, config["vocab_size"], byte_level_decoder=True)
    return out


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="output folder")
    parser.add_argument("--shape", default="qwen3-0.6b", choices=sorted(SHAPES))
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--bits", type=int, default=None, help="quantize (affine, group 64)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--byte-tokenizer", action="store_true", help="the byte-level BPE tokenizer (structured output)")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    path = make_random_model(args.out, args.shape, args.dtype, args.bits, args.seed)
    if args.byte_tokenizer:
        write_byte_level_tokenizer(path, model_config(args.shape, args.dtype)["vocab_size"], args.seed)
    size = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
    print(f"wrote {path} ({size / 2**20:.1f} MiB) in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
