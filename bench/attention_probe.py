"""Diagnostic: what one forward costs on this backend, by query length and cache offset, warm and at a
never-seen shape. Run it under different MLX settings (e.g. MLX_CUDA_USE_CUDNN_SDPA=0) to compare
attention paths; the settings in effect are printed with the figures.

    python -m bench.attention_probe --random-shape qwen3-0.6b --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time

import mlx.core as mx

from bench.random_model import make_random_model
from engine.kv.batch_cache import cache_arrays, merge_request_caches, new_request_cache
from engine.runner.loader import load_model


def _forward_ms(model, tokens: list[list[int]], cache) -> float:
    start = time.perf_counter()
    logits = model(mx.array(tokens, mx.uint32), cache=cache)[:, -1, :]
    mx.eval(logits, cache_arrays(cache))
    return 1e3 * (time.perf_counter() - start)


class Prober:
    def __init__(self, model, vocab: int) -> None:
        self.model, self.vocab, self.rng = model, vocab, random.Random(0)

    def tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(self.vocab) for _ in range(n)]

    def cache_at(self, offset: int, rows: int = 1):
        caches = []
        for _ in range(rows):
            cache = new_request_cache(self.model)
            for start in range(0, offset, 2048):
                _forward_ms(self.model, [self.tokens(min(2048, offset - start))], cache)
            caches.append(cache)
        return caches[0] if rows == 1 else merge_request_caches(caches)

    def forward(self, offset: int, length: int, rows: int = 1) -> float:
        cache = self.cache_at(offset, rows)
        return _forward_ms(self.model, [self.tokens(length) for _ in range(rows)], cache)

    def ragged(self, offset: int, lengths: list[int]) -> float:
        """Rows of different lengths in one forward, right-padded as the engine's batched prefill does."""
        cache = self.cache_at(offset, len(lengths))
        longest = max(lengths)
        for layer in cache:
            layer.prepare(lengths=lengths, right_padding=[longest - n for n in lengths])
        rows = [self.tokens(n) + [0] * (longest - n) for n in lengths]
        start = time.perf_counter()
        model_out = self.model(mx.array(rows, mx.uint32), cache=cache)[:, -1, :]
        for layer in cache:
            layer.finalize()
        mx.eval(model_out, cache_arrays(cache))
        return 1e3 * (time.perf_counter() - start)

    def warm(self, offset: int, length: int, rows: int = 1, repeat: int = 5) -> float:
        self.forward(offset, length, rows)
        return statistics.median(self.forward(offset, length, rows) for _ in range(repeat))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--random-shape", default="tiny")
    parser.add_argument("--json")
    args = parser.parse_args()
    loaded = load_model(str(make_random_model(tempfile.mkdtemp(prefix="orchard-ap-"), args.random_shape)))
    prober = Prober(loaded.model, loaded.vocab_size - 16)
    prober.warm(0, 8)
    report = {"settings": {k: v for k, v in os.environ.items() if k.startswith("MLX_")}, "shape": args.random_shape}
    warm_cases = [(2048, 1, 1), (2048, 2, 1), (2048, 4, 1), (2048, 16, 1), (0, 16, 1), (0, 512, 1), (0, 2048, 1),
                  (2048, 2048, 1), (6144, 2048, 1), (128, 1, 64), (0, 128, 8), (512, 128, 8)]
    report["warm_ms"] = {f"off{o}_len{n}_rows{r}": round(prober.warm(o, n, r), 2) for o, n, r in warm_cases}
    novel = [(0, 117), (0, 301), (0, 517), (0, 1013), (2048, 16), (2064, 16), (2080, 9), (517, 45), (1000, 700)]
    report["first_vs_again_ms"] = {
        f"off{o}_len{n}": [round(prober.forward(o, n), 1), round(prober.forward(o, n), 1)] for o, n in novel}
    batched = [(0, 119, 3), (66, 33, 2), (1002, 300, 4)]
    report["batched_first_vs_again_ms"] = {
        f"off{o}_len{n}_rows{r}": [round(prober.forward(o, n, r), 1), round(prober.forward(o, n, r), 1)]
        for o, n, r in batched}
    ragged = [(0, [100, 37, 64]), (0, [250, 130]), (300, [80, 41, 17, 5])]
    report["ragged_first_vs_again_ms"] = {
        f"off{o}_lens{'-'.join(map(str, ls))}": [round(prober.ragged(o, ls), 1), round(prober.ragged(o, ls), 1)]
        for o, ls in ragged}
    print(json.dumps(report, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
