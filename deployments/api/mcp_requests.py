"""Both APIs' MCP fields -> McpUse, what the ingress's tool loop resolves against its servers: Anthropic's
`mcp_servers`, the Responses API's `mcp` tools, their tool choice, and the approvals a conversation answers."""

from __future__ import annotations

from deployments.api.anthropic_schemas import MessagesRequest
from deployments.api.mcp_schemas import (
    McpApprovalFilter,
    McpApprovalRequestItem,
    McpApprovalResponseItem,
    McpCallItem,
    McpListToolsItem,
    McpTool,
    McpToolChoice,
    McpToolFilter,
)
from deployments.api.responses_schemas import InputItem, ResponsesRequest
from deployments.mcp_calls import ApprovalPolicy, McpUse, PendingMcpCall, RequestedMcpServer
from engine.errors import InvalidRequestError


def anthropic_mcp_use(body: MessagesRequest) -> McpUse | None:
    """The connector's servers (those not turned off by tool_configuration.enabled); None: no tool loop."""
    servers = []
    for index, server in enumerate(body.mcp_servers or ()):
        config = server.tool_configuration
        if config is not None and config.enabled is False:
            continue
        servers.append(RequestedMcpServer(server.name, f"mcp_servers.{index}", url=server.url,
                                          authorization=server.authorization_token,
                                          allowed_tools=config.allowed_tools if config is not None else None))
    _unique(servers, "mcp_servers", "name")
    return McpUse("anthropic", servers, max_tool_calls=body.max_tool_calls) if servers else None


def responses_mcp_use(body: ResponsesRequest, history: list[InputItem], own: list[InputItem]) -> McpUse | None:
    """The request's mcp tools, the servers the conversation already listed, and the approval requests its input
    answers; None: no tool loop."""
    servers = [_responses_server(tool, index) for index, tool in enumerate(body.tools or ()) if isinstance(tool, McpTool)]
    if not servers:
        return None
    _unique(servers, "tools", "server_label")
    conversation = history + own
    listed = {item.server_label for item in conversation if isinstance(item, McpListToolsItem)}
    choice = body.tool_choice
    forced = choice.server_label if isinstance(choice, McpToolChoice) and choice.name is None else None
    return McpUse("openai", servers, body.max_tool_calls, listed, _pending(conversation, own, len(history)), forced)


def _responses_server(tool: McpTool, index: int) -> RequestedMcpServer:
    param = f"tools[{index}]"
    if tool.connector_id is not None or tool.tunnel_id is not None:
        raise InvalidRequestError(f"'{param}': OpenAI's connectors and tunnels are not served here: give 'server_url', "
                                  "or a 'server_label' this server declares", param=f"{param}.connector_id")
    allowed, read_only = tool.allowed_tools, False
    if isinstance(allowed, McpToolFilter):
        allowed, read_only = allowed.tool_names, bool(allowed.read_only)
    return RequestedMcpServer(tool.server_label, param, url=tool.server_url, authorization=tool.authorization,
                              headers=dict(tool.headers or {}), allowed_tools=allowed, only_read_only=read_only,
                              approval=_approval(tool.require_approval))


def _approval(require: str | McpApprovalFilter | None) -> ApprovalPolicy:
    """OpenAI asks approval for every call unless told otherwise ("never", or a filter's `never`)."""
    if require == "never":
        return ApprovalPolicy(default_always=False)
    if not isinstance(require, McpApprovalFilter):
        return ApprovalPolicy(default_always=True)
    always, never = require.always or McpToolFilter(), require.never or McpToolFilter()
    return ApprovalPolicy(True, frozenset(always.tool_names or ()), bool(always.read_only),
                          frozenset(never.tool_names or ()), bool(never.read_only))


def _pending(conversation: list[InputItem], own: list[InputItem], first_own: int) -> list[PendingMcpCall]:
    """The approval requests this request's input answers and no earlier call ran."""
    requests = {item.id: item for item in conversation if isinstance(item, McpApprovalRequestItem)}
    ran = {item.approval_request_id for item in conversation if isinstance(item, McpCallItem)}
    pending = []
    for index, item in enumerate(own):
        if not isinstance(item, McpApprovalResponseItem) or item.approval_request_id in ran:
            continue
        asked = requests.get(item.approval_request_id)
        if asked is None:
            raise InvalidRequestError(
                f"'input[{index}]': no mcp_approval_request '{item.approval_request_id}' in the conversation (its "
                "input, or previous_response_id's)", param=f"input[{index}].approval_request_id")
        pending.append(PendingMcpCall(asked.id, asked.server_label, asked.name, asked.arguments, item.approve,
                                      item.reason))
    return pending


def _unique(servers: list[RequestedMcpServer], where: str, key: str) -> None:
    names = [server.name for server in servers]
    if duplicate := next((name for name in names if names.count(name) > 1), None):
        raise InvalidRequestError(f"'{where}' names the MCP server '{duplicate}' twice (by {key})", param=where)
