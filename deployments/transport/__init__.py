"""How the ingress and a model replica exchange generations: Ray Serve handles, or the stream channel.

- `model_client.py`: the ingress's client of a model (ServeModelClient), which picks the channel or the handle;
- `channel.py`: the stream channel, both ends (one Unix socket carries every stream of an ingress-replica pair);
- `chunks.py`: the replica's time-coalescing of a stream's chunks;
- `errors.py`: the one mapping of a refused, missing or dead replica to our typed errors.
"""
