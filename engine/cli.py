"""The `orchard` commands that need no server (deployments/cli/main.py adds the server ones): generate with the
engine in process; pull / ls / rm models of the local Hugging Face cache (engine/hub_cli.py)."""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

from engine.hub_cli import add_hub_commands, run_hub_command


def add_engine_commands(commands: argparse._SubParsersAction) -> None:
    """The commands that need no server: they run the engine or the hub cache in this process."""
    generate = commands.add_parser("generate", help="answer one chat message with a local model")
    generate.add_argument("prompt", help="the user message")
    generate.add_argument("--model", default=None, help="local model folder (default: the embedded SmolLM2-135M-Instruct)")
    generate.add_argument("--max-tokens", type=int, default=128)
    generate.add_argument("--temperature", type=float, default=0.0)
    generate.add_argument("--seed", type=int, default=None)
    generate.add_argument("--dtype", default=None, help="run the weights in this dtype (float32, bfloat16, float16)")
    generate.add_argument("--system", default=None, help="an optional system message")
    commands.add_parser("default-model-path", help="print the embedded default model's folder (converting it once)")
    convert = commands.add_parser("import-gguf", help="convert a llama-family GGUF file into an MLX model folder")
    convert.add_argument("gguf", help="path of the .gguf file")
    convert.add_argument("out_dir", help="new folder to write (must not exist)")
    convert.add_argument("--dtype", default="bfloat16", help="dtype of the dequantized weights")
    add_hub_commands(commands)


def _generate(args: argparse.Namespace) -> int:
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


def run_engine_command(args: argparse.Namespace) -> int:
    if args.command == "generate":
        return _generate(args)
    if args.command in ("pull", "ls", "rm"):
        return run_hub_command(args)
    if args.command == "import-gguf":
        from engine.models.gguf_import import convert_gguf

        print(convert_gguf(args.gguf, args.out_dir, dtype=args.dtype))
        return 0
    from engine.models.default_model import default_model_path

    print(default_model_path())
    return 0
