"""Diagnostic: where a bench.engine_throughput run's time goes, step by step (Orchard only, in process).

    python -m bench.step_trace --random-shape qwen3-0.6b --concurrency 128 --warmup-tokens 16,128

For each warm-up length, warms a core as engine_throughput does, then runs N prompts to completion
timing every step with its prefill tokens and decode rows, and prints the steps grouped by kind
(prefill + decode, decode only) and decode-batch size: count, median and total milliseconds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

from bench.engine_throughput import OrchardRunner, free_memory, machine_info, make_prompts
from bench.random_model import make_random_model
from engine import Request, SamplingParams


@dataclass
class StepSample:
    ms: float
    cpu_ms: float
    prefill_tokens: int
    decode_rows: int
    new_tokens: int


@dataclass
class StepGroup:
    kind: str
    rows: str
    count: int
    median_ms: float
    median_cpu_ms: float
    total_ms: float


def traced_run(core, prompts: list[list[int]], gen_tokens: int, request_prefix: str) -> list[StepSample]:
    params = SamplingParams(max_tokens=gen_tokens, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        core.add_request(Request(f"{request_prefix}{i}", prompt, params))
    samples = []
    while core.has_unfinished_requests():
        before = core.stats()
        wall, cpu = time.perf_counter(), time.thread_time()
        outputs = core.step()
        ms, cpu_ms = 1e3 * (time.perf_counter() - wall), 1e3 * (time.thread_time() - cpu)
        after = core.stats()
        samples.append(StepSample(round(ms, 3), round(cpu_ms, 3), after.prompt_tokens_total - before.prompt_tokens_total,
                                  after.num_decoding, sum(len(o.new_token_ids) for o in outputs)))
    return samples


def group_steps(samples: list[StepSample], row_bucket: int = 32) -> list[StepGroup]:
    groups: dict[tuple[str, int], list[StepSample]] = {}
    for sample in samples:
        kind = "prefill+decode" if sample.prefill_tokens else "decode"
        bucket = -(-sample.decode_rows // row_bucket) * row_bucket
        groups.setdefault((kind, bucket), []).append(sample)
    return [
        StepGroup(kind, f"<={bucket}", len(group), round(statistics.median(s.ms for s in group), 2),
                  round(statistics.median(s.cpu_ms for s in group), 2), round(sum(s.ms for s in group), 1))
        for (kind, bucket), group in sorted(groups.items())
    ]


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--random-shape", default="qwen3-0.6b")
    p.add_argument("--bits", type=int, default=None)
    p.add_argument("--concurrency", type=int, default=128)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--gen-tokens", type=int, default=128)
    p.add_argument("--warmup-tokens", default="16,128", help="comma-separated warm-up lengths, one traced run each")
    p.add_argument("--prefill-batch-size", type=int, default=8)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    report = {"machine": machine_info(), "settings": vars(args), "runs": []}
    with tempfile.TemporaryDirectory(prefix="orchard-st-") as tmp:
        path = str(make_random_model(Path(tmp) / "model", args.random_shape, "bfloat16", args.bits))
        runner = OrchardRunner(path, args.prefill_batch_size, 2048, prefix_cache=False)
        core = runner._core_for(args.concurrency)
        vocab = runner.loaded.vocab_size
        for run, warmup_tokens in enumerate(int(w) for w in args.warmup_tokens.split(",")):
            warm = make_prompts(args.concurrency, args.prompt_tokens, vocab, [run, 1])
            traced_run(core, warm, warmup_tokens, f"w{run}-")
            free_memory()
            started = time.perf_counter()
            samples = traced_run(core, make_prompts(args.concurrency, args.prompt_tokens, vocab, [run, 0]),
                                 args.gen_tokens, f"t{run}-")
            wall = time.perf_counter() - started
            tokens = sum(s.new_tokens for s in samples)
            groups = group_steps(samples)
            print(f"warm-up {warmup_tokens} tokens: {len(samples)} steps, {wall:.2f} s, {tokens / wall:.0f} tok/s")
            for g in groups:
                print(f"  {g.kind:<15} rows {g.rows:<5} n={g.count:<4} median {g.median_ms:7.2f} ms "
                      f"(cpu {g.median_cpu_ms:6.2f})  total {g.total_ms:8.1f} ms")
            report["runs"].append({"warmup_tokens": warmup_tokens, "wall_s": wall, "tok_per_s": tokens / wall,
                                   "groups": [asdict(g) for g in groups], "steps": [asdict(s) for s in samples]})
        runner.close()
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
