"""Issue 56 on the CPU: one model served by two Serve replicas (each its own engine process). Streams from many
clients are shared by both; a replica killed (SIGKILL) mid-load ends only its own requests, each with an answer
(never a hang or a dropped connection), the other replica keeps serving new ones at once, and Serve starts a new
process in place of the dead one. Serve is given a graph of its own for this module (restarts_serve)."""

from __future__ import annotations

import copy
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import yaml

from deployments.config import MODEL_SERVER_DEPLOYMENT, serve_app_name
from tests.graph.conftest import GRAPH_START_S, deploy_graph, model_running, shared_graph_needed_again
from tests.graph.shared_graph import REPO, deploy_shared_graph
from tests.support.serving import wait_until

pytestmark = pytest.mark.restarts_serve
TWO = "tiny-two"
APP = serve_app_name(TWO)


def replica_pids() -> set[int]:
    """The Ray workers running the model's replicas (Ray titles each ray::ServeReplica:APP:DEPLOYMENT)."""
    title = f"ray::ServeReplica:{APP}:{MODEL_SERVER_DEPLOYMENT}".encode()
    pids = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if (entry / "cmdline").read_bytes().split(b"\0")[0] == title:
                    pids.add(int(entry.name))
            except OSError:
                continue
    return pids


def cpu_ticks(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


@pytest.fixture(scope="module")
def two_replicas(serve_cluster, tiny_models, tmp_path_factory):
    from ray.serve.schema import ServeDeploySchema

    ingress, template, _ = yaml.safe_load((REPO / "serve_config.yaml").read_text())["applications"]
    ingress["args"].update(state_dir=str(tmp_path_factory.mktemp("replicas-state")), status_poll_interval_s=0.5,
                           rag=None)
    model = copy.deepcopy(template)
    model["name"] = APP
    model["args"].update(model_id=TWO, model_path=str(tiny_models.alpha), num_replicas=2)
    deploy_graph(ServeDeploySchema.model_validate({"applications": [ingress, model]}))
    try:
        yield serve_cluster
    finally:
        if serve_cluster.shared_schema is not None and shared_graph_needed_again():
            deploy_shared_graph(serve_cluster.shared_schema, serve_cluster.base_url)


def chat(http: httpx.Client, stream: bool = False, max_tokens: int = 24) -> httpx.Response:
    return http.post("/v1/chat/completions", json={
        "model": TWO, "messages": [{"role": "user", "content": "t1 t2 t3"}], "max_tokens": max_tokens,
        "temperature": 0, "ignore_eos": True, "stream": stream})


@dataclass
class StreamAnswer:
    status_code: int
    text: str


def long_stream(http: httpx.Client, started: threading.Semaphore, max_tokens: int = 3000) -> StreamAnswer:
    """A streamed chat read to its end; `started` is released at its first chunk (it is then in an engine)."""
    body = {"model": TWO, "messages": [{"role": "user", "content": "t1 t2 t3"}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True}
    chunks: list[str] = []
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        for chunk in response.iter_text():
            if not chunks:
                started.release()
            chunks.append(chunk)
    return StreamAnswer(response.status_code, "".join(chunks))


def conversation(http: httpx.Client, index: int) -> int:
    """Two turns of one conversation; the second turn's cached prompt tokens (its replica holds the first's)."""
    messages = [{"role": "user", "content": " ".join(f"t{(index * 37 + j) % 230}" for j in range(64))}]
    body = {"model": TWO, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    first = http.post("/v1/chat/completions", json={**body, "messages": messages})
    assert first.status_code == 200, first.text
    messages += [{"role": "assistant", "content": first.json()["choices"][0]["message"]["content"]},
                 {"role": "user", "content": "t1 t2 t3"}]
    second = http.post("/v1/chat/completions", json={**body, "messages": messages})
    assert second.status_code == 200, second.text
    return (second.json()["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0


def test_streams_go_over_each_replicas_channel_and_a_conversation_stays_on_its_replica(two_replicas):
    with httpx.Client(base_url=two_replicas.base_url, timeout=120) as http, ThreadPoolExecutor(8) as pool:
        wait_until(lambda: len(replica_pids()) == 2 and chat(http).status_code == 200, GRAPH_START_S,
                   what="two replicas serving")
        wait_until(lambda: len(replica_rows(http)) == 2, 30, what="both replicas on the board")
        # Eight conversations at once: each one's second turn finds its first in its replica's prefix cache (Serve's
        # router alone would send half of them to the other replica).
        cached = list(pool.map(lambda i: conversation(http, i), range(8)))
        assert all(tokens >= 48 for tokens in cached), cached
        answers = list(pool.map(lambda _: chat(http, stream=True), range(16)))
        assert all(a.status_code == 200 and "[DONE]" in a.text for a in answers)
        time.sleep(1.5)  # the replicas' next reports
        model = queue_row(http)
        rows = model["replicas"]
        assert sorted(r["pid"] for r in rows) == sorted(replica_pids())
        assert all(r["stream_channel_streams_total"] > 0 and r["health"] == "running" for r in rows), rows
        assert sum(r["stream_channel_streams_total"] for r in rows) == model["stream_channel_streams_total"] >= 32
        assert sum(r["generation_tokens_total"] for r in rows) == model["generation_tokens_total"]
        metrics = http.get("/metrics").text
        for row in rows:
            assert f'model_name="{TWO}",replica="{row["replica_id"]}"' in metrics


def queue_row(http: httpx.Client) -> dict:
    return next(m for m in http.get("/v1/queue/stats").json()["models"] if m["id"] == TWO)


def replica_rows(http: httpx.Client) -> list[dict]:
    return queue_row(http).get("replicas") or []


def test_two_replicas_share_the_streams_and_a_killed_one_leaves_the_other_serving(two_replicas):
    with httpx.Client(base_url=two_replicas.base_url, timeout=120) as http, ThreadPoolExecutor(16) as pool:
        wait_until(lambda: len(replica_pids()) == 2 and chat(http).status_code == 200, GRAPH_START_S,
                   what="two replicas serving")
        pids = replica_pids()
        before = {pid: cpu_ticks(pid) for pid in pids}
        answers = list(pool.map(lambda _: chat(http, stream=True), range(32)))
        assert all(a.status_code == 200 and "[DONE]" in a.text for a in answers)
        used = {pid: cpu_ticks(pid) - before[pid] for pid in pids}
        assert min(used.values()) >= 0.25 * max(used.values()), used  # both served a share (CPU ticks)

        victim = min(pids)
        # Killed once all eight streams run (a fast CPU finished 400-token streams within a fixed second's wait).
        started = threading.Semaphore(0)
        running = [pool.submit(long_stream, http, started) for _ in range(8)]
        for _ in running:
            assert started.acquire(timeout=60), "a stream never started"
        os.kill(victim, signal.SIGKILL)
        after_kill = [chat(http) for _ in range(6)]  # the survivor answers at once, not the replacement
        assert [a.status_code for a in after_kill] == [200] * 6, [a.text for a in after_kill]
        ended = [future.result(timeout=120) for future in running]
        # The victim's streams end with an error event, then [DONE]; the survivor's finish.
        died = [a for a in ended if '"code":"engine_dead"' in a.text]
        finished = [a for a in ended if '"finish_reason":"length"' in a.text and '"error"' not in a.text]
        assert all(a.status_code == 200 and a.text.endswith("data: [DONE]\n\n") for a in ended)
        assert len(died) + len(finished) == 8 and died and finished, [a.text[-200:] for a in ended]
        wait_until(lambda: len(replica_pids() - {victim}) == 2, GRAPH_START_S, what="a new replica in place")
        wait_until(lambda: model_running(http, TWO), GRAPH_START_S, what="the model running")
        assert chat(http).status_code == 200
