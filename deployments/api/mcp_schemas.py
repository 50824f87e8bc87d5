"""The MCP shapes of both APIs' requests: Anthropic's MCP connector (`mcp_servers`, and the mcp_tool_use /
mcp_tool_result blocks a conversation replays) and the Responses API's `mcp` tool, tool choice and items
(mcp_list_tools, mcp_call, mcp_approval_request, mcp_approval_response), as the anthropic and openai SDKs send them."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

_SERVER_NAME = r"^[A-Za-z0-9_.-]{1,64}$"
MAX_MCP_SERVERS = 20  # per request


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


# ---- Anthropic -------------------------------------------------------------------------------------
class McpToolConfiguration(_Lenient):
    allowed_tools: list[str] | None = None
    enabled: bool | None = None  # false: the server's tools are not offered


class McpServerDefinition(_Lenient):
    """One of `mcp_servers` (beta mcp-client-2025-04-04 and later). `url` may be left out for a server the ingress
    declares (by name); a URL the ingress did not declare must be under its mcp.allowed_urls."""

    type: Literal["url"]
    name: str = Field(pattern=_SERVER_NAME)
    url: str | None = Field(None, max_length=2048)
    authorization_token: str | None = Field(None, max_length=8192)
    tool_configuration: McpToolConfiguration | None = None


class McpToolUseBlock(_Lenient):
    type: Literal["mcp_tool_use"]
    id: str
    name: str
    server_name: str
    input: dict[str, Any] = Field(default_factory=dict)
    cache_control: Any = None


class McpTextBlock(_Lenient):
    type: Literal["text"]
    text: str


class McpToolResultBlock(_Lenient):
    type: Literal["mcp_tool_result"]
    tool_use_id: str
    content: str | list[McpTextBlock] = ""
    is_error: bool = False
    cache_control: Any = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "\n".join(b.text for b in self.content)


# ---- OpenAI Responses ------------------------------------------------------------------------------
class McpToolFilter(_Lenient):
    tool_names: list[str] | None = None
    read_only: bool | None = None


class McpApprovalFilter(_Lenient):
    always: McpToolFilter | None = None
    never: McpToolFilter | None = None


class McpTool(_Lenient):
    """A remote MCP server's tools ({"type": "mcp", "server_label", "server_url" | "connector_id", ...})."""

    type: Literal["mcp"]
    server_label: str = Field(pattern=_SERVER_NAME)
    server_url: str | None = Field(None, max_length=2048)
    connector_id: str | None = None
    tunnel_id: str | None = None
    allowed_tools: list[str] | McpToolFilter | None = None
    require_approval: Literal["always", "never"] | McpApprovalFilter | None = None
    headers: dict[str, str] | None = None
    authorization: str | None = Field(None, max_length=8192)
    server_description: str | None = None


class McpToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["mcp"]
    server_label: str
    name: str | None = None


class McpListToolsItem(_Lenient):
    type: Literal["mcp_list_tools"]
    server_label: str
    tools: list[dict[str, Any]] = Field(default_factory=list)


class McpCallItem(_Lenient):
    type: Literal["mcp_call"]
    id: str
    server_label: str
    name: str
    arguments: str = "{}"
    output: str | None = None
    error: Any = None  # OpenAI's McpToolCallError (an object), or a string from older clients
    approval_request_id: str | None = None

    def error_text(self) -> str | None:
        if self.error is None or isinstance(self.error, str):
            return self.error
        if isinstance(self.error, dict):
            return str(self.error.get("message") or self.error.get("content") or self.error)
        return str(self.error)


class McpApprovalRequestItem(_Lenient):
    type: Literal["mcp_approval_request"]
    id: str
    server_label: str
    name: str
    arguments: str = "{}"


class McpApprovalResponseItem(_Lenient):
    type: Literal["mcp_approval_response"]
    approval_request_id: str
    approve: bool
    reason: str | None = None
