"""An image model as mflux runs it: loaded once from a local folder, then one image at a time.

The model's dimensions come from its folder's component configs (`transformer/config.json`, `text_encoder/config.json`
in the Hugging Face layout) laid over mflux's registry entry for the family, so any folder of the family's layout
loads as itself, a tiny random one included. Progress: mflux calls an in-loop callback after every denoising step;
ours hands (step, steps) to the generation running, and whatever that raises (a cancelled request) ends it there.
"""

from __future__ import annotations

import copy
import inspect
import json
import logging
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from engine.device_memory import accelerator_memory_bytes, device_memory_bytes
from engine.errors import InvalidRequestError
from engine.images.families import ImageFamily
from engine.process_memory import available_memory_bytes

logger = logging.getLogger(__name__)

OnStep = Callable[[int, int], None]  # (steps done, steps in all); raises to stop the generation


@dataclass
class ImageSpec:
    """One image to make: the model's inputs."""

    prompt: str
    width: int
    height: int
    steps: int
    guidance: float
    seed: int
    images: list[bytes] = field(default_factory=list)  # an edit's input images, as uploaded (PNG, JPEG, WebP)


class _StepWatch:
    """mflux's in-loop callback (registered once): reports each finished step to the generation running."""

    def __init__(self) -> None:
        self.on_step: OnStep | None = None

    def call_in_loop(self, t: int, seed: int, prompt: str, latents, config, time_steps) -> None:
        if self.on_step is not None:
            self.on_step(t + 1, config.num_inference_steps)


def free_memory_bytes() -> int:
    """What a model loaded now could still take: a CUDA card's memory less MLX's use of it in this process (other
    processes' use unseen); else the OS's available memory (unified memory: every process's models count), or,
    where the OS does not say, the device's less this process's use."""
    import mlx.core as mx

    if mx.cuda.is_available() and mx.default_device() == mx.gpu:
        return accelerator_memory_bytes() - mx.get_active_memory()
    available = available_memory_bytes()
    return available if available is not None else device_memory_bytes() - mx.get_active_memory()


def component_overrides(folder: Path, component: str, accepted: Callable) -> dict:
    """The fields of `folder/component/config.json` that mflux's module `accepted` takes ({} without the file)."""
    path = folder / component / "config.json"
    if not path.is_file():
        return {}
    config = json.loads(path.read_text())
    names = set(inspect.signature(accepted).parameters) - {"self"}
    return {key: tuple(value) if isinstance(value, list) else value for key, value in config.items() if key in names}


def model_config(family: ImageFamily, folder: Path):
    """mflux's ModelConfig of the family with the folder's own dimensions (a copy: the registry's stays as it is)."""
    from mflux.models.common.config.model_config import AVAILABLE_MODELS
    from mflux.models.flux2.model.flux2_text_encoder.qwen3_text_encoder import Qwen3TextEncoder
    from mflux.models.flux2.model.flux2_transformer.transformer import Flux2Transformer

    config = copy.copy(AVAILABLE_MODELS[family.mflux_model])
    config.transformer_overrides = {**config.transformer_overrides,
                                    **component_overrides(folder, "transformer", Flux2Transformer.__init__)}
    config.text_encoder_overrides = {**config.text_encoder_overrides,
                                     **component_overrides(folder, "text_encoder", Qwen3TextEncoder.__init__)}
    return config


class ImageGenerator:
    def __init__(self, folder: Path, family: ImageFamily, quantize: int | None = None,
                 lora_paths: list[str] | None = None, lora_scales: list[float] | None = None) -> None:
        """`quantize`: 4 or 8 bits (mflux quantizes at load), None or 16: the weights as stored."""
        from mflux.models.flux2.variants import Flux2Klein, Flux2KleinEdit

        self.family = family
        model_class = Flux2KleinEdit if family.edits else Flux2Klein
        self._model = model_class(quantize=None if quantize in (None, 16) else quantize, model_path=str(folder),
                                  lora_paths=lora_paths or None, lora_scales=lora_scales or None,
                                  model_config=model_config(family, folder))
        import mlx.core as mx

        # Weights read now, not at the first image; and evaluated arrays can serve any thread (a lazy one needs the
        # MLX stream of the thread that made it)
        mx.eval(self._model.parameters())
        self._watch = _StepWatch()
        self._model.callbacks.register(self._watch)

    @property
    def model(self):
        """mflux's model object (batch.py runs its parts)."""
        return self._model

    def generate(self, spec: ImageSpec, on_step: OnStep | None = None):
        """The image (a PIL image); on_step(done, steps) after every denoising step, raising to stop it there."""
        self._watch.on_step = on_step
        try:
            if not self.family.edits:
                return self._model.generate_image(seed=spec.seed, prompt=spec.prompt, num_inference_steps=spec.steps,
                                                  height=spec.height, width=spec.width, guidance=spec.guidance).image
            with tempfile.TemporaryDirectory(prefix="orchard-edit-") as folder:
                paths = _written_images(spec.images, Path(folder))
                return self._model.generate_image(seed=spec.seed, prompt=spec.prompt, num_inference_steps=spec.steps,
                                                  height=spec.height, width=spec.width, guidance=spec.guidance,
                                                  image_paths=paths).image
        finally:
            self._watch.on_step = None


def _written_images(images: list[bytes], folder: Path) -> list[str]:
    """The uploads as PNG files for mflux (it reads images by path), each checked to be a readable image."""
    from PIL import Image, UnidentifiedImageError
    import io

    paths = []
    for index, data in enumerate(images):
        try:
            with Image.open(io.BytesIO(data)) as image:
                path = folder / f"image-{index}.png"
                image.convert("RGB").save(path)
        except (UnidentifiedImageError, OSError) as exc:
            raise InvalidRequestError(f"'image[{index}]' is not an image this server reads (PNG, JPEG, WebP): {exc}",
                                      param="image") from exc
        paths.append(str(path))
    return paths


__all__ = ["ImageGenerator", "ImageSpec", "OnStep", "free_memory_bytes", "model_config"]
