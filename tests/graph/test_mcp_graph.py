"""The MCP tool loop through the real graph: the anthropic and openai SDKs complete a loop of two tool rounds against
the demo MCP server (tests/support/mcp_demo_server.py over stdio, declared in the shared graph's ingress config and
started by the ingress replica), with the tool results in the returned content and items. The tiny tools model is
made to call by a forced tool_choice, which holds while max_tool_calls last (tests/serve/test_mcp_local.py covers
the rest: streamed == whole, approvals, failures, bounds, refusals, disconnects)."""

from __future__ import annotations

import json

from tests.graph.shared_graph import MCP_SERVER, TOOLS
from tests.support.mcp_demo_server import check_result

QUESTION = "Add two numbers, then shout a word."


def test_the_anthropic_client_completes_a_two_tool_loop(shared_graph):
    message = shared_graph.anthropic().beta.messages.create(
        model=TOOLS, max_tokens=96, messages=[{"role": "user", "content": QUESTION}], betas=["mcp-client-2025-04-04"],
        mcp_servers=[{"type": "url", "name": MCP_SERVER, "tool_configuration": {"allowed_tools": ["add", "shout"]}}],
        tool_choice={"type": "any"}, extra_body={"temperature": 0, "max_tool_calls": 2})
    assert [block.type for block in message.content[:4]] == ["mcp_tool_use", "mcp_tool_result"] * 2
    for use, result in (message.content[0:2], message.content[2:4]):
        assert use.server_name == MCP_SERVER and result.tool_use_id == use.id and not result.is_error
        check_result(use.name, use.input, result.content[0].text)


def test_the_openai_client_completes_a_two_tool_loop_streamed(shared_graph):
    tools = [{"type": "mcp", "server_label": MCP_SERVER, "require_approval": "never", "allowed_tools": ["add", "shout"]}]
    with shared_graph.openai().responses.create(model=TOOLS, input=QUESTION, tools=tools, tool_choice="required",
                                                max_tool_calls=2, temperature=0, max_output_tokens=96,
                                                stream=True) as events:
        final = [event for event in events][-1].response
    assert [item.type for item in final.output[:3]] == ["mcp_list_tools", "mcp_call", "mcp_call"]
    for call in final.output[1:3]:
        assert call.server_label == MCP_SERVER and call.status == "completed"
        check_result(call.name, json.loads(call.arguments), call.output)
