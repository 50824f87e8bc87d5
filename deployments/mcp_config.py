"""The ingress's `mcp` arg in serve_config.yaml: the MCP servers its tool loop may use, and the loop's bounds.

A request may use a declared server (by name) or, only where the operator lists URL prefixes in `allowed_urls`, a
streamable-HTTP server it names itself. Nothing else is started or reached. Secrets stay out of the config file:
`env` and `headers` values may name the ingress's environment variables as `${NAME}`, read in the ingress replica
when it connects.
"""

from __future__ import annotations

import os
import re
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

SERVER_NAME = r"^[A-Za-z0-9_-]{1,64}$"
_VARIABLE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


class McpServerConfig(BaseModel):
    """One MCP server: a local command spoken to over stdio, or a streamable-HTTP URL."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=SERVER_NAME, description="what requests call it (Anthropic's name, OpenAI's server_label)")
    command: list[str] | None = Field(None, min_length=1, description="stdio: the program and its arguments")
    env: dict[str, str] = Field(default_factory=dict, description="stdio: added to a minimal environment; ${VAR} "
                                "reads the ingress's")
    cwd: str | None = Field(None, description="stdio: the working folder")
    url: str | None = Field(None, description="streamable HTTP: the endpoint (http or https)")
    headers: dict[str, str] = Field(default_factory=dict, description="HTTP headers sent to it; ${VAR} reads the "
                                    "ingress's environment")
    allowed_tools: list[str] | None = Field(None, description="the tools requests may use (null: all it lists)")
    call_timeout_s: float | None = Field(None, gt=0, description="one call's limit (null: mcp.max_tool_time_s)")

    @model_validator(mode="after")
    def _one_transport(self) -> "McpServerConfig":
        if (self.command is None) == (self.url is None):
            raise ValueError(f"MCP server '{self.name}': give 'command' (stdio) or 'url' (streamable HTTP), not both "
                             "or neither")
        if self.url is not None:
            check_http_url(self.url, f"MCP server '{self.name}'")
        if self.command is None and (self.env or self.cwd):
            raise ValueError(f"MCP server '{self.name}': 'env' and 'cwd' are for a stdio 'command'")
        if self.url is None and self.headers:
            raise ValueError(f"MCP server '{self.name}': 'headers' are for a 'url' server")
        return self


class McpConfig(BaseModel):
    """The tool loop's servers and bounds (each bound, when hit, is an error the client and the model see)."""

    model_config = ConfigDict(extra="forbid")

    servers: list[McpServerConfig] = Field(default_factory=list, description="the servers requests may use by name")
    allowed_urls: list[str] = Field(
        default_factory=list, description="URL prefixes of servers a request may name itself (Anthropic's url, "
        "OpenAI's server_url); empty: only the declared servers")
    max_rounds: int = Field(8, ge=1, description="tool rounds (a model turn's calls, run) per request; calls past "
                            "them are not run and the response ends (Anthropic's pause_turn)")
    max_tool_time_s: float = Field(60.0, gt=0, description="one tool call's limit, unless its server sets one")
    max_result_bytes: int = Field(1 << 20, ge=1, description="a tool result's text; a larger one is an error result")
    connect_timeout_s: float = Field(30.0, gt=0, description="connecting to a server and listing its tools")

    @field_validator("servers")
    @classmethod
    def _unique_names(cls, servers: list[McpServerConfig]) -> list[McpServerConfig]:
        names = [server.name for server in servers]
        if duplicate := next((name for name in names if names.count(name) > 1), None):
            raise ValueError(f"two MCP servers are named '{duplicate}'")
        return servers

    @field_validator("allowed_urls")
    @classmethod
    def _http_prefixes(cls, prefixes: list[str]) -> list[str]:
        for prefix in prefixes:
            check_http_url(prefix, "mcp.allowed_urls")
        return prefixes

    def server(self, name: str) -> McpServerConfig | None:
        return next((server for server in self.servers if server.name == name), None)

    def url_allowed(self, url: str) -> bool:
        """Whether a request may reach `url`: it starts with an allowed prefix, scheme, host and port alike (so
        `http://host` allows no `http://host.evil`)."""
        try:
            check_http_url(url, "url")
        except ValueError:
            return False
        target = urlsplit(url)
        for prefix in map(urlsplit, self.allowed_urls):
            same_origin = (target.scheme, target.hostname, target.port) == (prefix.scheme, prefix.hostname, prefix.port)
            if same_origin and target.path.startswith(prefix.path.rstrip("/")) and not target.username:
                return True
        return False


def check_http_url(url: str, where: str) -> None:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{where}: '{url}' is not an http(s) URL")


def expand_environment(values: dict[str, str], where: str) -> dict[str, str]:
    """`values` with each ${NAME} replaced by the environment's NAME; a variable that is not set is an error naming
    it (never a silently empty secret)."""

    def variable(match: re.Match) -> str:
        name = match.group(1)
        if name not in os.environ:
            raise McpConfigError(f"{where}: the environment variable {name} is not set")
        return os.environ[name]

    return {key: _VARIABLE.sub(variable, value) for key, value in values.items()}


class McpConfigError(ValueError):
    """A declared server that cannot be used as configured (a variable it names is not set)."""
