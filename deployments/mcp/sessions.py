"""MCP sessions: one server's client (the `mcp` SDK's), connected at first use and kept, listing its tools and running
calls within the loop's bounds; every failure comes back as a result the model and the client can read.

The SDK's Client is entered and left in one task (its transport's task group), so a session's own task holds it open
and callers on any task send through it. A server that died (its connection closed) is connected to again on the
next use.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from dataclasses import dataclass, field
from typing import Any

import httpx2
from mcp import Client, StdioServerParameters
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError
from mcp_types import CONNECTION_CLOSED, REQUEST_TIMEOUT, CallToolResult, Tool

from deployments.output_deltas import McpToolResult

logger = logging.getLogger("ray.serve.orchard")


@dataclass(frozen=True)
class ServerTarget:
    """Where a session connects: a stdio command (with its environment) or a streamable-HTTP URL (with headers)."""

    name: str
    command: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    cwd: str | None = None
    url: str | None = None
    headers: dict[str, str] = field(default_factory=dict)

    def describe(self) -> str:
        return self.url if self.url is not None else " ".join(self.command[:1]) + " (stdio)"


class McpUnavailableError(Exception):
    """The server could not be connected to or listed (the route answers 424, as OpenAI does)."""


class McpSession:
    def __init__(self, target: ServerTarget, connect_timeout_s: float) -> None:
        self.target = target
        self._connect_timeout_s = connect_timeout_s
        self._client: Client | None = None
        self._tools: list[Tool] | None = None
        self._holder: asyncio.Task | None = None
        self._release = asyncio.Event()
        self._lock = asyncio.Lock()

    async def tools(self) -> list[Tool]:
        """The server's tools (listed once per connection)."""
        client = await self._connected()
        if self._tools is None:
            try:
                self._tools = await asyncio.wait_for(_list_all(client), self._connect_timeout_s)
            except (MCPError, TimeoutError, OSError, httpx2.HTTPError) as exc:
                await self._drop()
                raise McpUnavailableError(f"listing the tools of MCP server '{self.target.name}' failed: "
                                          f"{_reason(exc)}") from exc
        return self._tools

    async def call(self, call_id: str, tool: str, arguments: dict[str, Any], timeout_s: float,
                   max_bytes: int) -> McpToolResult:
        """Run one call: its text, or an error result saying what went wrong (a limit names its setting)."""
        where = f"the tool '{tool}' of MCP server '{self.target.name}'"
        try:
            client = await self._connected()
            # The SDK's timeout cancels the call at the server; the outer one only backs it up.
            result = await asyncio.wait_for(client.call_tool(tool, arguments, read_timeout_seconds=timeout_s),
                                            timeout_s + 5)
        except McpUnavailableError as exc:
            return McpToolResult(call_id, error=str(exc), error_kind="protocol", error_code=CONNECTION_CLOSED)
        except MCPError as exc:
            return await self._protocol_failure(call_id, where, exc, timeout_s)
        except TimeoutError:
            return _timed_out(call_id, where, timeout_s)
        except httpx2.HTTPStatusError as exc:
            return McpToolResult(call_id, error=f"{where} failed: HTTP {exc.response.status_code}",
                                 error_kind="http", error_code=exc.response.status_code)
        except (OSError, httpx2.HTTPError) as exc:
            await self._drop()
            return McpToolResult(call_id, error=f"{where} failed: {_reason(exc)}", error_kind="protocol",
                                 error_code=CONNECTION_CLOSED)
        return _bounded_result(call_id, where, result, max_bytes)

    async def aclose(self) -> None:
        await self._drop()

    async def _protocol_failure(self, call_id: str, where: str, exc: MCPError, timeout_s: float) -> McpToolResult:
        if exc.error.code == REQUEST_TIMEOUT:
            return _timed_out(call_id, where, timeout_s)
        if exc.error.code == CONNECTION_CLOSED:
            await self._drop()  # the server died: the next use starts (or reaches) it again
            message = f"{where} failed: the server closed the connection during the call"
        else:
            message = f"{where} failed: {exc.error.message}"
        return McpToolResult(call_id, error=message, error_kind="protocol", error_code=exc.error.code)

    async def _connected(self) -> Client:
        async with self._lock:
            if self._client is not None and self._holder is not None and not self._holder.done():
                return self._client
            await self._drop_holder()
            ready: asyncio.Future[Client] = asyncio.get_running_loop().create_future()
            self._release = asyncio.Event()
            self._holder = asyncio.create_task(self._hold(ready), name=f"mcp-session-{self.target.name}")
            try:
                self._client = await asyncio.wait_for(asyncio.shield(ready), self._connect_timeout_s)
            except BaseException as exc:
                await self._drop_holder()
                if isinstance(exc, asyncio.CancelledError):
                    raise
                raise McpUnavailableError(f"MCP server '{self.target.name}' ({self.target.describe()}) could not "
                                          f"be reached: {_reason(exc)}") from exc
            logger.info("MCP server '%s' connected (%s)", self.target.name, self.target.describe())
            return self._client

    async def _hold(self, ready: asyncio.Future) -> None:
        """The session's task: enters the client, hands it over, holds it until released; the client's own
        failure (the transport gone) ends it too."""
        try:
            async with contextlib.AsyncExitStack() as stack:
                transport = await self._transport(stack)
                client = await stack.enter_async_context(Client(transport, read_timeout_seconds=None))
                ready.set_result(client)
                await self._release.wait()
        except BaseException as exc:  # noqa: BLE001 - whatever ended the connection, its callers are told
            if not ready.done():
                ready.set_exception(exc if isinstance(exc, Exception) else ConnectionError(repr(exc)))
            elif not isinstance(exc, asyncio.CancelledError):
                logger.info("MCP server '%s' disconnected: %s", self.target.name, _reason(exc))
            if isinstance(exc, asyncio.CancelledError):
                raise

    async def _transport(self, stack: contextlib.AsyncExitStack) -> Any:
        """What the client connects over; an HTTP client of ours is closed with `stack` (the SDK leaves a client it
        was given open)."""
        target = self.target
        if target.url is None:
            return StdioServerParameters(command=target.command[0], args=list(target.command[1:]),
                                         env=dict(target.env), cwd=target.cwd)
        http = await stack.enter_async_context(httpx2.AsyncClient(
            headers=target.headers, timeout=httpx2.Timeout(30.0, read=300.0),
            follow_redirects=False))  # a redirect could lead anywhere: the operator named this URL
        return streamable_http_client(target.url, http_client=http)

    async def _drop(self) -> None:
        async with self._lock:
            await self._drop_holder()

    async def _drop_holder(self) -> None:
        holder, self._holder, self._client, self._tools = self._holder, None, None, None
        if holder is None:
            return
        self._release.set()
        try:
            await asyncio.wait_for(asyncio.shield(holder), 5.0)
        except (TimeoutError, Exception):  # noqa: BLE001 - leaving a broken connection: nothing to report
            holder.cancel()
            await asyncio.gather(holder, return_exceptions=True)


async def _list_all(client: Client) -> list[Tool]:
    tools: list[Tool] = []
    cursor = None
    while True:
        page = await client.list_tools(cursor=cursor) if cursor else await client.list_tools()
        tools += page.tools
        cursor = page.next_cursor
        if not cursor:
            return tools


def _timed_out(call_id: str, where: str, timeout_s: float) -> McpToolResult:
    return McpToolResult(call_id, error=f"{where} did not answer within {timeout_s:g} s (the call's limit: the "
                         "server's call_timeout_s, else mcp.max_tool_time_s)", error_kind="protocol",
                         error_code=REQUEST_TIMEOUT)


def _bounded_result(call_id: str, where: str, result: CallToolResult, max_bytes: int) -> McpToolResult:
    text = result_text(result)
    size = len(text.encode())
    if size > max_bytes:
        return McpToolResult(call_id, error=f"{where} returned {size:,} bytes, more than the {max_bytes:,} a result "
                             "may hold (mcp.max_result_bytes)", error_kind="protocol", error_code=-32603)
    if result.is_error:
        return McpToolResult(call_id, error=text or f"{where} failed", error_kind="execution")
    return McpToolResult(call_id, output=text)


def result_text(result: CallToolResult) -> str:
    """A result as the text a model reads: its text blocks; structured content as JSON where there is no text;
    other blocks (images, audio, resources) named, since both APIs' results carry text only."""
    parts = []
    for block in result.content:
        kind = getattr(block, "type", "")
        if kind == "text":
            parts.append(block.text)
        elif kind == "resource" and hasattr(block.resource, "text"):
            parts.append(block.resource.text)
        elif kind == "resource_link":
            parts.append(f"[resource {block.uri}]")
        else:
            parts.append(f"[{kind} content ({getattr(block, 'mime_type', '') or 'binary'}) not shown]")
    if not parts and result.structured_content is not None:
        parts.append(json.dumps(result.structured_content, ensure_ascii=False))
    return "\n".join(parts)


def _reason(exc: BaseException) -> str:
    if isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        return _reason(exc.exceptions[0])
    return str(exc) or type(exc).__name__
