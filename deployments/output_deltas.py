"""What a model's output parses into: neutral content, reasoning and tool-call deltas (no wire format); and what
the ingress's MCP tool loop adds to an answer: its tool listings, calls, results and approval requests.

A contract between deployments: the model side's parsers (chat/parsers/) produce the deltas, the tool loop
(mcp/tool_loop.py) the MCP events, StreamChunk (model_calls.py) carries both; the ingress's renderers (api/) turn
them into OpenAI or Anthropic events.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal


@dataclass
class ContentDelta:
    text: str


@dataclass
class ReasoningDelta:
    text: str


@dataclass
class ToolCallDelta:
    """Part of tool call number `index` (0-based, in order of appearance in the output).

    The first delta of a call carries its id and name; later ones only argument fragments.
    `arguments` is JSON text: the fragments of one call concatenate to the arguments object.
    `unfinished`: the output was cut (max_tokens) inside this call, so `arguments` is the text written so far.
    """

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None
    unfinished: bool = False

    def joined(self, later: ToolCallDelta) -> ToolCallDelta:
        """This delta and a later one of the same call as one."""
        return ToolCallDelta(self.index, self.arguments + later.arguments, self.id or later.id,
                             self.name or later.name, self.unfinished or later.unfinished)


ParsedEvent = ContentDelta | ReasoningDelta | ToolCallDelta


# ---- the MCP tool loop's events ------------------------------------------------------------------------
@dataclass
class McpToolListing:
    """The tools the loop offers of one server (OpenAI's mcp_list_tools item; Anthropic shows none)."""

    server: str
    tools: list[dict[str, Any]] = field(default_factory=list)  # {name, description, input_schema, annotations}


@dataclass
class McpToolCall:
    """A call of the model's on an MCP tool, which the loop runs (or asks approval for: `needs_approval`)."""

    id: str  # the call's id on the wire: mcptoolu_... (Anthropic), mcp_... (OpenAI)
    server: str
    name: str
    arguments: str  # the JSON object, as text
    approval_request_id: str | None = None  # the approval it was run on
    needs_approval: bool = False  # not run: an mcp_approval_request, which the client answers in a next request


McpErrorKind = Literal["protocol", "execution", "http"]  # OpenAI's mcp_protocol_error, _tool_execution_error, http_error


@dataclass
class McpToolResult:
    """A call's result: its text, or why it failed (the tool's error, a limit hit, the server gone)."""

    call_id: str
    output: str = ""
    error: str | None = None  # what the model and the client are told
    error_kind: McpErrorKind = "execution"
    error_code: int | None = None  # MCP's JSON-RPC code, or the HTTP status


McpEvent = McpToolListing | McpToolCall | McpToolResult
