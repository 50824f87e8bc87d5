"""Wire formats: OpenAI request schemas, renderers from neutral chunks, SSE framing, error mapping."""
