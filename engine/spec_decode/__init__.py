"""Speculative decoding inside the continuous batch: proposers (n-gram lookup, draft model), verification by the
target's own sampler, per-row adaptive draft lengths and acceptance stats."""
