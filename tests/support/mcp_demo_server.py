"""A real MCP server (the `mcp` SDK's MCPServer, FastMCP's successor) for the tool-loop tests, over stdio or
streamable HTTP on loopback:

    python -m tests.support.mcp_demo_server                 # stdio
    python -m tests.support.mcp_demo_server http PORT       # http://127.0.0.1:PORT/mcp

Its tools: `add` and `shout` answer; `fail` raises; `hang` never answers (writing `started`, then `cancelled` when
the call is cancelled, to $MCP_DEMO_LOG); `flood` returns 10 MiB of text; `die` ends the server's process in the middle
of the call. `fail` and the last three take no arguments: a random test model chooses the others' freely.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import anyio
from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError

server = MCPServer("orchard-demo")


def _log(line: str) -> None:
    if path := os.environ.get("MCP_DEMO_LOG"):
        with Path(path).open("a") as log:
            log.write(line + "\n")


@server.tool()
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@server.tool()
def shout(text: str) -> str:
    """The text in capitals."""
    return text.upper()


@server.tool()
def fail() -> str:
    """Always fails, saying why."""
    raise ToolError("failed on purpose")


@server.tool()
async def hang() -> str:
    """Never answers (until cancelled)."""
    _log("started")
    try:
        await anyio.sleep_forever()
    except anyio.get_cancelled_exc_class():
        _log("cancelled")
        raise
    return "unreachable"


@server.tool()
def flood() -> str:
    """10 MiB of text."""
    return "x" * (10 << 20)


@server.tool()
def die() -> str:
    """Ends the server's process mid-call."""
    os._exit(3)


def check_result(name: str, arguments: dict, output: str) -> None:
    """Asserts `output` is what `name` answers for these arguments (of the tools that answer)."""
    if name == "add":
        assert output == str(arguments["a"] + arguments["b"]), (arguments, output)
    elif name == "shout":
        assert output == arguments["text"].upper(), (arguments, output)
    else:
        raise AssertionError(f"{name} gives no answer to check")


if __name__ == "__main__":
    if sys.argv[1:2] == ["http"]:
        server.run("streamable-http", host="127.0.0.1", port=int(sys.argv[2]))
    else:
        server.run()
