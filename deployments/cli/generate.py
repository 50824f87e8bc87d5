"""`orchard generate PROMPT`: one chat answer from a local model, the engine on a thread of this process (no server)."""

from __future__ import annotations

import argparse
import asyncio
import sys
import time


def add_parser(commands: argparse._SubParsersAction) -> None:
    generate = commands.add_parser("generate", help="answer one chat message with a local model")
    generate.add_argument("prompt", help="the user message")
    generate.add_argument("--model", default=None, help="local model folder (default: the embedded SmolLM2-135M-Instruct)")
    generate.add_argument("--max-tokens", type=int, default=128)
    generate.add_argument("--temperature", type=float, default=0.0)
    generate.add_argument("--seed", type=int, default=None)
    generate.add_argument("--dtype", default=None, help="run the weights in this dtype (float32, bfloat16, float16)")
    generate.add_argument("--system", default=None, help="an optional system message")


def run(args: argparse.Namespace) -> int:
    return asyncio.run(_stream_answer(args))


async def _stream_answer(args: argparse.Namespace) -> int:
    """One chat answer through the thread engine client (the engine on a thread of this process)."""
    # Imported here: MLX and the engine take seconds to import, which `orchard ls` should not wait for.
    from engine.client.spec import EngineSpec
    from engine.client.thread_client import ThreadEngineClient
    from engine.config import EngineConfig
    from engine.output.request_output import TextDelta
    from engine.request import Request
    from engine.sampling.params import SamplingParams

    spec = EngineSpec(
        model_path=args.model or "default", uses_default_model=args.model is None, dtype=args.dtype,
        engine_config=EngineConfig(seed=args.seed),
    )
    client = ThreadEngineClient.from_spec(spec)
    await client.start()
    try:
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
            {"role": "user", "content": args.prompt}
        ]
        prompt = client.served.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        sampling = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
        started, num_tokens = time.perf_counter(), 0
        async for event in client.submit(Request("cli", prompt, sampling)):
            if isinstance(event, TextDelta):
                num_tokens += len(event.token_ids)
                sys.stdout.write(event.text)
                sys.stdout.flush()
        elapsed = time.perf_counter() - started
    finally:
        await client.close()
    sys.stdout.write("\n")
    print(f"[{num_tokens} tokens in {elapsed:.1f}s, {num_tokens / elapsed:.1f} tok/s]", file=sys.stderr)
    return 0
