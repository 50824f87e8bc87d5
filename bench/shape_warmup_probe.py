"""Diagnostic: cost of the first forward at a new prefill shape (new prompt length / cache offset),
with mlx-lm's plain KVCache ("causal" mask) vs a one-row batched cache (array mask).

    python -m bench.shape_warmup_probe --random-shape qwen3-0.6b
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time

import mlx.core as mx

from bench.random_model import make_random_model
from engine.kv.batch_cache import cache_arrays, extract_request_cache, merge_request_caches, new_request_cache
from engine.runner.loader import load_model


def timed_forward(model, tokens: list[int], cache) -> float:
    start = time.perf_counter()
    logits = model(mx.array([tokens], mx.uint32), cache=cache)[:, -1, :]
    mx.eval(logits, cache_arrays(cache))
    return 1e3 * (time.perf_counter() - start)


def probe(model, vocab: int, batched: bool, lengths: list[tuple[int, int]]) -> None:
    rng = random.Random(1)
    for offset, length in lengths:
        cache = new_request_cache(model)
        if offset:
            timed_forward(model, [rng.randrange(vocab) for _ in range(offset)], cache)
        if batched:
            cache = merge_request_caches([cache])
        tokens = [rng.randrange(vocab) for _ in range(length)]
        first = timed_forward(model, tokens, cache)
        if batched:
            cache = extract_request_cache(cache, 0)
        again_cache = new_request_cache(model)
        if offset:
            timed_forward(model, [rng.randrange(vocab) for _ in range(offset)], again_cache)
        if batched:
            again_cache = merge_request_caches([again_cache])
        again = timed_forward(model, tokens, again_cache)
        kind = "batched(array mask)" if batched else "plain(causal)"
        print(f"{kind:20s} offset {offset:5d} len {length:5d}: first {first:8.1f} ms, same shape again {again:7.1f} ms")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--random-shape", default="tiny")
    args = parser.parse_args()
    loaded = load_model(str(make_random_model(tempfile.mkdtemp(prefix="orchard-sw-"), args.random_shape)))
    model, vocab = loaded.model, loaded.vocab_size - 16
    timed_forward(model, [1, 2, 3], new_request_cache(model))
    shapes = [(0, 117), (0, 301), (0, 517), (64, 33), (517, 45), (1000, 700), (2048, 16), (2064, 16)]
    probe(model, vocab, batched=False, lengths=shapes)
    shapes = [(0, 119), (0, 303), (0, 519), (66, 33), (519, 45), (1002, 700), (2050, 16), (2066, 16)]
    probe(model, vocab, batched=True, lengths=shapes)


if __name__ == "__main__":
    main()
