"""The ingress's MCP servers: sessions to the declared ones (kept across requests), and the rules a request's servers
must pass before anything is started or reached. A request's servers resolve to a Toolset: the tools the model is
offered, each with the session that runs it and its limits."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from mcp_types import Tool

from deployments.mcp.sessions import McpSession, McpUnavailableError, ServerTarget
from deployments.mcp_calls import McpUse, RequestedMcpServer
from deployments.mcp_config import McpConfig, McpConfigError, McpServerConfig, expand_environment
from deployments.output_deltas import McpToolListing
from engine.errors import InvalidRequestError, McpServerError


@dataclass
class OfferedTool:
    server: str  # the request's name for its server (what blocks and items name)
    name: str
    session: McpSession
    timeout_s: float
    needs_approval: bool
    definition: dict[str, Any]  # the OpenAI-style function the model is shown


@dataclass
class Toolset:
    tools: dict[str, OfferedTool] = field(default_factory=dict)
    listings: list[McpToolListing] = field(default_factory=list)  # to show (servers not yet listed in the conversation)
    owned: list[McpSession] = field(default_factory=list)  # the request's own sessions, closed with it

    def definitions(self) -> list[dict[str, Any]]:
        return [tool.definition for tool in self.tools.values()]

    async def aclose(self) -> None:
        await asyncio.gather(*(session.aclose() for session in self.owned), return_exceptions=True)


class McpHub:
    def __init__(self, config: McpConfig | None = None) -> None:
        self.config = config or McpConfig()
        self._sessions: dict[str, McpSession] = {}

    def server_names(self) -> list[str]:
        return [server.name for server in self.config.servers]

    async def toolset(self, use: McpUse, taken_names: set[str]) -> Toolset:
        """The tools of the request's servers; `taken_names`: the request's own function tools (a clash is a 400)."""
        toolset = Toolset()
        try:
            resolved = [(wanted, self._session(wanted, toolset)) for wanted in use.servers]
            listed = await asyncio.gather(*(session.tools() for _, session in resolved), return_exceptions=True)
            for (wanted, session), tools in zip(resolved, listed):
                if isinstance(tools, McpUnavailableError):
                    raise McpServerError(str(tools), param=wanted.param)
                if isinstance(tools, BaseException):
                    raise tools
                self._offer(toolset, wanted, session, tools, use, taken_names)
        except BaseException:
            await toolset.aclose()
            raise
        return toolset

    async def aclose(self) -> None:
        sessions, self._sessions = list(self._sessions.values()), {}
        await asyncio.gather(*(session.aclose() for session in sessions), return_exceptions=True)

    def _session(self, wanted: RequestedMcpServer, toolset: Toolset) -> McpSession:
        declared = self.config.server(wanted.name) or next(
            (s for s in self.config.servers if wanted.url is not None and s.url == wanted.url), None)
        if declared is not None:
            if wanted.url is not None and wanted.url != declared.url:
                where = "is a local (stdio) server: name it without a URL" if declared.url is None else \
                    f"is declared with another URL ({declared.url})"
                raise InvalidRequestError(f"MCP server '{wanted.name}' {where}", param=wanted.param)
            return self._declared(declared)
        if wanted.url is None:
            raise InvalidRequestError(
                f"MCP server '{wanted.name}' is not one of this server's ({', '.join(self.server_names()) or 'none'}) "
                "and no URL is given", param=wanted.param)
        if not self.config.url_allowed(wanted.url):
            raise InvalidRequestError(
                f"MCP server '{wanted.name}' ({wanted.url}) is not declared in the ingress's mcp.servers, and its URL "
                "is not under mcp.allowed_urls: nothing was reached", param=wanted.param)
        headers = dict(wanted.headers)
        if wanted.authorization:
            headers["Authorization"] = f"Bearer {wanted.authorization}"
        session = McpSession(ServerTarget(wanted.name, url=wanted.url, headers=headers), self.config.connect_timeout_s)
        toolset.owned.append(session)
        return session

    def _declared(self, server: McpServerConfig) -> McpSession:
        if server.name not in self._sessions:
            where = f"mcp.servers '{server.name}'"
            try:
                target = ServerTarget(server.name, tuple(server.command or ()), expand_environment(server.env, where),
                                      server.cwd, server.url, expand_environment(server.headers, where))
            except McpConfigError as exc:
                raise McpServerError(str(exc)) from exc
            self._sessions[server.name] = McpSession(target, self.config.connect_timeout_s)
        return self._sessions[server.name]

    def _offer(self, toolset: Toolset, wanted: RequestedMcpServer, session: McpSession, tools: list[Tool],
               use: McpUse, taken_names: set[str]) -> None:
        declared = self.config.server(session.target.name)
        timeout_s = (declared.call_timeout_s if declared else None) or self.config.max_tool_time_s
        allowed = [t for t in tools if _allowed(t, wanted, declared)]
        for tool in allowed:
            if tool.name in taken_names or tool.name in toolset.tools:
                other = toolset.tools[tool.name].server if tool.name in toolset.tools else "the request's own tools"
                raise InvalidRequestError(
                    f"the tool '{tool.name}' of MCP server '{wanted.name}' has the name of one in {other}: narrow "
                    "one server's allowed tools", param=wanted.param)
            read_only = bool(tool.annotations and tool.annotations.read_only_hint)
            toolset.tools[tool.name] = OfferedTool(
                wanted.name, tool.name, session, timeout_s, wanted.approval.needs_approval(tool.name, read_only),
                {"type": "function", "function": {"name": tool.name, "description": tool.description or "",
                                                  "parameters": tool.input_schema}})
        if use.api == "openai" and wanted.name not in use.listed:
            toolset.listings.append(McpToolListing(wanted.name, [_listed(t) for t in allowed]))


def _allowed(tool: Tool, wanted: RequestedMcpServer, declared: McpServerConfig | None) -> bool:
    if declared is not None and declared.allowed_tools is not None and tool.name not in declared.allowed_tools:
        return False
    if wanted.allowed_tools is not None and tool.name not in wanted.allowed_tools:
        return False
    return not wanted.only_read_only or bool(tool.annotations and tool.annotations.read_only_hint)


def _listed(tool: Tool) -> dict[str, Any]:
    annotations = tool.annotations.model_dump(by_alias=True, exclude_none=True) if tool.annotations else None
    return {"name": tool.name, "description": tool.description, "input_schema": tool.input_schema,
            "annotations": annotations}
