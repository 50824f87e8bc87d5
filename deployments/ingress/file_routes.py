"""/v1/files: OpenAI's Files API for batch input files (deployments/batches/files.py keeps them): upload
(multipart: `file`, `purpose`), list, retrieve, delete and the content, OpenAI's objects to the letter."""

from __future__ import annotations

import asyncio
from typing import Any, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import FileResponse

from deployments.api.openapi_errors import ANY_ROUTE, error_responses
from deployments.batches.files import FileStore, list_page
from deployments.ingress.multipart import form_upload
from engine.errors import InvalidRequestError

FILES_ROUTE = "/v1/files"
# Room the multipart framing and the `purpose` field take around the file, on top of the store's max_bytes.
FILES_MULTIPART_OVERHEAD_BYTES = 64 * 1024
FILE_UPLOAD = (400, 401, *ANY_ROUTE)
FILE_LOOKUP = (401, 404, *ANY_ROUTE)
_UPLOAD_BODY = {"requestBody": {"required": True, "content": {"multipart/form-data": {"schema": {
    "type": "object", "required": ["file", "purpose"],
    "properties": {"file": {"type": "string", "format": "binary", "description": "JSONL: one request per line"},
                   "purpose": {"type": "string", "enum": ["batch"]}},
}}}}}


def files_router(store: FileStore) -> APIRouter:
    router = APIRouter()

    @router.post(FILES_ROUTE, responses=error_responses(FILE_UPLOAD), openapi_extra=_UPLOAD_BODY)
    async def upload(request: Request) -> dict[str, Any]:
        purpose, filename, data = await _upload_fields(request)
        stored = await asyncio.to_thread(store.create, purpose, filename, data)  # a large file's check and write
        return stored.to_wire()

    @router.get(FILES_ROUTE, responses=error_responses((400, 401, *ANY_ROUTE)))
    async def list_files(purpose: str | None = None, limit: int = Query(10000, ge=1, le=10000),
                         order: Literal["asc", "desc"] = "desc", after: str | None = None) -> dict[str, Any]:
        return list_page(store.listing(purpose, order), after, limit, "file")

    @router.get(FILES_ROUTE + "/{file_id}", responses=error_responses(FILE_LOOKUP))
    async def retrieve(file_id: str) -> dict[str, Any]:
        return store.get(file_id).to_wire()

    @router.delete(FILES_ROUTE + "/{file_id}", responses=error_responses(FILE_LOOKUP))
    async def delete(file_id: str) -> dict[str, Any]:
        store.delete(file_id)
        return {"id": file_id, "object": "file", "deleted": True}

    @router.get(FILES_ROUTE + "/{file_id}/content", responses=error_responses(FILE_LOOKUP),
                response_class=FileResponse)
    async def content(file_id: str) -> FileResponse:
        stored = store.get(file_id)
        return FileResponse(store.content_path(file_id), media_type="application/octet-stream",
                            filename=stored.filename)

    return router


async def _upload_fields(request: Request) -> tuple[str, str, bytes]:
    """The multipart fields `purpose` and `file`: the purpose, the file's name and bytes."""
    fields, name, data = await form_upload(request, "the file")
    if "purpose" not in fields:
        raise InvalidRequestError("the multipart field 'purpose' is required ('batch')", param="purpose")
    return fields["purpose"], name, data


__all__ = ["FILES_MULTIPART_OVERHEAD_BYTES", "FILES_ROUTE", "files_router"]
