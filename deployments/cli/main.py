"""`orchard`: the command line. Engine commands (generate, pull/ls/rm, import-gguf) come from engine/cli.py; the
commands about a server (serve, chat, top, bench, doctor) are modules of this package, each with
`add_parser(commands)` and `run(args) -> int`."""

from __future__ import annotations

import argparse
import importlib

from engine.cli import add_engine_commands, run_engine_command

# Subcommand name -> module under deployments.cli; imported only when used, so `orchard ls` stays fast.
SERVER_COMMANDS: dict[str, str] = {
    "serve": "serve", "chat": "chat", "top": "top", "bench": "bench", "doctor": "doctor",
}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="orchard", description="Orchard: MLX continuous-batching inference")
    commands = parser.add_subparsers(dest="command", required=True)
    add_engine_commands(commands)
    for module_name in SERVER_COMMANDS.values():
        importlib.import_module(f"deployments.cli.{module_name}").add_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command not in SERVER_COMMANDS:
        return run_engine_command(args)
    return importlib.import_module(f"deployments.cli.{SERVER_COMMANDS[args.command]}").run(args)


if __name__ == "__main__":
    raise SystemExit(main())
