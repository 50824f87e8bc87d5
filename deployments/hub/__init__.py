"""Models from the Hugging Face Hub: downloads (downloads.py), the local cache (cache.py), progress events
(events.py), repo ids and cache paths (paths.py), typed errors (errors.py). The engine only loads the folders."""
