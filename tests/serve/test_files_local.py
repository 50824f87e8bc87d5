"""Issue 58, the Files API (/v1/files) through the real openai client over the ingress app: a batch file uploaded,
listed, retrieved, read back byte for byte and deleted, kept across a restart of the store; what is refused (another
purpose, a line that is not a JSON object, a file over the limit, an id that names a path)."""

from __future__ import annotations

import asyncio
import json

import openai
import pytest

from deployments.batches.files import FileStore
from tests.serve.local_stack import local_stack

LINES = [{"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions",
          "body": {"model": "alpha", "messages": [{"role": "user", "content": f"t{i}"}], "max_tokens": 4}}
         for i in range(3)]
BATCH_FILE = ("\n".join(json.dumps(line) for line in LINES) + "\n").encode()


def client(stack) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url="http://orchard/v1", api_key="unused", http_client=stack.http, max_retries=0)


def test_a_batch_file_round_trips_through_the_openai_client(tmp_path):
    async def scenario():
        async with local_stack([], files=FileStore(tmp_path / "files")) as stack:
            files = client(stack).files
            created = await files.create(file=("requests.jsonl", BATCH_FILE), purpose="batch")
            assert (created.object, created.purpose, created.filename, created.bytes, created.status) == (
                "file", "batch", "requests.jsonl", len(BATCH_FILE), "processed")
            assert created.id.startswith("file-")
            second = await files.create(file=("../../etc/more.jsonl", (json.dumps(LINES[0]) + "\n").encode()), purpose="batch")
            assert second.filename == "more.jsonl"  # the client's name is metadata: no directories kept

            assert (await files.retrieve(created.id)).model_dump() == created.model_dump()
            assert (await files.content(created.id)).content == BATCH_FILE
            listed = await files.list(purpose="batch", order="asc")
            assert [f.id for f in listed.data] == [created.id, second.id]
            assert [f.id for f in (await files.list()).data] == [second.id, created.id]  # newest first

            deleted = await files.delete(second.id)
            assert (deleted.id, deleted.deleted) == (second.id, True)
            with pytest.raises(openai.NotFoundError):
                await files.retrieve(second.id)
        # Kept on disk: a new store over the same folder (the ingress restarted) holds the file.
        again = FileStore(tmp_path / "files")
        assert again.get(created.id).bytes == len(BATCH_FILE)
        assert again.content_path(created.id).read_bytes() == BATCH_FILE

    asyncio.run(scenario())


def test_what_the_files_api_refuses(tmp_path):
    async def scenario():
        async with local_stack([], files=FileStore(tmp_path / "files", max_bytes=2048)) as stack:
            files = client(stack).files
            with pytest.raises(openai.BadRequestError, match="purpose must be one of"):
                await files.create(file=("a.jsonl", BATCH_FILE), purpose="fine-tune")
            with pytest.raises(openai.BadRequestError, match="Line 2 is not JSON"):
                await files.create(file=("a.jsonl", b'{"a": 1}\n{"a": \n'), purpose="batch")
            with pytest.raises(openai.BadRequestError, match="Line 1 is not a JSON object"):
                await files.create(file=("a.jsonl", b"[1, 2]\n"), purpose="batch")
            with pytest.raises(openai.BadRequestError, match="no JSONL lines"):
                await files.create(file=("a.jsonl", b"\n\n"), purpose="batch")
            with pytest.raises(openai.BadRequestError, match="at most 2048"):
                await files.create(file=("a.jsonl", BATCH_FILE * 8), purpose="batch")
            too_big = await stack.http.post("/v1/files", files={"file": ("a.jsonl", b"x" * 200_000)},
                                            data={"purpose": "batch"})
            assert too_big.status_code == 413  # the body limit: refused before the form is read
            for name in ("file-zz", "file-" + "0" * 24, "file-..%2F..%2Fetc%2Fpasswd", ".."):
                missing = await stack.http.get(f"/v1/files/{name}")
                assert missing.status_code == 404, (name, missing.text)
            escaped = await stack.http.get("/v1/files/file-..%2F..%2Fetc%2Fpasswd")
            assert escaped.json()["error"]["code"] in ("file_not_found", "not_found")
            with pytest.raises(openai.NotFoundError):
                await files.content("file-" + "1" * 24)
            assert (await files.list()).data == []

    asyncio.run(scenario())
