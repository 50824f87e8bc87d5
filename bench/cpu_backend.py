"""The engine on MLX's CPU backend, before and after issue 47: bundled reference BLAS in the stored bf16 against the
engine's own choice (OpenBLAS where the OS has it, float32 where its matmuls win), paired in one run.

    python -m bench.cpu_backend [--model PATH] [--prompt-tokens 256] [--gen-tokens 64] [--rounds 3] [--json out.json]

MLX binds its BLAS once per process, so each setting runs in a child process of its own (rounds alternate which goes
first): the embedded SmolLM2-135M (or --model) loaded by the engine, one prompt prefilled in one step (prefill tok/s),
then one stream decoding --gen-tokens greedy tokens (decode tok/s). Ratios are paired per round, then the median.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

# name -> (ORCHARD_BLAS, the load's dtype: None lets the engine choose)
SETTINGS = {"before": ("bundled", "bfloat16"), "after": ("auto", None)}


def measure(model: str | None, dtype: str | None, prompt_tokens: int, gen_tokens: int) -> dict:
    """One setting, in this process: the engine's prefill and decode rates on one request."""
    from bench.engine_throughput import engine_core, greedy_request, warm_up
    from engine.cpu_blas import choose_blas
    from engine.models.default_model import default_model_path
    from engine.models.cpu_compute import stored_form
    from engine.models.loader import load_model

    loaded = load_model(model or default_model_path(), dtype=dtype)
    core = engine_core(loaded, prefill_step_tokens=prompt_tokens, prefill_chunk_tokens=prompt_tokens,
                       enable_prefix_cache=False)
    warm_up(core)
    prompt = [(i * 7919) % (loaded.vocab_size - 200) + 100 for i in range(prompt_tokens)]
    rates = []
    for request_id in ("warm", "measured"):  # the first request builds what the second reuses
        core.add_request(core.limits.validate(greedy_request(request_id, prompt, gen_tokens)))
        started = time.perf_counter()
        core.step()  # the whole prompt and its first token
        prefilled = time.perf_counter()
        while core.has_unfinished_requests():
            core.step()
        rates.append((prompt_tokens / (prefilled - started), (gen_tokens - 1) / (time.perf_counter() - prefilled)))
    core.close()
    return {"blas": choose_blas().describe(), "dtype": stored_form(loaded.model).label,
            "prefill_tok_s": round(rates[-1][0], 1), "decode_tok_s": round(rates[-1][1], 2)}


def run_child(setting: str, args: argparse.Namespace) -> dict:
    blas, _ = SETTINGS[setting]
    env = {**os.environ, "ORCHARD_BLAS": blas}
    command = [sys.executable, "-m", "bench.cpu_backend", "--child", setting, "--prompt-tokens",
               str(args.prompt_tokens), "--gen-tokens", str(args.gen_tokens)]
    command += ["--model", args.model] if args.model else []
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=True, timeout=1800,
                          cwd=Path(__file__).resolve().parents[1])
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="an mlx-lm model folder (default: the embedded SmolLM2-135M)")
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--gen-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default=None)
    parser.add_argument("--child", choices=sorted(SETTINGS), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(measure(args.model, SETTINGS[args.child][1], args.prompt_tokens, args.gen_tokens)))
        return
    rounds = []
    for number in range(args.rounds):
        order = ["before", "after"] if number % 2 == 0 else ["after", "before"]
        results = {setting: run_child(setting, args) for setting in order}
        rounds.append(results)
        print(f"round {number + 1}: " + "; ".join(
            f"{s} ({r['blas'].split(' (')[0]}, {r['dtype']}) prefill {r['prefill_tok_s']} tok/s, decode "
            f"{r['decode_tok_s']} tok/s" for s, r in results.items()), flush=True)
    summary = {rate: statistics.median(r["after"][rate] / r["before"][rate] for r in rounds)
               for rate in ("prefill_tok_s", "decode_tok_s")}
    print(f"after / before, median of {args.rounds} paired rounds: prefill {summary['prefill_tok_s']:.1f}x, "
          f"decode {summary['decode_tok_s']:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps({"settings": vars(args), "rounds": rounds, "ratios": summary}, indent=1))


if __name__ == "__main__":
    main()
