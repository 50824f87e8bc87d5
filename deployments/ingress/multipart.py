"""A multipart/form-data upload (RAG's documents, the Files API's files): its text fields and its one file, read
with bounded counts of files and fields (the body limit has already bounded its size)."""

from __future__ import annotations

import contextlib

from fastapi import Request
from starlette.datastructures import UploadFile

from engine.errors import InvalidRequestError


async def form_upload(request: Request, what: str) -> tuple[dict[str, str], str, bytes]:
    """The form's text fields, and the field `file`'s name as sent and bytes; `what` names the file in errors."""
    if not request.headers.get("content-type", "").startswith("multipart/form-data"):
        raise InvalidRequestError(f"send {what} as multipart/form-data, in the field 'file'", param="file")
    try:
        form = await request.form(max_files=1, max_fields=16)
    except Exception as exc:  # starlette's MultiPartException / HTTPException on a malformed or oversized form
        raise InvalidRequestError(f"malformed multipart body: {getattr(exc, 'detail', exc)}", param="file") from exc
    async with contextlib.AsyncExitStack() as stack:
        stack.push_async_callback(form.close)
        upload = form.get("file")
        if not isinstance(upload, UploadFile):
            raise InvalidRequestError(f"send {what} in the multipart field 'file'", param="file")
        fields = {name: value for name, value in form.multi_items() if isinstance(value, str)}
        return fields, upload.filename or "", await upload.read()


__all__ = ["form_upload"]
