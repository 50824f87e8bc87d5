"""Issue 58 through the real graph (the session's shared graph on Ray Serve, over HTTP): the openai client uploads a
batch file, creates a batch, waits for it and reads its output, each line equal to the same request sent alone."""

from __future__ import annotations

import json
import time

import httpx
import openai

from tests.graph.shared_graph import ALPHA

LINES = 12


def test_a_batch_runs_through_the_graph_as_its_requests_sent_alone(shared_graph):
    client = openai.OpenAI(base_url=f"{shared_graph.url}/v1", api_key="unused", max_retries=0, timeout=120)
    bodies = {f"q{i}": {"model": ALPHA, "messages": [{"role": "user", "content": f"t{i} t{i + 1} t{i + 2}"}],
                        "max_tokens": 5, "temperature": 0, "ignore_eos": True} for i in range(LINES)}
    text = "\n".join(json.dumps({"custom_id": c, "method": "POST", "url": "/v1/chat/completions", "body": b})
                     for c, b in bodies.items())
    uploaded = client.files.create(file=("graph.jsonl", text.encode()), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    deadline = time.monotonic() + 120
    while batch.status not in ("completed", "failed", "cancelled", "expired"):
        assert time.monotonic() < deadline, batch
        time.sleep(0.2)
        batch = client.batches.retrieve(batch.id)
    assert batch.status == "completed" and batch.request_counts.completed == LINES, batch
    output = [json.loads(t) for t in client.files.content(batch.output_file_id).text.splitlines()]
    with httpx.Client(base_url=shared_graph.url, timeout=120) as http:
        for entry in output:
            alone = http.post("/v1/chat/completions", json=bodies[entry["custom_id"]]).json()
            assert entry["response"]["body"]["choices"] == alone["choices"], entry["custom_id"]
    assert batch.id in [b.id for b in client.batches.list().data]
