"""Diagnostic: what each part of a burst's prefill step costs (in process, warm, each part closed by mx.eval).

    python -m bench.step_parts_probe --random-shape qwen3-0.6b --rows 8,32 --tokens 512,517 --json out.json

For N prompts of T tokens, as ModelRunner runs them (padded shapes on a GPU):
  forward       run_prefill (with the model's head split where it has one, as the runner), then its logits
                and the padded forwards' batched KV evaluated
  forward_whole the same without the head split (full logits, or bodies then a one-token tail forward)
  row_views     then each request's cache (row views of the batch) evaluated, as _sample_first_tokens does
  sample        greedy first tokens of the completing rows, read back
  prefix_insert the prompts' blocks into a fresh prefix cache (KVBlockStore.insert_rows), evaluated
                (prefix_insert_cpu: until the copies are queued)
  join_empty    the N rows appended to an empty decode batch (plain_batch.append_rows), evaluated
  join_onto     the same rows appended to a batch of --decode-rows rows decoding at T + 64 tokens
  decode        one decode forward of that joined batch, logits evaluated
  raw_body      one bare mlx-lm forward [N, T] into a fresh cache, KV evaluated (the floor)
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from bench.engine_throughput import machine_info
from bench.random_model import make_random_model
from engine import Request, SamplingParams
from engine.kv import plain_batch
from engine.kv.batch_cache import cache_arrays, new_request_cache
from engine.kv.block_store import KVBlockStore, buffer_cache_limit_bytes
from engine.kv.prefix_cache import PrefixCache
from engine.runner.head_split import head_split
from engine.runner.loader import load_model
from engine.runner.prefill import run_prefill
from engine.scheduler.output import PrefillChunk


def _ms(fn: Callable[[], object]) -> float:
    started = time.perf_counter()
    fn()
    return 1e3 * (time.perf_counter() - started)


def _prompts(rows: int, tokens: int, vocab: int, salt: int) -> list[list[int]]:
    return [[(salt + 7 + 31 * r + 13 * i) % (vocab - 16) for i in range(tokens)] for r in range(rows)]


def _prefill(model, prompts: list[list[int]], vocab: int, pad: bool, split=None):
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    requests = [Request(f"p{i}", p, params) for i, p in enumerate(prompts)]
    chunks = [PrefillChunk(r, 0, len(r.prompt_token_ids)) for r in requests]
    caches = [new_request_cache(model) for _ in chunks]
    return run_prefill(model, chunks, caches, len(chunks) if pad else None, vocab, split)


def _joiners(result) -> list[plain_batch.RowBlock]:
    """The prefilled rows as the runner hands them to the decode batch: blocks of a padded forward's batch."""
    placed = result.row_blocks()
    blocks = [placed.get(i) or plain_batch.RowBlock.of_request(c) for i, c in enumerate(result.caches)]
    return plain_batch.merged_blocks(blocks)


def _decode_batch(model, rows: int, tokens: int, vocab: int, pad: bool):
    """A plain decode batch of `rows` rows holding `tokens` positions each."""
    result = _prefill(model, _prompts(rows, tokens, vocab, salt=99), vocab, pad)
    mx.eval(*(cache_arrays(c) for c in result.caches))
    caches, padding = plain_batch.append_rows([], [], _joiners(result))
    mx.eval(*cache_arrays(caches))
    return caches, padding


def _timed_prefill(model, prompts: list[list[int]], vocab: int, pad: bool, split) -> tuple[float, object]:
    started = time.perf_counter()
    result = _prefill(model, prompts, vocab, pad, split)
    mx.eval(result.last_logits, *(cache_arrays(s.caches) for s in result.shared))
    return 1e3 * (time.perf_counter() - started), result


def one_round(model, rows: int, tokens: int, vocab: int, pad: bool, decode_rows: int, split) -> dict[str, float]:
    prompts = _prompts(rows, tokens, vocab, salt=rows)
    out: dict[str, float] = {}
    out["forward_whole"], _ = _timed_prefill(model, prompts, vocab, pad, None)
    out["forward"], result = _timed_prefill(model, prompts, vocab, pad, split)
    out["row_views"] = _ms(lambda: mx.eval(*(cache_arrays(c) for c in result.caches)))
    out["sample"] = _ms(lambda: mx.argmax(result.last_logits, axis=-1).tolist())
    store = KVBlockStore(model, PrefixCache(32, 1 << 40))
    if result.shared:
        batch = result.shared[0]
        out["prefix_insert_cpu"] = _ms(lambda: store.insert_rows(prompts, batch.caches, list(range(rows))) and store.flush())
        out["prefix_insert"] = out["prefix_insert_cpu"] + _ms(mx.synchronize)
    out["join_empty"] = _ms(lambda: mx.eval(*cache_arrays(plain_batch.append_rows([], [], _joiners(result))[0])))
    base, padding = _decode_batch(model, decode_rows, tokens + 64, vocab, pad)
    joined: dict = {}
    out["join_onto"] = _ms(lambda: joined.update(c=plain_batch.append_rows(base, padding, _joiners(result))[0]) or mx.eval(
        *cache_arrays(joined["c"])))
    inputs = mx.zeros((decode_rows + rows, 1), mx.uint32)
    out["decode"] = _ms(lambda: mx.eval(model(inputs, cache=joined["c"])[:, -1, :]))
    tokens_array = mx.array(prompts, mx.uint32)

    def raw() -> None:
        cache = make_prompt_cache(model)
        model(tokens_array, cache=cache)
        mx.eval(*(a for c in cache for a in c.state))

    out["raw_body"] = _ms(raw)
    return out


def probe(model, rows: int, tokens: int, vocab: int, pad: bool, decode_rows: int, repeat: int) -> dict:
    split = head_split(model)
    rounds = [one_round(model, rows, tokens, vocab, pad, decode_rows, split) for _ in range(1 + repeat)]
    mx.clear_cache()
    warm = {k: round(statistics.median(r[k] for r in rounds[1:]), 2) for k in rounds[0]}
    return {"rows": rows, "tokens": tokens, "decode_rows": decode_rows, "cold": {k: round(v, 2) for k, v in rounds[0].items()},
            "warm": warm}


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--random-shape", default="qwen3-0.6b")
    p.add_argument("--rows", default="8,32")
    p.add_argument("--tokens", default="512")
    p.add_argument("--decode-rows", type=int, default=32)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="orchard-spp-") as tmp:
        loaded = load_model(str(make_random_model(Path(tmp) / "model", args.random_shape)))
        pad = mx.default_device().type == mx.gpu
        # The runner's cap on MLX's cache of freed buffers: without it each round's freed buffers pile up until
        # allocations wait on the device (the 8B shape's repeats ran slower than its first round, 2026-11-25).
        mx.set_cache_limit(buffer_cache_limit_bytes())
        results = []
        with mx.stream(mx.new_stream(mx.default_device())):
            for tokens in (int(t) for t in args.tokens.split(",")):
                for rows in (int(r) for r in args.rows.split(",")):
                    row = probe(loaded.model, rows, tokens, loaded.vocab_size, pad, args.decode_rows, args.repeat)
                    results.append(row)
                    print(f"rows {rows} tokens {tokens} warm ms: " + "  ".join(f"{k} {v}" for k, v in row["warm"].items()),
                          flush=True)
    report = {"machine": machine_info(), "shape": args.random_shape, "pad_shapes": pad, "results": results}
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
