"""Issue 58, the Batches API through the real openai client over the ingress app and a tiny model's real engine: a
200-line batch answers as the same requests sent one by one (greedy); malformed lines go to the error file and the
rest run; a cancel keeps what finished; a restarted ingress resumes a batch without redoing a finished line."""

from __future__ import annotations

import asyncio
import json

import openai
import pytest

from deployments.batches.batches import BatchStore
from deployments.batches.files import FileStore
from deployments.config import ModelConfig
from tests.serve.local_stack import local_stack

BATCH_TIMEOUT_S = 300.0


def line(index: int, max_tokens: int = 6, **extra) -> dict:
    words = " ".join(f"t{(index * 7 + j) % 230}" for j in range(3 + index % 11))
    body = {"model": "alpha", "messages": [{"role": "user", "content": words}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True}
    return {"custom_id": f"req-{index}", "method": "POST", "url": "/v1/chat/completions", "body": body, **extra}


def jsonl(lines: list) -> bytes:
    return ("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n").encode()


def stores(tmp_path) -> dict:
    return {"files": FileStore(tmp_path / "files"), "batches": BatchStore(tmp_path / "batches")}


def client(stack) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url="http://orchard/v1", api_key="unused", http_client=stack.http, max_retries=0)


async def submit(api: openai.AsyncOpenAI, lines: list) -> str:
    uploaded = await api.files.create(file=("batch.jsonl", jsonl(lines)), purpose="batch")
    batch = await api.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                     completion_window="24h", metadata={"test": "yes"})
    assert (batch.object, batch.status, batch.input_file_id, batch.metadata) == (
        "batch", "validating", uploaded.id, {"test": "yes"})
    return batch.id


async def until(api: openai.AsyncOpenAI, batch_id: str, done) -> object:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + BATCH_TIMEOUT_S
    while True:
        batch = await api.batches.retrieve(batch_id)
        if done(batch):
            return batch
        assert loop.time() < deadline, batch
        await asyncio.sleep(0.1)


async def entries(api: openai.AsyncOpenAI, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(text) for text in (await api.files.content(file_id)).text.splitlines()]


def test_a_200_line_batch_answers_as_the_same_requests_sent_one_by_one(tiny_models, tmp_path):
    async def scenario():
        config = ModelConfig(model_path=str(tiny_models.alpha), enable_prefix_cache=False)
        async with local_stack([config], **stores(tmp_path)) as stack:
            api = client(stack)
            lines = [line(i) for i in range(200)]
            batch_id = await submit(api, lines)
            batch = await until(api, batch_id, lambda b: b.status in ("completed", "failed", "cancelled"))
            assert batch.status == "completed", batch
            counts = batch.request_counts
            assert (counts.total, counts.completed, counts.failed, batch.error_file_id) == (200, 200, 0, None)
            assert batch.in_progress_at and batch.finalizing_at and batch.completed_at
            output = {e["custom_id"]: e for e in await entries(api, batch.output_file_id)}
            assert sorted(output) == sorted(x["custom_id"] for x in lines)
            for request in lines:
                alone = (await stack.http.post("/v1/chat/completions", json=request["body"])).json()
                kept = output[request["custom_id"]]
                assert kept["error"] is None and kept["response"]["status_code"] == 200
                answered = kept["response"]["body"]
                assert answered["choices"] == alone["choices"] and answered["usage"] == alone["usage"], request["custom_id"]
            listed = await api.batches.list()
            assert [b.id for b in listed.data] == [batch_id]

    asyncio.run(scenario())


def test_malformed_lines_go_to_the_error_file_and_a_cancel_keeps_what_finished(tiny_models, tmp_path):
    async def scenario():
        config = ModelConfig(model_path=str(tiny_models.alpha))
        async with local_stack([config], **stores(tmp_path)) as stack:
            api = client(stack)
            # (A line that is not a JSON object never gets here: the upload refuses the file: test_files_local.py.)
            bad = [{**line(90), "url": "/v1/embeddings"}, {**line(91), "method": "GET"},
                   {**line(92), "custom_id": ""}, line(0), {**line(93), "body": {**line(93)["body"], "stream": True}}]
            lines = [line(i) for i in range(4)] + bad + [{**line(94), "body": {**line(94)["body"], "model": "nope"}}]
            batch = await until(api, await submit(api, lines), lambda b: b.status == "completed")
            assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (10, 4, 6)
            errors = await entries(api, batch.error_file_id)
            reasons = sorted(e["error"]["message"] for e in errors if e["error"] is not None)
            assert reasons == ["line 5: url must be the batch's endpoint /v1/chat/completions",
                               "line 6: method must be POST", "line 7: custom_id must be a non-empty string",
                               "line 8: custom_id 'req-0' repeats an earlier line's",
                               "line 9: a batch request cannot stream"]
            unknown = next(e for e in errors if e["custom_id"] == "req-94")  # ran, and was answered 404
            assert unknown["response"]["status_code"] == 404 and unknown["error"] is None
            assert len(await entries(api, batch.output_file_id)) == 4

            # Long lines: on a fast CPU 48 lines of 300 tokens all finished between the first's end and the cancel.
            slow = await submit(api, [line(i, max_tokens=3000) for i in range(48)])
            await until(api, slow, lambda b: b.request_counts.completed >= 1)
            cancelling = await api.batches.cancel(slow)
            assert cancelling.status in ("cancelling", "cancelled")
            cancelled = await until(api, slow, lambda b: b.status == "cancelled")
            kept = await entries(api, cancelled.output_file_id)
            assert 1 <= len(kept) < 48 and cancelled.request_counts.completed == len(kept)
            assert cancelled.cancelling_at and cancelled.cancelled_at
            with pytest.raises(openai.BadRequestError, match="Cannot cancel a batch that is completed"):
                await api.batches.cancel(batch.id)
            with pytest.raises(openai.NotFoundError):
                await api.batches.retrieve("batch_" + "0" * 24)

    asyncio.run(scenario())


def test_a_restarted_ingress_resumes_a_batch_without_redoing_a_finished_line(tiny_models, tmp_path):
    async def scenario():
        config = ModelConfig(model_path=str(tiny_models.alpha))
        lines = [line(i, max_tokens=400) for i in range(40)]
        async with local_stack([config], **stores(tmp_path)) as stack:
            api = client(stack)
            batch_id = await submit(api, lines)
            await until(api, batch_id, lambda b: b.request_counts.completed >= 1)
        # The ingress stopped mid-batch: its work file holds the lines answered so far.
        before = [json.loads(t) for t in (tmp_path / "batches" / batch_id / "output.jsonl").read_text().splitlines()]
        assert 1 <= len(before) < 40
        assert BatchStore(tmp_path / "batches").get(batch_id).status == "in_progress"
        async with local_stack([config], **stores(tmp_path)) as stack:
            api = client(stack)
            batch = await until(api, batch_id, lambda b: b.status == "completed")
            output = await entries(api, batch.output_file_id)
        assert sorted(e["custom_id"] for e in output) == sorted(x["custom_id"] for x in lines)  # each once
        assert [e["id"] for e in output[:len(before)]] == [e["id"] for e in before]  # kept, not redone
        assert batch.request_counts.completed == 40

    asyncio.run(scenario())
