"""The ingress side: HTTP routes, the model registry (load/unload, status, the persisted list) and its backends."""
