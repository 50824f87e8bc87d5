"""Load a vision-language model folder with mlx-vlm: weights (engine side), processor (serving side).

mlx-vlm runs a folder's own Python (`model_file` in config.json) and the processor classes a folder names when
asked to: like mlx-lm's models, only with `trust_remote_code`, which never comes from a request.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from engine.errors import ModelLoadError
from engine.mlx_settings import apply_mlx_settings
from engine.models.loader import LoadedModel, cast_model, load_tokenizer_only


def load_vision_model(
    path: str | Path, *, dtype: str | None = None, chat_template_file: str | Path | None = None,
    trust_remote_code: bool = False,
) -> LoadedModel:
    """The model for the engine: mlx-vlm's Model behind VisionLanguageModel, and the text tokenizer."""
    from mlx_vlm.utils import load_model as mlx_vlm_load_model

    from engine.vision.model import VisionLanguageModel
    from engine.vision.text_twin import load_text_twin

    apply_mlx_settings()
    folder, config = _checked_folder(path, trust_remote_code)
    try:
        model = mlx_vlm_load_model(folder, trust_remote_code=trust_remote_code)
    except Exception as exc:  # mlx-vlm raises many types; report them as one
        raise ModelLoadError(f"Could not load the multimodal model at '{path}': {exc}") from exc
    if dtype is not None:
        cast_model(model, dtype)
    tokenizer = load_tokenizer_only(folder, chat_template_file=chat_template_file, trust_remote_code=trust_remote_code)
    vision = VisionLanguageModel(model, _config_int(config, ("image_token_id", "image_token_index")))
    vision.text_twin = load_text_twin(folder, vision)
    return LoadedModel(model=vision, tokenizer=tokenizer, config=config, path=folder)


def load_vision_processor(path: str | Path, *, trust_remote_code: bool = False) -> Any:
    """The model's processor (mlx-vlm's, or the one its folder names): images and text to model inputs."""
    from mlx_vlm.utils import get_model_and_args, load_image_processor, load_processor

    folder, config = _checked_folder(path, trust_remote_code)
    try:
        get_model_and_args(config)  # imports the family's module, which registers mlx-vlm's processor classes
        processor = load_processor(folder, add_detokenizer=False, trust_remote_code=trust_remote_code)
        image_processor = load_image_processor(folder, trust_remote_code=trust_remote_code)
    except Exception as exc:
        raise ModelLoadError(f"Could not load the image processor at '{path}': {exc}") from exc
    if image_processor is not None:  # mlx-vlm's own, where the family has one (as mlx_vlm.load does)
        processor.image_processor = image_processor
    return processor


def read_media_token_ids(folder: str | Path) -> tuple[int, int | None]:
    """The placeholder token ids of an image and of a video (None: the model takes no video), from config.json."""
    config = json.loads((Path(folder) / "config.json").read_text(encoding="utf-8"))
    return image_token_id(config), _config_int(config, ("video_token_id", "video_token_index"))


def image_token_id(config: dict[str, Any]) -> int:
    """The id of the placeholder token each image's embeddings replace."""
    found = _config_int(config, ("image_token_id", "image_token_index"))
    if found is None:
        raise ModelLoadError("config.json names no image token (image_token_id / image_token_index)")
    return found


def _config_int(config: dict[str, Any], keys: tuple[str, ...]) -> int | None:
    for section in (config, config.get("text_config") or {}):
        for key in keys:
            if isinstance(section.get(key), int):
                return int(section[key])
    return None


def _checked_folder(path: str | Path, trust_remote_code: bool) -> tuple[Path, dict[str, Any]]:
    folder = Path(path).expanduser().resolve()
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise ModelLoadError(f"No model folder at '{path}' (config.json not found)")
    config = json.loads(config_file.read_text(encoding="utf-8"))
    if config.get("model_file") and not trust_remote_code:
        raise ModelLoadError(
            f"'{path}' runs its own model code ({config['model_file']}): load it with trust_remote_code if you trust it"
        )
    if "vision_config" not in config:
        raise ModelLoadError(f"'{path}' is not a vision-language model (config.json has no vision_config)")
    return folder, config
