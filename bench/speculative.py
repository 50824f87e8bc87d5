"""Speculative decoding against plain decoding, in process: speed-up as a function of measured acceptance.

    python -m bench.speculative --random-shape llama-3.1-8b --draft-shape llama-3.2-1b --json out.json --plot out.png
    python -m bench.speculative --model PATH --streams 1 --acceptance 0,0.7,0.9

Controlled acceptance: plain greedy decoding first writes each request's continuation (the reference); then a
drafter that knows it proposes each next token right with probability q, wrong otherwise. It replaces prompt
lookup's drafts only (engine/spec_decode/speculator.py's host_drafter), so verification, rollback and the
adaptive draft length are the engine's own, and the measured acceptance (accepted / drafted tokens) is what the
policy saw. Also measured on the same prompts: prompt lookup itself (`ngram`), and with --draft-shape a random
draft model of the target's vocabulary (`draft`: ~0 % acceptance, the adaptive off-switch paying a draft model).

Every speculative run's tokens are compared with the reference (`mismatched`: requests that differ; greedy
speculation is exact, so only device numerics can make them differ: kernels of other shapes round differently,
and in bf16 that flips near-tied greedy choices of a random model, after which the reference no longer predicts
the text). Plain and speculative runs alternate, --repeat times, each repeat on new prompts of new lengths;
each speculative run sits between two plain runs, and its ratio is to their mean (the lent machines drift by up to
30 % between minutes); the table gives the median ratio over the repeats. `full batch`: the same ratio over the
time every stream was still running (until the first request finished): all requests start together with the same
length, so plain decoding finishes them in one step while speculation finishes them unevenly, and the last few then
decode in a small batch; N concurrent users of a server, whose requests come and go, see the full-batch figure.
`overhead`: what the engine measured a verifying step to cost beyond a plain decode step (in plain steps), which
its adaptive draft lengths weigh.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Optional

from bench.engine_throughput import (
    check_engine_api,
    engine_core,
    free_memory,
    git_commit,
    greedy_request,
    load_orchard_model,
    machine_info,
    make_prompts,
    model_info,
    set_host_drafter,
    speculation_counts,
    speculation_overhead,
    speculative_config,
    warm_up,
)

Drafter = Callable[[str, list[int], int], list[int]]


@dataclass
class Case:
    """One speculative configuration at one stream count, over the run's repeats."""

    streams: int
    label: str
    target_acceptance: Optional[float]
    tokens_per_s: list[float] = field(default_factory=list)
    # Each run's tokens/s over its two neighbouring plain runs' mean, whole run and while every stream ran.
    ratios: list[float] = field(default_factory=list)
    full_batch_ratios: list[float] = field(default_factory=list)
    drafted: int = 0
    accepted: int = 0
    mismatched: int = 0
    # The engine's measured cost of a verifying step beyond a plain one (in plain steps), at the case's end.
    verify_overhead: Optional[float] = None

    @property
    def acceptance(self) -> Optional[float]:
        return self.accepted / self.drafted if self.drafted else None


@dataclass
class Level:
    streams: int
    plain_tokens_per_s: list[float] = field(default_factory=list)
    cases: list[Case] = field(default_factory=list)


@dataclass(frozen=True)
class Run:
    """One timed run: all prompts submitted at once, stepped to the end."""

    seconds: float
    outputs: dict[str, list[int]]
    # Until the first request finished (every stream still running): seconds and tokens written by then.
    full_batch_seconds: float
    full_batch_tokens: int

    @property
    def tokens_per_s(self) -> float:
        return sum(map(len, self.outputs.values())) / self.seconds

    @property
    def full_batch_tokens_per_s(self) -> float:
        return self.full_batch_tokens / self.full_batch_seconds


def timed_run(core, prompts: dict[str, list[int]], max_tokens: int) -> Run:
    """Submit every prompt at once and step to the end."""
    outputs: dict[str, list[int]] = {rid: [] for rid in prompts}
    for rid, prompt in prompts.items():
        core.add_request(greedy_request(rid, prompt, max_tokens))
    start = time.perf_counter()
    full_batch = None
    while core.has_unfinished_requests():
        for out in core.step():
            outputs[out.request_id] += out.new_token_ids
            if out.is_last and full_batch is None:
                full_batch = (time.perf_counter() - start, sum(map(len, outputs.values())))
    seconds = time.perf_counter() - start
    full_batch = full_batch or (seconds, sum(map(len, outputs.values())))
    return Run(seconds, outputs, *full_batch)


def oracle(reference: dict[str, list[int]], prompt_lengths: dict[str, int], q: float, vocab: int, seed: int) -> Drafter:
    """Drafts that are the reference's next tokens, each right with probability q (wrong: another token)."""
    rng = random.Random(seed)

    def draft(request_id: str, known: list[int], length: int) -> list[int]:
        position = len(known) - prompt_lengths[request_id]
        truth = reference[request_id][position : position + length]
        return [t if rng.random() < q else (t + 1 + rng.randrange(vocab - 17)) % (vocab - 16) for t in truth]

    return draft


def measure(case: Case, core, prompts, reference, max_tokens: int) -> Run:
    drafted, accepted = speculation_counts(core)
    run = timed_run(core, prompts, max_tokens)
    after = speculation_counts(core)
    case.drafted += after[0] - drafted
    case.accepted += after[1] - accepted
    case.mismatched += sum(run.outputs[rid] != reference[rid] for rid in prompts)
    case.tokens_per_s.append(run.tokens_per_s)
    case.verify_overhead = speculation_overhead(core)
    return run


def add_ratios(case: Case, run: Run, plain_before: Run, plain_after: Run) -> None:
    """The run against the mean of the plain runs on either side of it."""
    case.ratios.append(2 * run.tokens_per_s / (plain_before.tokens_per_s + plain_after.tokens_per_s))
    plain_full = plain_before.full_batch_tokens_per_s + plain_after.full_batch_tokens_per_s
    case.full_batch_ratios.append(2 * run.full_batch_tokens_per_s / plain_full)


def repeat_prompts(streams: int, repeat: int, vocab: int, length: int) -> dict[str, list[int]]:
    """New prompts of new lengths each repeat: KV lengths a device has already seen (and built kernels or
    attention graphs for) would flatter the later runs."""
    prompts = make_prompts(streams, length + 7 * repeat, vocab, [streams, repeat])
    return {f"s{streams}-r{repeat}-{i}": p[: length + 7 * repeat - 3 * i] for i, p in enumerate(prompts)}


def bench_streams(streams: int, loaded, draft, args) -> Level:
    vocab = loaded.vocab_size
    common = dict(max_decode_seqs=streams, pad_prefill_shapes=False, enable_prefix_cache=False)
    cases = [Case(streams, f"q={q:g}", q) for q in args.acceptance] + [Case(streams, "ngram", None)]
    cases += [Case(streams, "draft", None)] if draft is not None else []
    # One engine per case: each learns its own workload's acceptance over the repeats (a new request starts from
    # what the model's recent requests met), as a server whose workload stays the same does.
    plain = engine_core(loaded, **common)
    ngram_config = speculative_config(method="ngram", num_draft_tokens=args.draft_tokens)
    cores = {case.label: engine_core(loaded, speculative=ngram_config, **common) for case in cases if case.label != "draft"}
    if draft is not None:
        spec_config = speculative_config(method="draft", num_draft_tokens=args.draft_tokens, draft_model_path=str(draft.path))
        cores["draft"] = engine_core(loaded, draft=draft, speculative=spec_config, **common)
    warm = repeat_prompts(streams, args.repeat, vocab, args.prompt_tokens // 2)  # kernels, not these lengths
    for core in (plain, *cores.values()):
        warm_up(core)
        # Every batch size up to `streams` decodes once: speculating rows finish unevenly, so the batch shrinks
        # through sizes plain decoding here never meets, and a first decode at a new size costs an H100 0.1-0.5 s.
        for size in range(streams, 0, -1):
            timed_run(core, {f"{rid}-b{size}": p for rid, p in list(warm.items())[:size]}, 16)
    level = Level(streams)
    for repeat in range(args.repeat):
        prompts = repeat_prompts(streams, repeat, vocab, args.prompt_tokens)
        lengths = {rid: len(p) for rid, p in prompts.items()}
        timed_run(plain, prompts, 1)  # prefill shapes of the new lengths built once, for every core (not timed)
        plain_run = timed_run(plain, prompts, args.new_tokens)
        reference = plain_run.outputs
        level.plain_tokens_per_s.append(plain_run.tokens_per_s)
        for case in cases:
            core = cores[case.label]
            if case.target_acceptance is not None:
                set_host_drafter(core, oracle(reference, lengths, case.target_acceptance, vocab, repeat))
            run = measure(case, core, prompts, reference, args.new_tokens)
            next_plain = timed_run(plain, prompts, args.new_tokens)
            level.plain_tokens_per_s.append(next_plain.tokens_per_s)
            add_ratios(case, run, plain_run, next_plain)
            plain_run = next_plain
        print(f"streams {streams} repeat {repeat + 1}/{args.repeat} done", flush=True)
    level.cases = cases
    for core in (plain, *cores.values()):
        core.close()
    free_memory()
    return level


def table(levels: list[Level]) -> str:
    rows = [["streams", "case", "acceptance", "plain tok/s", "spec tok/s", "ratio", "full batch", "mismatched", "overhead"]]
    for level in levels:
        plain = statistics.median(level.plain_tokens_per_s)
        for case in level.cases:
            spec = statistics.median(case.tokens_per_s)
            acceptance = f"{case.acceptance:.1%}" if case.acceptance is not None else "-"
            overhead = f"{case.verify_overhead:.2f}" if case.verify_overhead is not None else "-"
            full = f"{statistics.median(case.full_batch_ratios):.2f}x" if case.full_batch_ratios else "-"
            rows.append([str(level.streams), case.label, acceptance, f"{plain:.1f}", f"{spec:.1f}",
                         f"{case_ratio(case, level):.2f}x", full, str(case.mismatched), overhead])
        null = null_ratios(level)
        if len(null) >= 5:  # the measurement's own spread: plain against plain, paired the same way
            deciles = statistics.quantiles(null, n=10)
            rows.append([str(level.streams), "plain (null)", "-", f"{plain:.1f}", "-",
                         f"{statistics.median(null):.2f}x", f"p10-p90 {deciles[0]:.2f}-{deciles[-1]:.2f}", "-", "-"])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows)


def null_ratios(level: Level) -> list[float]:
    """Each plain run between two others against their mean: what the pairing gives where nothing differs (the
    measurement's own spread; plain runs sit at both ends of every case, len(cases) + 1 per repeat)."""
    per_repeat = len(level.cases) + 1
    runs = level.plain_tokens_per_s
    ratios = []
    for start in range(0, len(runs) - per_repeat + 1, per_repeat):
        chunk = runs[start : start + per_repeat]
        ratios += [2 * chunk[i] / (chunk[i - 1] + chunk[i + 1]) for i in range(1, per_repeat - 1)]
    return ratios


def case_ratio(case: Case, level: Level) -> float:
    """The median of the paired ratios (reports written before pairing: of the medians)."""
    if case.ratios:
        return statistics.median(case.ratios)
    return statistics.median(case.tokens_per_s) / statistics.median(level.plain_tokens_per_s)


def plot(levels: list[Level], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for level in levels:
        points = sorted(
            (c.acceptance, case_ratio(c, level)) for c in level.cases
            if c.target_acceptance is not None and c.acceptance is not None
        )
        ax.plot([a * 100 for a, _ in points], [r for _, r in points], marker="o", label=f"{level.streams} stream(s)")
    ax.axhline(1.0, color="gray", linestyle="--", linewidth=1)
    ax.set_xlabel("measured acceptance (% of drafted tokens)")
    ax.set_ylabel("tokens/s vs plain decoding")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def replot(report_path: Path, plot_path: Optional[Path]) -> list[Level]:
    report = json.loads(report_path.read_text())
    levels = [
        Level(raw["streams"], raw["plain_tokens_per_s"], [Case(**case) for case in raw["cases"]]) for raw in report["levels"]
    ]
    print(table(levels))
    if plot_path:
        plot(levels, plot_path, f"speculative decoding, {report['model'].get('random_shape') or report['model']['path']}")
    return levels


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="mlx-lm model folder")
    src.add_argument("--random-shape", help="build a random bf16 model of this shape (tests/support/random_model.py)")
    src.add_argument("--from-json", type=Path, help="only redraw --plot (and print the table) from an earlier --json")
    p.add_argument("--draft-shape", help="also speculate with a random draft model of this shape (same vocabulary)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                   help="of the random models (float32: kernel-shape rounding never flips a greedy token)")
    p.add_argument("--streams", default="1,8", help="concurrent requests, comma-separated")
    p.add_argument("--acceptance", default="0,0.3,0.5,0.7,0.8,0.9,1", help="drafter agreement levels q")
    p.add_argument("--draft-tokens", type=int, default=4)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--json", type=Path)
    p.add_argument("--plot", type=Path)
    args = p.parse_args(argv)
    args.streams = [int(s) for s in args.streams.split(",")]
    args.acceptance = [float(q) for q in args.acceptance.split(",")]
    return args


def build_models(args, workdir: Path) -> tuple[str, Optional[str]]:
    from tests.support.random_model import make_random_model

    model_path = args.model or str(make_random_model(workdir / "target", args.random_shape, args.dtype))
    draft_path = str(make_random_model(workdir / "draft", args.draft_shape, args.dtype, seed=1)) if args.draft_shape else None
    return model_path, draft_path


def main(argv: Optional[list[str]] = None) -> list[Level]:
    args = parse_args(argv)
    if args.from_json:
        return replot(args.from_json, args.plot)
    check_engine_api()
    with tempfile.TemporaryDirectory() as workdir:
        started = time.perf_counter()
        model_path, draft_path = build_models(args, Path(workdir))
        loaded = load_orchard_model(model_path)
        draft = load_orchard_model(draft_path) if draft_path else None
        info = {"machine": machine_info(), "commit": git_commit(), "model": model_info(model_path, args.random_shape),
                "draft_shape": args.draft_shape, "setup_s": round(time.perf_counter() - started, 1)}
        levels = [bench_streams(streams, loaded, draft, args) for streams in args.streams]
    text = table(levels)
    print(text)
    if args.json:
        report = {**info, "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                  "levels": [asdict(level) for level in levels], "table": text}
        args.json.write_text(json.dumps(report, indent=1))
    if args.plot:
        plot(levels, args.plot, f"speculative decoding, {args.random_shape or Path(args.model).name}")
    return levels


if __name__ == "__main__":
    main()
