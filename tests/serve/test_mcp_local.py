"""The MCP tool loop over the in-process stack: a real MCP server (tests/support/mcp_demo_server.py, the SDK's
MCPServer) over stdio and over streamable HTTP on loopback, a tiny random model with Qwen3's tool template made to call
its tools by a forced tool_choice, and the real anthropic and openai clients.

A forced choice holds while the request's max_tool_calls last, so `max_tool_calls: 2` is a loop of two tool rounds and
a last turn that answers; the random model picks the arguments (within each tool's schema), so results are checked
against what the tool does with them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import anthropic
import httpx2
import openai
import pytest

from deployments.config import ModelConfig
from deployments.mcp.hub import McpHub
from deployments.mcp_config import McpConfig, McpServerConfig
from tests.serve.local_stack import local_stack, send_streaming
from tests.support.mcp_demo_server import check_result
from tests.support.serving import free_port, wait_until
from tests.support.tiny_models import write_smollm2_tokenizer_model

REPO = Path(__file__).resolve().parents[2]
QWEN3_TEMPLATE = REPO / "tests" / "support" / "qwen3_tools.jinja"
MODEL = "tiny/mcp"
DEMO = [sys.executable, "-m", "tests.support.mcp_demo_server"]
USER = [{"role": "user", "content": "Add two numbers, then shout a word."}]
BETA = ["mcp-client-2025-04-04"]


@dataclass
class McpServers:
    log: Path  # the demo servers' call log (hang's started / cancelled)
    http_url: str

    def log_lines(self) -> list[str]:
        return self.log.read_text().split() if self.log.exists() else []


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory) -> Path:
    return write_smollm2_tokenizer_model(tmp_path_factory.mktemp("mcp-local") / "model",
                                         {"max_position_embeddings": 4096}, seed=1, scale=3.0)


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """The demo server over streamable HTTP (a child process on a loopback port); the stdio one is started by the
    ingress itself, from its config."""
    log = tmp_path_factory.mktemp("mcp-log") / "calls.log"
    port = free_port()
    child = subprocess.Popen([*DEMO, "http", str(port)], cwd=REPO, env={"PATH": "/usr/bin:/bin", "MCP_DEMO_LOG": str(log)},
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until(lambda: _listening(port), 60, what="the MCP demo server listening")
        yield McpServers(log, f"http://127.0.0.1:{port}/mcp")
    finally:
        child.kill()
        child.wait()


def _listening(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


def mcp_config(servers: McpServers, **bounds) -> McpConfig:
    return McpConfig(servers=[
        McpServerConfig(name="local", command=DEMO, cwd=str(REPO), env={"MCP_DEMO_LOG": str(servers.log)},
                        allowed_tools=["add", "shout", "fail", "hang", "flood", "die"], call_timeout_s=30),
        McpServerConfig(name="remote", url=servers.http_url),
    ], **bounds)


@contextlib.asynccontextmanager
async def stack_with(folder: Path, config: McpConfig):
    model = ModelConfig(model_id=MODEL, model_path=str(folder), context_length=4096,
                        chat_template_file=str(QWEN3_TEMPLATE))
    async with local_stack([model], mcp=McpHub(config)) as stack:
        yield stack


def sdk_clients(stack) -> tuple[anthropic.AsyncAnthropic, openai.AsyncOpenAI]:
    http2 = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=stack.app))
    claude = anthropic.AsyncAnthropic(base_url="http://orchard", api_key="unused", http_client=http2, max_retries=0)
    gpt = openai.AsyncOpenAI(base_url="http://orchard/v1", api_key="unused", http_client=stack.http, max_retries=0)
    return claude, gpt


def without_ids(value):
    """A message or response with its ids (random per answer) and timings blanked, for streamed == whole."""
    if isinstance(value, dict):
        return {k: ("<id>" if k in ("id", "tool_use_id", "created_at", "completed_at") else without_ids(v))
                for k, v in value.items()}
    if isinstance(value, list):
        return [without_ids(v) for v in value]
    return value


# ---- Anthropic's MCP connector ---------------------------------------------------------------------
def test_anthropic_two_tool_rounds_streamed_equal_whole(model_folder, servers):
    request = dict(model=MODEL, max_tokens=96, messages=USER, betas=BETA,
                   mcp_servers=[{"type": "url", "name": "local",
                                 "tool_configuration": {"allowed_tools": ["add", "shout"]}},
                                {"type": "url", "name": "remote", "url": servers.http_url,
                                 "tool_configuration": {"allowed_tools": ["nothing-here"]}}],
                   tool_choice={"type": "any"}, extra_body={"temperature": 0, "max_tool_calls": 2})

    async def scenario():
        async with stack_with(model_folder, mcp_config(servers)) as stack:
            claude, _ = sdk_clients(stack)
            whole = await claude.beta.messages.create(**request)
            async with claude.beta.messages.stream(**request) as stream:
                return whole, await stream.get_final_message()

    whole, streamed = asyncio.run(scenario())
    kinds = [block.type for block in whole.content]
    assert kinds[:4] == ["mcp_tool_use", "mcp_tool_result"] * 2, kinds
    for use, result in (whole.content[0:2], whole.content[2:4]):
        assert use.server_name == "local" and result.tool_use_id == use.id and not result.is_error
        check_result(use.name, use.input, result.content[0].text)
    assert whole.stop_reason in ("end_turn", "max_tokens")
    assert without_ids(streamed.model_dump(exclude={"usage"})) == without_ids(whole.model_dump(exclude={"usage"}))
    # usage sums the three model turns; the streamed answer read more of its prompts from the prefix cache
    assert [prompt_tokens(m.usage) for m in (whole, streamed)] == [prompt_tokens(whole.usage)] * 2
    assert streamed.usage.output_tokens == whole.usage.output_tokens
    assert streamed.usage.cache_read_input_tokens > whole.usage.cache_read_input_tokens > 0


def prompt_tokens(usage) -> int:
    return usage.input_tokens + usage.cache_read_input_tokens


# ---- the Responses API's mcp tool ---------------------------------------------------------------------
MCP_EVENTS = {  # per item type: its streamed events, in order (OpenAI's names)
    "mcp_list_tools": ["response.output_item.added", "response.mcp_list_tools.in_progress",
                       "response.mcp_list_tools.completed", "response.output_item.done"],
    "mcp_call": ["response.output_item.added", "response.mcp_call.in_progress", "response.mcp_call_arguments.delta",
                 "response.mcp_call_arguments.done", "response.mcp_call.completed", "response.output_item.done"],
}


def test_responses_two_tool_rounds_streamed_equal_whole_with_openais_events(model_folder, servers):
    tools = [{"type": "mcp", "server_label": "remote", "server_url": servers.http_url, "require_approval": "never",
              "allowed_tools": ["add", "shout"]}]
    request = dict(model=MODEL, input=USER[0]["content"], tools=tools, tool_choice="required", max_tool_calls=2,
                   temperature=0, max_output_tokens=96)

    async def scenario():
        async with stack_with(model_folder, mcp_config(servers)) as stack:
            _, gpt = sdk_clients(stack)
            whole = await gpt.responses.create(**request)
            events = [event async for event in await gpt.responses.create(**request, stream=True)]
            return whole, events

    whole, events = asyncio.run(scenario())
    kinds = [item.type for item in whole.output]
    assert kinds[:3] == ["mcp_list_tools", "mcp_call", "mcp_call"], kinds
    assert [t["name"] for t in whole.output[0].model_dump()["tools"]] == ["add", "shout"]
    for call in whole.output[1:3]:
        assert call.server_label == "remote" and call.status == "completed" and call.error is None
        check_result(call.name, json.loads(call.arguments), call.output)
    streamed = events[-1].response
    assert events[-1].type == f"response.{whole.status}"  # completed, or incomplete where the last turn ran out
    assert without_ids(streamed.model_dump(exclude={"usage"})) == without_ids(whole.model_dump(exclude={"usage"}))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    for item in streamed.output[:3]:
        mine = [e.type for e in events if getattr(e, "item_id", None) == item.id
                or getattr(getattr(e, "item", None), "id", None) == item.id]
        assert mine == MCP_EVENTS[item.type], (item.type, mine)


def test_responses_approval_request_then_approved_and_declined_calls(model_folder, servers):
    tools = [{"type": "mcp", "server_label": "local", "allowed_tools": ["add"]}]  # approval: OpenAI's default

    async def scenario():
        async with stack_with(model_folder, mcp_config(servers)) as stack:
            _, gpt = sdk_clients(stack)
            asked = await gpt.responses.create(model=MODEL, input="Add two numbers.", tools=tools,
                                               tool_choice="required", temperature=0, max_output_tokens=96)
            request = asked.output[-1]
            answers = []
            for approve in (True, False):
                answers.append(await gpt.responses.create(
                    model=MODEL, previous_response_id=asked.id, tools=tools, temperature=0, max_output_tokens=16,
                    input=[{"type": "mcp_approval_response", "approval_request_id": request.id, "approve": approve}]))
            return asked, answers

    asked, (approved, declined) = asyncio.run(scenario())
    assert [item.type for item in asked.output] == ["mcp_list_tools", "mcp_approval_request"]
    request = asked.output[1]
    assert request.server_label == "local" and request.name == "add" and asked.status == "completed"
    ran = approved.output[0]  # run before the model's next turn; no second listing (the conversation holds one)
    assert ran.type == "mcp_call" and ran.approval_request_id == request.id
    assert ran.arguments == request.arguments
    check_result("add", json.loads(request.arguments), ran.output)
    assert not any(item.type.startswith("mcp_") for item in declined.output)


# ---- failures and bounds -------------------------------------------------------------------------
def test_a_tool_that_fails_hangs_floods_or_kills_its_server_is_an_error_result_and_the_server_comes_back(
        model_folder, servers):
    config = mcp_config(servers, max_result_bytes=1 << 20)
    config.servers[0].call_timeout_s = 2.0

    async def call(claude, tool: str):
        server = {"type": "url", "name": "local"} if tool != "flood" else {  # 10 MiB take seconds to read
            "type": "url", "name": "remote", "url": servers.http_url}
        message = await claude.beta.messages.create(
            model=MODEL, max_tokens=96, messages=USER, betas=BETA, tool_choice={"type": "tool", "name": tool},
            mcp_servers=[{**server, "tool_configuration": {"allowed_tools": [tool, "add"]}}],
            extra_body={"temperature": 0, "max_tool_calls": 1})
        use, result = message.content[0], message.content[1]
        assert (use.type, use.name, result.type, result.tool_use_id) == ("mcp_tool_use", tool, "mcp_tool_result", use.id)
        return result

    async def scenario():
        async with stack_with(model_folder, config) as stack:
            claude, _ = sdk_clients(stack)
            return [await call(claude, tool) for tool in ("fail", "hang", "flood", "die", "add")]

    failed, hung, flooded, died, added = asyncio.run(scenario())
    assert failed.is_error and failed.content[0].text == "Error executing tool fail: failed on purpose"  # the SDK's words
    assert hung.is_error and hung.content[0].text == (
        "the tool 'hang' of MCP server 'local' did not answer within 2 s (the call's limit: the server's "
        "call_timeout_s, else mcp.max_tool_time_s)")
    assert flooded.is_error and flooded.content[0].text == (
        "the tool 'flood' of MCP server 'remote' returned 10,485,760 bytes, more than the 1,048,576 a result may hold "
        "(mcp.max_result_bytes)")
    assert died.is_error and died.content[0].text == (
        "the tool 'die' of MCP server 'local' failed: the server closed the connection during the call")
    assert not added.is_error and added.content[0].text.lstrip("-").isdigit()  # a new server process answered
    assert servers.log_lines()[-2:] == ["started", "cancelled"]  # the hung call was cancelled at the server


def test_past_max_rounds_the_calls_are_not_run_and_the_answer_pauses(model_folder, servers):
    async def scenario():
        async with stack_with(model_folder, mcp_config(servers, max_rounds=1)) as stack:
            claude, _ = sdk_clients(stack)
            return await claude.beta.messages.create(
                model=MODEL, max_tokens=96, messages=USER, betas=BETA, tool_choice={"type": "any"},
                mcp_servers=[{"type": "url", "name": "local", "tool_configuration": {"allowed_tools": ["add"]}}],
                extra_body={"temperature": 0, "max_tool_calls": 5})

    message = asyncio.run(scenario())
    assert [block.type for block in message.content] == ["mcp_tool_use", "mcp_tool_result"] * 2
    assert not message.content[1].is_error and message.content[3].is_error
    assert message.content[3].content[0].text.startswith(
        "not run: this answer reached the tool loop's limit of 1 tool rounds (the ingress's mcp.max_rounds)")
    assert message.stop_reason == "pause_turn"


def test_servers_the_operator_did_not_allow_are_refused_before_anything_is_reached(model_folder, servers):
    config = McpConfig(allowed_urls=[servers.http_url.removesuffix("/mcp")])  # no declared servers
    with socket.create_server(("127.0.0.1", 0)) as elsewhere:
        elsewhere.settimeout(0.5)
        other = f"http://127.0.0.1:{elsewhere.getsockname()[1]}/mcp"

        async def scenario():
            async with stack_with(model_folder, config) as stack:
                claude, _ = sdk_clients(stack)
                answers = []
                for server in ({"name": "local"}, {"name": "other", "url": other},
                               {"name": "sneaky", "url": servers.http_url.replace("127.0.0.1", "127.0.0.1.nip.io")},
                               {"name": "adhoc", "url": servers.http_url,
                                "tool_configuration": {"allowed_tools": ["add"]}}):
                    answers.append(await stack.http.post("/v1/messages", headers={"anthropic-beta": BETA[0]}, json={
                        "model": MODEL, "max_tokens": 96, "messages": USER, "temperature": 0,
                        "mcp_servers": [{"type": "url", **server}], "tool_choice": {"type": "any"}}))
                return answers

        local, other_host, sneaky, adhoc = asyncio.run(scenario())
        with pytest.raises(TimeoutError):
            elsewhere.accept()  # nobody connected to the undeclared server
    assert local.status_code == 400 and local.json()["error"]["message"] == (
        "mcp_servers.0: MCP server 'local' is not one of this server's (none) and no URL is given")
    assert other_host.status_code == 400 and other_host.json()["error"]["message"] == (
        f"mcp_servers.0: MCP server 'other' ({other}) is not declared in the ingress's mcp.servers, and its URL is not "
        "under mcp.allowed_urls: nothing was reached")
    assert sneaky.status_code == 400
    assert adhoc.status_code == 200 and [b["type"] for b in adhoc.json()["content"][:2]] == [
        "mcp_tool_use", "mcp_tool_result"]


def test_a_client_that_goes_away_mid_call_leaves_no_call_running(model_folder, servers):
    body = {"model": MODEL, "max_tokens": 96, "messages": USER, "temperature": 0, "stream": True,
            "tool_choice": {"type": "tool", "name": "hang"},
            "mcp_servers": [{"type": "url", "name": "local", "tool_configuration": {"allowed_tools": ["hang"]}}]}

    async def scenario():
        async with stack_with(model_folder, mcp_config(servers)) as stack:
            before = servers.log_lines().count("cancelled")
            async for sent in send_streaming(stack.app, "/v1/messages", body):
                if '"mcp_tool_use"' in sent.body:
                    break  # the call is on its way: the client leaves
            await wait_for_log(lambda: servers.log_lines().count("cancelled") > before)

    asyncio.run(scenario())
    assert servers.log_lines()[-2:] == ["started", "cancelled"]


async def wait_for_log(condition, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "the MCP server's log did not show it"
        await asyncio.sleep(0.05)


# ---- orchard chat --mcp -----------------------------------------------------------------------------
def test_orchard_chat_shows_the_servers_calls_and_results_between_the_text(model_folder, servers, tmp_path):
    from deployments.cli.local_server import LocalServer

    model = ModelConfig(model_id=MODEL, model_path=str(model_folder), context_length=4096,
                        chat_template_file=str(QWEN3_TEMPLATE))
    config = McpConfig(servers=[McpServerConfig(name="local", command=DEMO, cwd=str(REPO), allowed_tools=["add"])])
    with LocalServer([model], mcp=config) as server:
        chat = subprocess.run(
            [sys.executable, "-m", "deployments.cli.main", "chat", "--url", server.url, "--mcp", "local",
             "--tool-choice", "required", "--temperature", "0", "--max-tokens", "64"],
            input="Add two numbers.\n/stats\n", capture_output=True, text=True, cwd=REPO, timeout=120,
            env={**os.environ, "ORCHARD_HOME": str(tmp_path)})
    assert chat.returncode == 0, chat.stderr
    call = re.search(r"^\[local\] add\((\{.*\})\)\n-> (-?\d+)$", chat.stdout, re.MULTILINE)
    assert call is not None, chat.stdout
    check_result("add", json.loads(call[1]), call[2])
    assert re.search(r"^\d+ tokens, .* prompt \d+ tokens \(\d+ from the prefix cache\)$", chat.stdout, re.MULTILINE)
