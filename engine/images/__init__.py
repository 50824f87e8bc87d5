"""Image generation and editing: the model families served (families.py, plain) and mflux's models run (generator.py)."""
