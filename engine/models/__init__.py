"""Model import: the embedded default model and GGUF conversion to MLX folders."""

from engine.models.default_model import DEFAULT_MODEL_ID, default_model_path
from engine.models.gguf_import import convert_gguf

__all__ = ["DEFAULT_MODEL_ID", "convert_gguf", "default_model_path"]
