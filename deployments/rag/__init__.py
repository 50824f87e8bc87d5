"""PDF / text RAG core: extraction, chunking, a crash-safe FAISS store and the pipeline tying them (no Ray, no HTTP)."""
