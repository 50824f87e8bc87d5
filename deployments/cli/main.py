"""`orchard`: the command line. Each command is a module of this package with `add_parser(commands)` and
`run(args) -> int`; a module may own several commands (`run` then reads `args.command`)."""

from __future__ import annotations

import argparse
import importlib

# Every `orchard` command -> its module under deployments.cli, in the order `orchard --help` lists them. The modules
# import what their command runs (MLX, the engine, the load generator) only when it runs, so `orchard ls` stays fast.
COMMANDS: dict[str, str] = {
    "generate": "generate",
    "default-model-path": "model_files", "import-gguf": "model_files",
    "pull": "hub_cache", "ls": "hub_cache", "rm": "hub_cache",
    "serve": "serve", "chat": "chat", "transcribe": "transcribe", "say": "say", "top": "top", "bench": "bench",
    "doctor": "doctor",
}


def _module(name: str):
    return importlib.import_module(f"deployments.cli.{name}")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="orchard", description="Orchard: MLX continuous-batching inference")
    commands = parser.add_subparsers(dest="command", required=True)
    for module_name in dict.fromkeys(COMMANDS.values()):
        _module(module_name).add_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    return _module(COMMANDS[args.command]).run(args)


if __name__ == "__main__":
    raise SystemExit(main())
