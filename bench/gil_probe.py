"""Which MLX calls keep the GIL while the device is busy (a diagnostic for the lent GPU).

    python -m bench.gil_probe

For each call: ~40 ms of matmuls are queued (async_eval), then the call runs while a thread asks for the GIL
every 0.5 ms. A call that waits on the device with the GIL released shows a wall time near 40 ms and short
stalls; one that waits holding it shows a stall as long as its wall time: every other thread of the process
(the replica's event loop, Ray's threads) stops meanwhile.
"""

from __future__ import annotations

import argparse
import threading
import time

import mlx.core as mx

TICK_S = 0.0005


class GilMeter:
    def __init__(self) -> None:
        self.worst_s = 0.0
        self._ticking = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            asked = time.perf_counter()
            time.sleep(TICK_S)
            self.worst_s = max(self.worst_s, time.perf_counter() - asked - TICK_S)
            self._ticking.set()

    def __enter__(self) -> "GilMeter":
        self._thread.start()
        self._ticking.wait()
        return self

    def __exit__(self, *_exc) -> None:
        self._stop.set()
        self._thread.join()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=8192, help="of the square matmuls queued (8192: ~40 ms on an H100)")
    size = parser.parse_args().size
    weight = mx.random.normal((size, size)).astype(mx.bfloat16)
    small = mx.ones((4,))
    mx.eval(weight, small)

    def busy() -> mx.array:
        x = weight
        for _ in range(24):
            x = (x @ weight) * 1e-2
        return x

    calls = {
        "nothing (sleep 30 ms)": lambda x: time.sleep(0.03),
        "mx.eval(dependent scalar)": lambda x: mx.eval(x[0, 0]),
        "dependent .item()": lambda x: x[0, 0].item(),
        "dependent .tolist()": lambda x: x[0, :4].tolist(),
        "mx.eval(independent small)": lambda x: mx.eval(small + 1),
        "independent .tolist()": lambda x: (small * 2).tolist(),
        "mx.array(list) + eval": lambda x: mx.eval(mx.array(list(range(4096)))),
        "mx.synchronize()": lambda x: mx.synchronize(),
        "mx.clear_cache()": lambda x: mx.clear_cache(),
        "graph build (200 slices)": lambda x: [x[i : i + 1] * 2 for i in range(200)],
        "np.array(dependent)": lambda x: __import__("numpy").array(x[0, :4].astype(mx.float32)),
    }
    busy_alone = busy()
    started = time.perf_counter()
    mx.eval(busy_alone)
    print(f"queued work alone: {1e3 * (time.perf_counter() - started):.1f} ms")
    print(f"{'call':32s} {'wall ms':>8s} {'worst GIL stall ms':>19s}")
    for name, call in calls.items():
        for _ in range(2):  # the second run is reported: first-use costs out of the way
            x = busy()
            mx.async_eval(x)
            with GilMeter() as meter:
                started = time.perf_counter()
                call(x)
                wall = time.perf_counter() - started
            mx.eval(x)
        print(f"{name:32s} {1e3 * wall:8.1f} {1e3 * meter.worst_s:19.1f}", flush=True)


if __name__ == "__main__":
    main()
