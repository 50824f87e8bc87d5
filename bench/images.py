"""Image generation: Orchard's image worker (waiting images of one size denoised together) against mflux's own
generate_image called once per image, on one random FLUX.2 [klein] model, in one process.

    python -m bench.images --shape klein-4b --size 1024 --steps 4 --concurrency 1,4 --repeat 2 --json out.json
    python -m bench.images --shape tiny --size 64 --steps 2 --concurrency 1,2 --repeat 1     # CPU smoke test

At each concurrency N, N requests of distinct prompts and seeds arrive at once:
- `orchard`: engine/images/worker.py with max_batch the largest N (what a model of max_image_batch N serves),
  every image submitted at once, the timer up to the last image;
- `mflux`: the same N images by mflux's generate_image one after another (one model, no batching: what a server
  that queues requests does).
Each column loads its own model on its own thread (MLX's CUDA streams belong to the thread that made the arrays).
Images a minute for each, and their ratio (issue 53: >= 1.3x at 4, >= 0.95x at 1); rounds alternate the columns,
ratios are the medians of the rounds'. The weights are random (tests/support/tiny_images.py): speed does not depend
on their values. Quantized as the server's GPU default (8 bits) unless --bits 16.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional

from bench.engine_throughput import git_commit, machine_info

PROMPTS = ("a puffin standing on a cliff at dusk", "a red dragon baking bread in a stone oven",
           "a lighthouse in a storm, oil painting", "a bowl of ramen, studio photograph")


def specs(count: int, size: int, steps: int, round_index: int) -> list:
    from engine.images.generator import ImageSpec

    return [ImageSpec(PROMPTS[i % len(PROMPTS)], size, size, steps, 1.0, seed=1000 * round_index + i)
            for i in range(count)]


def orchard_rate(worker, batch: list) -> float:
    """Images a minute through the worker, every image submitted at once."""
    started = time.perf_counter()
    for future in [worker.submit(spec) for spec in batch]:
        future.result()
    return 60 * len(batch) / (time.perf_counter() - started)


def mflux_rate(pool: ThreadPoolExecutor, generator, batch: list) -> float:
    """Images a minute by mflux's generate_image, one after another (on the thread that loaded its model)."""
    started = time.perf_counter()
    pool.submit(lambda: [generator.generate(spec) for spec in batch]).result()
    return 60 * len(batch) / (time.perf_counter() - started)


def bench(args) -> dict:
    import engine  # noqa: F401 — OpenBLAS before MLX on a Linux CPU (engine/cpu_blas.py)
    from engine.device_memory import release_thread_streams
    from engine.images.families import FAMILIES
    from engine.images.generator import ImageGenerator
    from engine.images.worker import ImageWorker
    from tests.support.tiny_images import write_klein

    folder = write_klein(Path(tempfile.mkdtemp(prefix="bench-images-")) / "klein", args.shape)
    quantize = None if args.bits == 16 else args.bits
    load = lambda: ImageGenerator(folder, FAMILIES["flux2-klein-4b"], quantize=quantize)  # noqa: E731
    levels = [int(level) for level in args.concurrency.split(",")]
    # Each column's model is made and run on a thread of its own: MLX's streams (CUDA graphs) belong to the
    # thread that made a model's arrays. The worker batches up to the largest level, as a server's would.
    worker = ImageWorker(load, max(levels))
    worker.loaded.result()
    pool = ThreadPoolExecutor(1)
    generator = pool.submit(load).result()
    for level in levels:  # kernels of every shape built before timing
        mflux_rate(pool, generator, specs(1, args.size, args.steps, 99))
        orchard_rate(worker, specs(level, args.size, args.steps, 99))
    rounds = []
    for repeat in range(args.repeat):
        for level in levels:
            batch = specs(level, args.size, args.steps, repeat + 1)
            columns = [("orchard", lambda: orchard_rate(worker, batch)),
                       ("mflux", lambda: mflux_rate(pool, generator, batch))]
            rates = dict((name, run()) for name, run in (columns if repeat % 2 == 0 else columns[::-1]))
            rounds.append({"round": repeat, "concurrency": level, **rates})
            print(f"round {repeat}, {level} at once: orchard {rates['orchard']:.2f} images/min, "
                  f"mflux {rates['mflux']:.2f}, ratio {rates['orchard'] / rates['mflux']:.2f}")
    worker.close()
    pool.submit(release_thread_streams).result()
    pool.shutdown()
    ratios = {level: statistics.median(r["orchard"] / r["mflux"] for r in rounds if r["concurrency"] == level)
              for level in levels}
    return {"machine": machine_info(), "commit": git_commit(), "args": vars(args), "rounds": rounds,
            "orchard_over_mflux": {str(level): ratio for level, ratio in ratios.items()}}


def main(argv: Optional[list[str]] = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="klein-4b", help="tiny or klein-4b (tests/support/tiny_images.py)")
    parser.add_argument("--size", type=int, default=1024, help="square images of this side")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--concurrency", default="1,4")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--bits", type=int, default=8, choices=(4, 8, 16))
    parser.add_argument("--json", help="write the report here")
    args = parser.parse_args(argv)
    report = bench(args)
    print("orchard / mflux: " + ", ".join(f"{level} at once {ratio:.2f}"
                                          for level, ratio in report["orchard_over_mflux"].items()))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
