"""Rebuild a Hugging Face `tokenizer.json` from a GGUF's tokenizer metadata, without torch.

Only byte-level BPE vocabularies (`tokenizer.ggml.model == "gpt2"`) are supported. The GGUF does not
store the pre-tokenizer itself, only llama.cpp's name for it (`tokenizer.ggml.pre`), so each known
name maps to the `tokenizers` pipeline that reproduces llama.cpp's split regexes.
"""

from __future__ import annotations

from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

# llama.cpp token types (llama_token_type): 3 = CONTROL (special), 4 = USER_DEFINED (added, not special).
_CONTROL = 3
_USER_DEFINED = 4

# llama.cpp splits digits one by one before the GPT-2 regex for these vocabularies.
_DIGIT_SPLIT_PRES = {"smollm", "starcoder", "refact", "codeshell"}
# Plain GPT-2 regex.
_GPT2_PRES = {"gpt-2", "gpt2", "default", "phi-2", "jina-es", "jina-de"}
# Llama 3 style regex: digits in groups of up to 3, case-insensitive contractions.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_PRES = {"llama3", "llama-v3", "llama-bpe", "smaug-bpe", "dbrx", "falcon3"}


def build_tokenizer(meta: dict[str, Any]) -> Tokenizer:
    """The fast tokenizer described by a GGUF's `tokenizer.ggml.*` metadata."""
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(
            f"unsupported GGUF tokenizer model {kind!r}: only byte-level BPE ('gpt2') can be converted"
        )
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    merges = [_split_merge(m) for m in meta.get("tokenizer.ggml.merges", [])]
    vocab = {token: index for index, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ValueError("GGUF vocabulary has duplicate tokens")

    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    tokenizer.pre_tokenizer = _pre_tokenizer(meta.get("tokenizer.ggml.pre", "default"))
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = _post_processor(meta, tokens)
    _add_special_tokens(tokenizer, tokens, _token_types(meta, len(tokens)))
    return tokenizer


def _split_merge(merge: str) -> tuple[str, str]:
    # Byte-level tokens spell a space as "Ġ", so a merge holds exactly one separating space.
    left, sep, right = merge.partition(" ")
    if not sep or not left or not right:
        raise ValueError(f"malformed GGUF merge {merge!r}")
    return left, right


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    if pre in _DIGIT_SPLIT_PRES:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in _GPT2_PRES:
        return byte_level
    if pre in _LLAMA3_PRES:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    raise ValueError(f"unsupported GGUF pre-tokenizer {pre!r} (tokenizer.ggml.pre)")


def _post_processor(meta: dict[str, Any], tokens: list[str]) -> processors.PostProcessor:
    byte_level = processors.ByteLevel(trim_offsets=False)
    bos_id = meta.get("tokenizer.ggml.bos_token_id")
    if not meta.get("tokenizer.ggml.add_bos_token", False) or bos_id is None:
        return byte_level
    # llama.cpp prepends BOS for these vocabularies; the HF equivalent is a template post-processor.
    bos = tokens[int(bos_id)]
    template = processors.TemplateProcessing(
        single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1", special_tokens=[(bos, int(bos_id))]
    )
    return processors.Sequence([byte_level, template])


def _token_types(meta: dict[str, Any], count: int) -> list[int]:
    types = meta.get("tokenizer.ggml.token_type")
    if types is None:
        return [1] * count
    values = types.tolist() if hasattr(types, "tolist") else list(types)
    if len(values) != count:
        raise ValueError("tokenizer.ggml.token_type length does not match the vocabulary")
    return [int(v) for v in values]


def _add_special_tokens(tokenizer: Tokenizer, tokens: list[str], types: list[int]) -> None:
    # Without these, "<|im_start|>" in a rendered chat template would be cut into byte pieces.
    special = [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if k == _CONTROL]
    user = [AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types) if k == _USER_DEFINED]
    if special:
        tokenizer.add_special_tokens(special)
    if user:
        tokenizer.add_tokens(user)


def special_token_strings(meta: dict[str, Any]) -> dict[str, str]:
    """`bos_token`, `eos_token`, `unk_token`, `pad_token` as strings, for tokenizer_config.json."""
    tokens = meta["tokenizer.ggml.tokens"]
    keys = {
        "bos_token": "tokenizer.ggml.bos_token_id",
        "eos_token": "tokenizer.ggml.eos_token_id",
        "unk_token": "tokenizer.ggml.unknown_token_id",
        "pad_token": "tokenizer.ggml.padding_token_id",
    }
    found = {}
    for name, key in keys.items():
        token_id = meta.get(key)
        if token_id is not None and 0 <= int(token_id) < len(tokens):
            found[name] = tokens[int(token_id)]
    return found


def tokenizer_config(meta: dict[str, Any], model_max_length: int) -> dict[str, Any]:
    """tokenizer_config.json: the class that loads tokenizer.json as-is, special tokens, chat template."""
    config: dict[str, Any] = {
        # The generic fast class keeps our pre-tokenizer; a model-specific class may rebuild its own.
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        **special_token_strings(meta),
    }
    template = meta.get("tokenizer.chat_template")
    if isinstance(template, str) and template:
        config["chat_template"] = template
    return config
