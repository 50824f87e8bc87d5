"""What an image model will take in memory, from its folder (plain Python: the safetensors' sizes, no MLX)."""

from __future__ import annotations

from pathlib import Path

from engine.errors import InsufficientMemoryError

GIB = 1024**3
QUANTIZED_COMPONENTS = ("transformer", "text_encoder")  # what mflux quantizes; the VAE stays as stored
STORED_BITS = 16  # the families' weights ship in bfloat16
WORKING_SHARE = 0.25  # activations and MLX's buffer cache at 1024x1024, over the weights (a margin, not a measure)


def image_model_bytes(folder: Path, bits: int | None) -> int:
    """The weights once loaded (quantized to `bits` where mflux quantizes; None or 16: as stored), plus the working
    share."""
    total = 0
    for component in folder.iterdir() if folder.is_dir() else ():
        stored = sum(f.stat().st_size for f in component.glob("*.safetensors")) if component.is_dir() else 0
        share = bits / STORED_BITS if bits in (4, 8) and component.name in QUANTIZED_COMPONENTS else 1.0
        total += int(stored * share)
    return int(total * (1 + WORKING_SHARE))


def check_fits(model_id: str, folder: Path, bits: int | None, free_bytes: int | None) -> None:
    """InsufficientMemoryError (507) when the model would not fit what is free (None: not known, not checked)."""
    needed = image_model_bytes(folder, bits)
    if free_bytes is not None and needed > free_bytes:
        raise InsufficientMemoryError(
            f"The image model '{model_id}' needs about {needed / GIB:.1f} GiB (its weights at "
            f"{bits if bits in (4, 8) else STORED_BITS} bits, and room to work); {max(free_bytes, 0) / GIB:.1f} GiB "
            "are free beside the models running: unload one, or load it with quantize 4", param="model_path")


__all__ = ["check_fits", "image_model_bytes"]
