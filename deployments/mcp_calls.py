"""What a request asks of the ingress's MCP tool loop, as the API converters (api/) read it from Anthropic's
`mcp_servers` or the Responses API's `mcp` tools, for the loop (mcp/) to resolve against the operator's servers.
A contract module: plain dataclasses, no wire format."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass
class ApprovalPolicy:
    """Which tools' calls wait for the client's approval (the Responses API's require_approval; Anthropic: none).
    A tool matching `never_*` runs at once, one matching `always_*` waits, any other follows `default_always`."""

    default_always: bool = False
    always_names: frozenset[str] = frozenset()
    always_read_only: bool = False
    never_names: frozenset[str] = frozenset()
    never_read_only: bool = False

    def needs_approval(self, tool: str, read_only: bool) -> bool:
        if tool in self.never_names or (self.never_read_only and read_only):
            return False
        if tool in self.always_names or (self.always_read_only and read_only):
            return True
        return self.default_always


@dataclass
class RequestedMcpServer:
    name: str  # Anthropic's name, OpenAI's server_label: what the answer's blocks and items name
    param: str  # where the request gave it, for errors ("mcp_servers.0", "tools[2]")
    url: str | None = None
    authorization: str | None = None  # a bearer token for a server the request names by URL
    headers: dict[str, str] = field(default_factory=dict)
    allowed_tools: list[str] | None = None  # None: every tool the operator allows
    only_read_only: bool = False  # OpenAI's allowed_tools.read_only
    approval: ApprovalPolicy = field(default_factory=ApprovalPolicy)


@dataclass
class PendingMcpCall:
    """A call the conversation holds an approval request for, and this request answers."""

    approval_request_id: str
    server: str
    name: str
    arguments: str
    approve: bool
    reason: str | None = None


@dataclass
class McpUse:
    """A request's use of the tool loop."""

    api: Literal["anthropic", "openai"]
    servers: list[RequestedMcpServer]
    # The request's budget of tool calls (OpenAI's max_tool_calls): a forced tool_choice holds while calls remain,
    # calls past it are not run. None: a forced choice holds for the first turn only.
    max_tool_calls: int | None = None
    listed: set[str] = field(default_factory=set)  # servers the conversation already holds a listing of
    pending: list[PendingMcpCall] = field(default_factory=list)  # run (or declined) before the model's first turn
    forced_server: str | None = None  # OpenAI's tool_choice {"type": "mcp", "server_label"}: its tools only
