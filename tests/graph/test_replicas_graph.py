"""Issue 56 on the CPU: one model served by two Serve replicas (each its own engine process). Streams from many
clients are shared by both; a replica killed (SIGKILL) mid-load ends only its own requests, each with an answer
(never a hang or a dropped connection), the other replica keeps serving new ones at once, and Serve starts a new
process in place of the dead one. Serve is given a graph of its own for this module (restarts_serve)."""

from __future__ import annotations

import copy
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
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
        running = [pool.submit(chat, http, True, 400) for _ in range(8)]
        time.sleep(1.0)
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
