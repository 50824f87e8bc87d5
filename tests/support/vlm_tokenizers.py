"""Tokenizers and chat templates of the tiny VLM folders (tests/support/tiny_vlms.py).

Each tokenizer is a BPE without merges over the model's whole vocabulary, with the family's real
pipeline, so any text encodes (character by character, or byte by byte) and every id decodes:
- Qwen2.5-VL: Qwen2's byte-level pipeline (NFC, its split regex, GPT-2 byte map); tokenizer class
  Qwen2Tokenizer, eos <|im_end|>, pad <|endoftext|>, no bos.
- Gemma 3: Gemma's SentencePiece-style pipeline (spaces as "▁", byte fallback to <0xNN>, <bos> added);
  tokenizer class GemmaTokenizer with its boi/eoi/image tokens.
The special tokens sit at their real ids, and the chat templates are the real checkpoints'.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# The real Qwen2.5-VL special tokens and chat template, as the benchmarks' random model writes them.
from tests.support.random_vlm import QWEN2_5_VL_CHAT_TEMPLATE, QWEN_VL_SPECIAL_TOKENS

QWEN25_VL_SPECIAL_TOKENS = QWEN_VL_SPECIAL_TOKENS
# Tool-call and FIM markers are plain added tokens in Qwen's tokenizer, not "special" (they are not skipped).
QWEN25_VL_NOT_SPECIAL = {"<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>",
                         "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"}
# Qwen2's pre-tokenizer split (transformers' Qwen2Tokenizer uses the same).
QWEN_SPLIT_REGEX = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
                    r"""\s*[\r\n]+|\s+(?!\S)|\s+""")

QWEN25_VL_CHAT_TEMPLATE = QWEN2_5_VL_CHAT_TEMPLATE

GEMMA3_SPECIAL_TOKENS = {
    0: "<pad>",
    1: "<eos>",
    2: "<bos>",
    3: "<unk>",
    4: "<mask>",
    105: "<start_of_turn>",
    106: "<end_of_turn>",
    255999: "<start_of_image>",
    256000: "<end_of_image>",
    262144: "<image_soft_token>",
}
# The chat_template of google/gemma-3-4b-it.
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}\n"
    "{%- if messages[0]['role'] == 'system' -%}\n"
    "    {%- if messages[0]['content'] is string -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}\n"
    "    {%- else -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}\n"
    "    {%- endif -%}\n"
    "    {%- set loop_messages = messages[1:] -%}\n"
    "{%- else -%}\n"
    "    {%- set first_user_prefix = \"\" -%}\n"
    "    {%- set loop_messages = messages -%}\n"
    "{%- endif -%}\n"
    "{%- for message in loop_messages -%}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    "        {{ raise_exception(\"Conversation roles must alternate user/assistant/user/assistant/...\") }}\n"
    "    {%- endif -%}\n"
    "    {%- if (message['role'] == 'assistant') -%}\n"
    "        {%- set role = \"model\" -%}\n"
    "    {%- else -%}\n"
    "        {%- set role = message['role'] -%}\n"
    "    {%- endif -%}\n"
    "    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else \"\") }}\n"
    "    {%- if message['content'] is string -%}\n"
    "        {{ message['content'] | trim }}\n"
    "    {%- elif message['content'] is iterable -%}\n"
    "        {%- for item in message['content'] -%}\n"
    "            {%- if item['type'] == 'image' -%}\n"
    "                {{ '<start_of_image>' }}\n"
    "            {%- elif item['type'] == 'text' -%}\n"
    "                {{ item['text'] | trim }}\n"
    "            {%- endif -%}\n"
    "        {%- endfor -%}\n"
    "    {%- else -%}\n"
    "        {{ raise_exception(\"Invalid content type\") }}\n"
    "    {%- endif -%}\n"
    "    {{ '<end_of_turn>\n' }}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "    {{'<start_of_turn>model\n'}}\n"
    "{%- endif -%}\n"
)


def write_qwen25_vl_tokenizer(out: Path, vocab_size: int, seed: int = 0) -> None:
    """tokenizer.json, tokenizer_config.json, special_tokens_map.json and chat_template.json of Qwen2.5-VL.

    Every id below `vocab_size` decodes; the real tokenizer stops at 151664 and leaves the embedding's top
    271 rows without tokens."""
    specials = {token: token not in QWEN25_VL_NOT_SPECIAL for token in QWEN25_VL_SPECIAL_TOKENS.values()}
    _write_byte_level_tokenizer(out, vocab_size, QWEN25_VL_SPECIAL_TOKENS, specials, seed)
    tokenizer_config = {
        "tokenizer_class": "Qwen2Tokenizer",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "errors": "replace",
        "split_special_tokens": False,
        "model_max_length": 131072,
        "clean_up_tokenization_spaces": False,
        "add_bos_token": False,
        "add_prefix_space": False,
        "chat_template": QWEN25_VL_CHAT_TEMPLATE,
    }
    _write_json(out / "tokenizer_config.json", tokenizer_config)
    _write_json(out / "special_tokens_map.json", {
        "additional_special_tokens": [t for t, special in specials.items() if special],
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
    })
    _write_json(out / "chat_template.json", {"chat_template": QWEN25_VL_CHAT_TEMPLATE})


def write_gemma3_tokenizer(out: Path, seed: int = 0) -> None:
    """The same files for Gemma 3; the tokenizer ends at <image_soft_token> (id 262144) as the real one does."""
    _write_sentencepiece_tokenizer(out, max(GEMMA3_SPECIAL_TOKENS) + 1, GEMMA3_SPECIAL_TOKENS, seed, bos_token="<bos>")
    tokenizer_config = {
        "tokenizer_class": "GemmaTokenizer",
        "bos_token": "<bos>",
        "eos_token": "<eos>",
        "pad_token": "<pad>",
        "unk_token": "<unk>",
        "add_bos_token": True,
        "add_eos_token": False,
        "spaces_between_special_tokens": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1000000000000000019884624838656,
        "padding_side": "left",
        "boi_token": "<start_of_image>",
        "eoi_token": "<end_of_image>",
        "image_token": "<image_soft_token>",
        "extra_special_tokens": {
            "boi_token": "<start_of_image>",
            "eoi_token": "<end_of_image>",
            "image_token": "<image_soft_token>",
        },
        "chat_template": GEMMA3_CHAT_TEMPLATE,
    }
    _write_json(out / "tokenizer_config.json", tokenizer_config)
    _write_json(out / "special_tokens_map.json", {
        "boi_token": "<start_of_image>",
        "eoi_token": "<end_of_image>",
        "image_token": "<image_soft_token>",
        "bos_token": "<bos>",
        "eos_token": "<eos>",
        "pad_token": "<pad>",
        "unk_token": "<unk>",
    })
    _write_json(out / "chat_template.json", {"chat_template": GEMMA3_CHAT_TEMPLATE})


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2))


def _write_byte_level_tokenizer(out: Path, vocab_size: int, special_tokens: dict[int, str],
                                is_special: dict[str, bool], seed: int) -> None:
    """Qwen's pipeline (NFC, its split regex, GPT-2 byte-level) over a vocabulary without merges:
    the specials at their ids, byte-level pieces everywhere else."""
    from tokenizers import (
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
    )

    from tests.support.random_model import _pieces
    from engine.token_bytes import bytes_to_unicode

    to_unicode = bytes_to_unicode()
    free_ids = [i for i in range(vocab_size) if i not in special_tokens]
    pieces = ("".join(to_unicode[b] for b in piece) for piece in _pieces(len(free_ids), seed))
    vocab = dict(zip(pieces, free_ids))
    vocab.update({token: i for i, token in special_tokens.items()})
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_SPLIT_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    _add_special_tokens(tokenizer, special_tokens, is_special)
    tokenizer.save(str(out / "tokenizer.json"))


def _write_sentencepiece_tokenizer(out: Path, vocab_size: int, special_tokens: dict[int, str], seed: int,
                                   bos_token: str) -> None:
    """Gemma's pipeline (spaces as "▁", BPE with byte fallback, <bos> prepended) over a vocabulary without
    merges: the specials at their ids, the 256 <0xNN> byte tokens, "▁", ASCII characters, then pseudo-words."""
    from tokenizers import (
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
    )

    from tests.support.random_model import _pieces

    free_ids = [i for i in range(vocab_size) if i not in special_tokens]
    pieces = [f"<0x{b:02X}>" for b in range(256)] + ["▁", "\n", "\t"] + [chr(c) for c in range(33, 127)]
    seen = set(pieces)
    for piece in _pieces(len(free_ids), seed)[256:]:
        text = piece.decode("utf-8", errors="replace").replace(" ", "▁")
        if text not in seen:
            seen.add(text)
            pieces.append(text)
    vocab = dict(zip(pieces, free_ids))
    filler = (f"<unused{n}>" for n in range(len(free_ids)))
    vocab.update({next(filler): i for i in free_ids[len(pieces):]})
    vocab.update({token: i for i, token in special_tokens.items()})
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    tokenizer.normalizer = normalizers.Replace(" ", "▁")
    tokenizer.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    _add_special_tokens(tokenizer, special_tokens, {token: True for token in special_tokens.values()})
    bos_id = next(i for i, token in special_tokens.items() if token == bos_token)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos_token} $A", pair=f"{bos_token} $A {bos_token} $B", special_tokens=[(bos_token, bos_id)])
    tokenizer.save(str(out / "tokenizer.json"))


def _add_special_tokens(tokenizer: Any, special_tokens: dict[int, str], is_special: dict[str, bool]) -> None:
    from tokenizers import AddedToken

    tokenizer.add_tokens([AddedToken(token, special=is_special[token], normalized=False)
                          for _, token in sorted(special_tokens.items())])
