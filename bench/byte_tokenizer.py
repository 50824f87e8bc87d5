"""A synthetic byte-level BPE tokenizer of any size, for random models that need real token bytes.

Structured-output masks depend on what each token spells, so the WordLevel tokenizer of
random_model.py ("t0", "t1", ...) cannot stand in for a real one. This one has the 256 byte
tokens, JSON fragments, digit groups and pseudo-words (with and without a leading space, as
GPT-2-style vocabularies do) up to the model's vocabulary size, and the same three ChatML
specials at the top ids. It has no merges: text encodes byte by byte, every id decodes.

    python -m bench.byte_tokenizer OUT --vocab-size 151936
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from bench.random_model import CHATML_TEMPLATE, SPECIAL_TOKENS
from engine.output.detokenizer import bytes_to_unicode

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
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--vocab-size", type=int, required=True)
    args = parser.parse_args(argv)
    write_byte_level_tokenizer(Path(args.out), args.vocab_size)


if __name__ == "__main__":
    main()
