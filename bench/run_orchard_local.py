"""Our HTTP stack without Ray: the ingress app over an in-process engine (LocalBackend) on uvicorn.

    python -m bench.run_orchard_local --model PATH --port 8000 [--decode-batch 128 ...]

Same arguments and model entry as bench.run_orchard_server; the FastAPI app, ModelService and
engine are the same code, but requests reach the engine without Serve's proxy, router and handle
streams. bench.compare runs it as the server `orchard_local`, so that "Ray Serve / no Ray" and
"no Ray / in-process engine" are measured ratios. A benchmark tool: 127.0.0.1 only.
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path
from typing import Optional

from bench.run_orchard_server import READY_LINE, model_entry_args, parse_args


async def serve_local(args, model_id: str) -> None:
    import uvicorn

    from deployments.config import ModelConfig
    from deployments.ingress import create_app
    from deployments.local_backend import LocalBackend
    from deployments.registry import Registry

    started = time.monotonic()
    backend = LocalBackend()
    await backend.deploy(ModelConfig.model_validate(model_entry_args(args, model_id)))
    registry = Registry(backend)
    await registry.start(restore=False)
    config = uvicorn.Config(create_app(registry), host="127.0.0.1", port=args.port, log_level="warning",
                            backlog=4096, timeout_keep_alive=30)
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    while not server.started and not task.done():
        await asyncio.sleep(0.1)
    print(f"{READY_LINE} model_id={model_id} port={args.port} in {time.monotonic() - started:.1f} s (no Ray)", flush=True)
    try:
        await task  # uvicorn handles SIGINT / SIGTERM: it stops serving and returns
    finally:
        await registry.close()
        await backend.close()


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    model_id = args.model_id or Path(args.model).resolve().name
    try:
        asyncio.run(serve_local(args, model_id))
    except Exception as exc:  # reported to the parent through the log; the exit code says it failed
        print(f"orchard (no Ray) failed: {type(exc).__name__}: {exc}", flush=True)
        return 2
    print("orchard server stopped", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
