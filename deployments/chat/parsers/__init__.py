"""Output parsers: model text -> content, reasoning and tool-call deltas (plain Python, no MLX)."""
