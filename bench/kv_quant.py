"""Decode throughput and KV bytes of the engine with a quantized KV cache (kv_bits) against unquantized KV.

    python -m bench.kv_quant --random-shape qwen3-0.6b --streams 32 --prompt-tokens 1024 --gen-tokens 128 \
        --kv-bits none,8,4 [--weight-bits 4] [--json out.json]

Each setting: one EngineCore (prefix cache off), N greedy requests of random prompts submitted at once; the decode
rate is measured over the steps after every prompt has been prefilled; KV bytes are the engine's own count
(EngineStats.kv_cache_bytes) at the end of prefill. Greedy tokens are compared with the unquantized run's.
"""

from __future__ import annotations

import argparse
import json
import random
import time

from bench.engine_throughput import engine_core, greedy_request, load_orchard_model, warm_up
from tests.support.random_model import make_random_model


def add_model_arguments(parser: argparse.ArgumentParser, out: str, shape_help: str) -> None:
    """The model a KV bench runs (kv_quant, kv_budget): a folder, else a random one of --random-shape."""
    parser.add_argument("--model", default=None, help="an mlx-lm model folder (else a random --random-shape one)")
    parser.add_argument("--random-shape", default="qwen3-0.6b", help=shape_help)
    parser.add_argument("--weight-bits", type=int, default=None)
    parser.add_argument("--out", default=out, help="where the random model is written")


def load_bench_model(args: argparse.Namespace):
    path = args.model or make_random_model(args.out, args.random_shape, "bfloat16", args.weight_bits, 0)
    return load_orchard_model(str(path))


def kv_bits_settings(text: str) -> list[int | None]:
    """--kv-bits "none,8,4" as engine kv_bits values (None: unquantized)."""
    return [None if setting == "none" else int(setting) for setting in text.split(",")]


def run_setting(loaded, kv_bits: int | None, prompts: list[list[int]], gen_tokens: int) -> dict:
    core = engine_core(loaded, max_decode_seqs=len(prompts), max_num_seqs=len(prompts), enable_prefix_cache=False,
                       kv_bits=kv_bits, queue_size=None)
    warm_up(core)
    for i, prompt in enumerate(prompts):
        core.add_request(core.limits.validate(greedy_request(f"r{i}", prompt, gen_tokens)))
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    started = time.perf_counter()
    decode_start = kv_bytes = None
    decoded = 0
    while core.has_unfinished_requests():
        outputs = core.step()
        for output in outputs:
            tokens[output.request_id].extend(output.new_token_ids)
        if decode_start is None and all(tokens.values()):
            decode_start, kv_bytes = time.perf_counter(), core.stats().kv_cache_bytes
        elif decode_start is not None:
            decoded += sum(len(o.new_token_ids) for o in outputs)
    end = time.perf_counter()
    return {
        "kv_bits": kv_bits, "streams": len(prompts), "total_s": round(end - started, 2),
        "decode_tok_s": round(decoded / (end - decode_start), 1), "kv_bytes_after_prefill": kv_bytes,
        "tokens": [tokens[f"r{i}"] for i in range(len(prompts))],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(parser, "/tmp/kv_quant_model", "tests.support.random_model's shapes (head_dim >= 32)")
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--gen-tokens", type=int, default=128)
    parser.add_argument("--kv-bits", default="none,8,4")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    loaded = load_bench_model(args)
    rng = random.Random(0)
    prompts = [[rng.randrange(100, loaded.vocab_size - 3) for _ in range(args.prompt_tokens)] for _ in range(args.streams)]
    results = []
    for kv_bits in kv_bits_settings(args.kv_bits):
        result = run_setting(loaded, kv_bits, prompts, args.gen_tokens)
        if results:
            base = results[0]["tokens"]
            same = sum(a == b for x, y in zip(base, result["tokens"]) for a, b in zip(x, y))
            result["tokens_equal_to_first_setting"] = round(same / sum(len(x) for x in base), 3)
        results.append(result)
        print(json.dumps({k: v for k, v in result.items() if k != "tokens"}), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{k: v for k, v in r.items() if k != "tokens"} for r in results], f, indent=1)


if __name__ == "__main__":
    main()
