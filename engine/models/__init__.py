"""Models: loading a local folder through mlx-lm (loader.py), the model as backbone + output head where that is
exactly its call (head_split.py), quantization, and GGUF import with the embedded default model.

Import `engine.models.loader` / `engine.models.default_model` / `engine.models.gguf_import` for the MLX parts;
`engine.models.names` holds MLX-free constants.
"""
