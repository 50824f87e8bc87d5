"""Embedding models (model_type: embedding): sentence-transformers behind the same ModelServer as chat models."""
