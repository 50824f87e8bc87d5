"""What the serving and graph tests share: tiny model folders and bounded polling."""

from __future__ import annotations

import json
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from tests.support.tiny_models import LLAMA, write_model, write_wordlevel_tokenizer

VOCAB_SIZE = 256
# Long enough that a stream the tests hold open cannot finish on its own (tiny models decode ~1,000 tok/s).
TINY_CONTEXT = 65536


@dataclass
class TinyModels:
    alpha: Path
    beta: Path
    gamma: Path
    broken: Path  # has config.json, but names an architecture mlx-lm does not know


def write_tiny_models(root: Path) -> TinyModels:
    """2-layer llamas with peaky random weights (distinct greedy tokens), ChatML template, 256 words."""
    tokenizer = write_wordlevel_tokenizer(root / "tokenizer", vocab_size=VOCAB_SIZE)
    config = dict(LLAMA, vocab_size=VOCAB_SIZE, max_position_embeddings=TINY_CONTEXT)
    models = {name: write_model(root / name, config, tokenizer, seed=seed, scale=3.0)
              for seed, name in enumerate(("alpha", "beta", "gamma"))}
    broken = write_model(root / "broken", config, tokenizer, seed=3)
    (broken / "config.json").write_text(json.dumps(dict(config, model_type="no_such_architecture")))
    return TinyModels(broken=broken, **models)



def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_until(condition, timeout_s: float, interval_s: float = 0.2, what: str = "condition"):
    """Poll until condition() returns something truthy; bounded, so a broken server fails the test."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(interval_s)
