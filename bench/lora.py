"""Per-request LoRA adapters: streams of many adapters in one batch, against the base model alone and against mlx-lm
serving one adapter at a time.

    python -m bench.lora --shape qwen3-0.6b --streams 32 --adapters 8 --rank 16 --json out.json

One process, one random bf16 model of the shape (tests/support/random_model.py), N random rank-r adapters on
q/k/v/o (mlx-lm's format). The same seeded random prompts in every column, greedy, EOS ignored:
- `base`: the engine, every stream on the base model;
- `adapters`: the engine, stream i on adapter i % N, all streams in one continuous batch;
- `adapters-dense` (where the fused kernel serves, CUDA): the same with the bank's dense form instead;
- `mlx-lm`: what mlx-lm's own server does when requests name different adapters: for each adapter in turn, load it
  onto the model (mlx_lm.tuner.utils.load_adapters), generate that adapter's streams together (BatchGenerator),
  take the adapter off (remove_lora_layers) and go on with the next; the timer spans all of it.
Rounds alternate the columns (--repeat) and each ratio is the median of the rounds' ratios: the lent machines drift
by up to 30 % between minutes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Optional

from bench.engine_throughput import check_engine_api, engine_core, git_commit, greedy_request, load_orchard_model
from bench.engine_throughput import machine_info, make_prompts, warm_up

TARGETS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")


def write_adapters(model, folder: Path, count: int, rank: int) -> list[Path]:
    """`count` random rank-`rank` adapters of `model` on q/k/v/o of every layer, in mlx-lm's format."""
    import mlx.core as mx

    from tests.support.tiny_adapters import random_lora, write_mlx_lm_adapter

    paths = []
    for index in range(count):
        pairs = {path: (a.astype(mx.float32), b.astype(mx.float32))
                 for path, (a, b) in random_lora(model, rank, seed=100 + index, targets=TARGETS, magnitude=0.05).items()}
        path = write_mlx_lm_adapter(folder / f"adapter-{index}", pairs, scale=2.0)
        config = json.loads((path / "adapter_config.json").read_text())
        config["lora_parameters"]["keys"] = list(TARGETS)  # mlx-lm wraps these alone (its default: every linear)
        (path / "adapter_config.json").write_text(json.dumps(config))
        paths.append(path)
    return paths


def run_engine(core, prompts: list[list[int]], gen_tokens: int, adapters: list[Optional[str]],
               step_seconds: list[float]) -> float:
    """Generated tokens per second, every request added at once and stepped to the end; each step's duration is
    added to `step_seconds` (their median: a decode step's)."""
    started = time.perf_counter()
    for index, (prompt, adapter) in enumerate(zip(prompts, adapters)):
        request = greedy_request(f"r{index}-{started}", prompt, gen_tokens)
        request.adapter = adapter
        core.add_request(request)
    generated = 0
    while core.has_unfinished_requests():
        step_started = time.perf_counter()
        generated += sum(len(output.new_token_ids) for output in core.step())
        step_seconds.append(time.perf_counter() - step_started)
    return generated / (time.perf_counter() - started)


def run_mlx_lm_switching(model, prompts: list[list[int]], gen_tokens: int, paths: list[Path]) -> float:
    """mlx-lm, one adapter at a time: load it, generate its streams as one batch, take it off."""
    from mlx_lm.generate import BatchGenerator
    from mlx_lm.tuner.utils import load_adapters, remove_lora_layers

    started = time.perf_counter()
    generated = 0
    for index, path in enumerate(paths):
        mine = prompts[index :: len(paths)]
        load_adapters(model, str(path))
        generator = BatchGenerator(model, max_tokens=gen_tokens, stop_tokens=None, completion_batch_size=len(mine),
                                   prefill_batch_size=len(mine))
        generator.insert(mine, [gen_tokens] * len(mine))
        while responses := generator.next_generated():
            generated += len(responses)
        generator.close()
        remove_lora_layers(model)
    return generated / (time.perf_counter() - started)


def with_dense(bank, run):
    """`run` with per-row adapters in the bank's dense form."""
    bank.fused = False
    try:
        return run()
    finally:
        bank.fused = True


def bench(args) -> dict:
    check_engine_api()
    from engine.models.loader import load_model
    from tests.support.random_model import make_random_model

    workdir = Path(tempfile.mkdtemp(prefix="bench-lora-"))
    model_path = make_random_model(workdir / "model", args.shape, "bfloat16")
    engine = engine_core(load_orchard_model(str(model_path)), max_decode_seqs=args.streams,
                         max_prefill_seqs=args.streams, max_num_seqs=args.streams * 2, enable_prefix_cache=False,
                         max_loras=args.adapters, max_lora_rank=args.rank)
    warm_up(engine)
    paths = write_adapters(engine.loaded.model, workdir / "adapters", args.adapters, args.rank)
    for index, path in enumerate(paths):
        engine.load_adapter(f"a{index}", path)
    reference = load_model(model_path).model  # mlx-lm's column: its own model object, adapters put on and off
    prompts = make_prompts(args.streams, args.prompt_tokens, engine.loaded.vocab_size, [0])
    names = [f"a{index % args.adapters}" for index in range(args.streams)]
    bank = engine.adapters.bank
    steps: dict[str, list[float]] = {"base": [], "adapters": [], "adapters-dense": []}
    columns = {
        "base": lambda p: run_engine(engine, p, args.gen_tokens, [None] * args.streams, steps["base"]),
        "adapters": lambda p: run_engine(engine, p, args.gen_tokens, names, steps["adapters"]),
        "mlx-lm": lambda p: run_mlx_lm_switching(reference, p, args.gen_tokens, paths),
    }
    if bank.fused:  # the dense form beside the fused kernel (engine/adapters/kernels.py), for the record
        columns["adapters-dense"] = lambda p: with_dense(
            bank, lambda: run_engine(engine, p, args.gen_tokens, names, steps["adapters-dense"]))
    for column in columns.values():  # kernels of every shape built before timing
        column(make_prompts(args.streams, args.prompt_tokens, engine.loaded.vocab_size, [99])[: args.streams])
    rounds = []
    for timed in steps.values():
        timed.clear()
    for repeat in range(args.repeat):
        round_prompts = make_prompts(args.streams, args.prompt_tokens, engine.loaded.vocab_size, [repeat + 1])
        rounds.append({name: column(round_prompts) for name, column in columns.items()})
        print(f"round {repeat}: " + ", ".join(f"{name} {rate:,.0f} tok/s" for name, rate in rounds[-1].items()))
    step_ms = {name: 1000 * statistics.median(timed) for name, timed in steps.items() if timed}
    print("median step: " + ", ".join(f"{name} {ms:.2f} ms" for name, ms in step_ms.items()))
    return {
        "machine": machine_info(), "commit": git_commit(), "args": vars(args), "rounds": rounds,
        "median_step_ms": step_ms,
        "adapters_over_base": statistics.median(r["adapters"] / r["base"] for r in rounds),
        "adapters_over_mlx_lm": statistics.median(r["adapters"] / r["mlx-lm"] for r in rounds),
    }


def main(argv: Optional[list[str]] = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen3-0.6b", help="random model shape (tests/support/random_model.py)")
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--gen-tokens", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", help="write the report here")
    args = parser.parse_args(argv)
    report = bench(args)
    print(f"adapters / base: {report['adapters_over_base']:.2f}   adapters / mlx-lm: {report['adapters_over_mlx_lm']:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
