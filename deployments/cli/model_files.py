"""`orchard default-model-path | import-gguf`: MLX model folders on this machine (engine/models makes them)."""

from __future__ import annotations

import argparse


def add_parser(commands: argparse._SubParsersAction) -> None:
    commands.add_parser("default-model-path", help="print the embedded default model's folder (converting it once)")
    convert = commands.add_parser("import-gguf", help="convert a llama-family GGUF file into an MLX model folder")
    convert.add_argument("gguf", help="path of the .gguf file")
    convert.add_argument("out_dir", help="new folder to write (must not exist)")
    convert.add_argument("--dtype", default="bfloat16", help="dtype of the dequantized weights")


def run(args: argparse.Namespace) -> int:
    # Imported here: the conversion imports MLX, which the parser of every `orchard` command should not wait for.
    if args.command == "import-gguf":
        from engine.models.gguf_import import convert_gguf

        print(convert_gguf(args.gguf, args.out_dir, dtype=args.dtype))
        return 0
    from engine.models.default_model import default_model_path

    print(default_model_path())
    return 0
