"""LoRA adapters: read (weights.py), fused at load (fuse.py), applied per batch row (bank.py), named and slotted (registry.py)."""
