"""The image model families Orchard serves, by config_name (plain Python: config validation reads it without MLX).

Each names mflux's model entry (its ModelConfig registry key) and class, whether it edits (takes input images) and
its defaults. FLUX.2 [klein] first: mflux builds its dimensions from the model folder's component configs (so a tiny
random model of it loads, as the tests' does), its transformer and VAE take a batch of images, and it generates in 4
steps. mflux's other families (FLUX.1, Qwen-Image, Z-Image, FIBO) load differently each and come next.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.errors import InvalidRequestError


@dataclass(frozen=True)
class ImageFamily:
    name: str  # the config_name
    mflux_model: str  # mflux's ModelConfig registry key
    edits: bool  # an image-edit model: requests bring the images to edit
    default_steps: int
    default_guidance: float
    max_input_images: int = 0
    repository: str = ""  # where its weights live on the Hugging Face Hub


FAMILIES: dict[str, ImageFamily] = {
    family.name: family
    for family in (
        ImageFamily("flux2-klein-4b", "flux2-klein-4b", False, 4, 1.0, repository="black-forest-labs/FLUX.2-klein-4B"),
        ImageFamily("flux2-klein-9b", "flux2-klein-9b", False, 4, 1.0, repository="black-forest-labs/FLUX.2-klein-9B"),
        ImageFamily("flux2-klein-edit-4b", "flux2-klein-4b", True, 4, 1.0, max_input_images=4,
                    repository="black-forest-labs/FLUX.2-klein-4B"),
        ImageFamily("flux2-klein-edit-9b", "flux2-klein-9b", True, 4, 1.0, max_input_images=4,
                    repository="black-forest-labs/FLUX.2-klein-9B"),
    )
}
MODEL_TYPES = {"image-generation": False, "image-edit": True}  # model_type -> edits


def image_family(config_name: str | None, model_type: str) -> ImageFamily:
    """The family a model of this model_type and config_name runs; a typed 400 listing the names it could have."""
    edits = MODEL_TYPES[model_type]
    names = [name for name, family in FAMILIES.items() if family.edits == edits]
    family = FAMILIES.get(config_name or "")
    if family is None or family.edits != edits:
        said = f"config_name '{config_name}'" if config_name else "no config_name"
        raise InvalidRequestError(f"model_type {model_type} with {said}: this server runs {', '.join(names)}",
                                  param="config_name")
    return family


__all__ = ["FAMILIES", "ImageFamily", "image_family"]
