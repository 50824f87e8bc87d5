"""Model names shared by the engine and the serving layer (no MLX import here)."""

DEFAULT_MODEL_ID = "SmolLM2-135M-Instruct"
