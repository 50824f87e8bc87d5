"""Model import: the embedded default model and GGUF conversion to MLX folders.

Import `engine.models.default_model` / `engine.models.gguf_import` for the MLX parts;
`engine.models.names` holds MLX-free constants.
"""
