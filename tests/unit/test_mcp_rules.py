"""The MCP loop's plain rules: which URLs a request may reach, how a config names its secrets, which calls wait for
approval, and what text a model reads of a tool's result."""

from __future__ import annotations

import pytest
from mcp_types import CallToolResult, ImageContent, TextContent
from pydantic import ValidationError

from deployments.mcp.sessions import result_text
from deployments.mcp_calls import ApprovalPolicy
from deployments.mcp_config import McpConfig, McpConfigError, McpServerConfig, expand_environment


def test_a_request_url_must_lie_under_an_allowed_prefix_scheme_host_and_port_alike():
    config = McpConfig(allowed_urls=["https://tools.example.com/mcp", "http://127.0.0.1:9000/"])
    assert config.url_allowed("https://tools.example.com/mcp")
    assert config.url_allowed("https://tools.example.com/mcp/v2")
    assert config.url_allowed("http://127.0.0.1:9000/anything")
    for refused in ("http://tools.example.com/mcp", "https://tools.example.com.evil.net/mcp",
                    "https://tools.example.com:8443/mcp", "https://tools.example.com/other",
                    "https://user@tools.example.com/mcp", "http://127.0.0.1:9001/", "file:///etc/passwd",
                    "ftp://127.0.0.1:9000/", "not a url"):
        assert not config.url_allowed(refused), refused
    assert not McpConfig().url_allowed("http://127.0.0.1:9000/")  # nothing listed: nothing reachable


def test_a_server_is_a_command_or_a_url_with_unique_names():
    with pytest.raises(ValidationError, match="give 'command' \\(stdio\\) or 'url'"):
        McpServerConfig(name="x")
    with pytest.raises(ValidationError, match="give 'command' \\(stdio\\) or 'url'"):
        McpServerConfig(name="x", command=["srv"], url="http://127.0.0.1/mcp")
    with pytest.raises(ValidationError, match="not an http\\(s\\) URL"):
        McpServerConfig(name="x", url="file:///srv.sock")
    with pytest.raises(ValidationError, match="'headers' are for a 'url' server"):
        McpServerConfig(name="x", command=["srv"], headers={"A": "b"})
    with pytest.raises(ValidationError, match="two MCP servers are named 'x'"):
        McpConfig(servers=[McpServerConfig(name="x", command=["a"]), McpServerConfig(name="x", command=["b"])])


def test_secrets_come_from_the_environment_and_a_missing_one_is_named(monkeypatch):
    monkeypatch.setenv("DEMO_TOKEN", "s3cret")
    assert expand_environment({"Authorization": "Bearer ${DEMO_TOKEN}", "X": "plain $NOT_A_VAR"}, "here") == {
        "Authorization": "Bearer s3cret", "X": "plain $NOT_A_VAR"}
    monkeypatch.delenv("DEMO_TOKEN")
    with pytest.raises(McpConfigError, match="^here: the environment variable DEMO_TOKEN is not set$"):
        expand_environment({"Authorization": "Bearer ${DEMO_TOKEN}"}, "here")


def test_approval_never_and_always_filters_beat_the_default():
    openai_default = ApprovalPolicy(default_always=True)
    assert openai_default.needs_approval("anything", read_only=True)
    assert not ApprovalPolicy().needs_approval("anything", read_only=False)
    policy = ApprovalPolicy(True, always_names=frozenset({"delete"}), never_names=frozenset({"search"}),
                            never_read_only=True)
    assert not policy.needs_approval("search", read_only=False)
    assert not policy.needs_approval("lookup", read_only=True)
    assert policy.needs_approval("delete", read_only=False)
    assert policy.needs_approval("write", read_only=False)


def test_a_result_reads_as_its_text_structured_content_or_named_media():
    text = CallToolResult(content=[TextContent(type="text", text="a"), TextContent(type="text", text="b")])
    assert result_text(text) == "a\nb"
    assert result_text(CallToolResult(content=[], structured_content={"result": 3})) == '{"result": 3}'
    image = CallToolResult(content=[ImageContent(type="image", data="AAAA", mime_type="image/png")])
    assert result_text(image) == "[image content (image/png) not shown]"
