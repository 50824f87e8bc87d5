"""Re-record what the real coding agents send: Claude Code and Codex CLI against a capturing stand-in.

    python scripts/capture_agent_requests.py [--bin-dir .cache/agents/node_modules/.bin] [--out tests/fixtures/agents]

Install the CLIs first (scripts/check_agents.sh does, into .cache/agents). The stand-in listens on 127.0.0.1,
records every request (method, path, headers without keys, JSON body) as <out>/<agent>/<scenario>/NNN_*.json and
answers validly: Anthropic Messages (SSE or JSON) and count_tokens, OpenAI Responses (SSE). A scenario with
`tool` answers the first request that offers a shell tool with a call running `echo hi`, and a text answer once a
tool result is in the history; `reasoning` puts a reasoning item before each Responses answer. Keys are dummies.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import subprocess
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

ANSWER = "Hello! How can I help you today?"
SECRET_HEADERS = {"authorization", "x-api-key", "cookie"}
TOOL_OUTPUT_TYPES = {"function_call_output", "custom_tool_call_output", "local_shell_call_output"}


@dataclass
class Scenario:
    agent: str  # "claude_code" or "codex"
    name: str
    commands: list[list[str]]  # CLI arguments, run one after the other in one home
    tool: bool = False
    reasoning: bool = False
    model: str = "tiny-model"  # Codex's model id; Claude Code's when `claude_model` is set
    claude_model: bool = False  # set ANTHROPIC_MODEL (as an Orchard user would); else Claude Code's default


SCENARIOS = [
    Scenario("claude_code", "hello", [["-p", "say hello"]]),
    Scenario("claude_code", "tool_loop", [["-p", "run echo hi in the shell", "--allowedTools", "Bash"]], tool=True),
    Scenario("claude_code", "custom_model_hello", [["-p", "say hello"]], claude_model=True),
    Scenario("claude_code", "context_count_tokens", [["-p", "/context"]]),
    Scenario("claude_code", "minimal_hello", [[
        "--bare", "--tools", "", "--system-prompt", "You are a helpful assistant.", "-p", "say hello",
    ]], claude_model=True),
    Scenario("codex", "hello", [["exec", "--skip-git-repo-check", "say hello"]]),
    Scenario("codex", "tool_loop", [["exec", "--skip-git-repo-check", "run echo hi in the shell"]], tool=True),
    Scenario(
        "codex",
        "known_model_reasoning_tool_loop_resume",
        [
            ["exec", "--skip-git-repo-check", "run echo hi in the shell"],
            ["exec", "resume", "--skip-git-repo-check", "--last", "now say bye"],
        ],
        tool=True,
        reasoning=True,
        model="gpt-5.5",  # a model Codex knows: its full tool set (apply_patch, tool_search), verbosity, effort
    ),
]


@dataclass
class StandIn:
    out: Path
    tool: bool
    reasoning: bool
    counter: itertools.count = field(default_factory=lambda: itertools.count(1))
    lock: threading.Lock = field(default_factory=threading.Lock)

    def record(self, method: str, path: str, headers: dict[str, str], raw: bytes) -> Any:
        body = json.loads(raw) if raw else None
        with self.lock:
            n = next(self.counter)
        slug = path.split("?")[0].strip("/").replace("/", "_") or "root"
        kept = {k.lower(): v for k, v in headers.items() if k.lower() not in SECRET_HEADERS}
        entry = {"method": method, "path": path, "headers": kept, "body": body}
        (self.out / f"{n:03d}_{method}_{slug}.json").write_text(json.dumps(entry, indent=1, ensure_ascii=False) + "\n")
        return body


def sse(event: str, data: dict[str, Any]) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data)}\n\n".encode()


def anthropic_blocks(standin: StandIn, body: dict[str, Any]) -> tuple[list[dict[str, Any]], str]:
    answered = any(
        isinstance(m.get("content"), list) and any(b.get("type") == "tool_result" for b in m["content"])
        for m in body.get("messages", [])
    )
    if standin.tool and not answered and any(t.get("name") == "Bash" for t in body.get("tools") or []):
        call = {"type": "tool_use", "id": f"toolu_{uuid.uuid4().hex[:24]}", "name": "Bash",
                "input": {"command": "echo hi", "description": "Print hi"}}
        return [{"type": "text", "text": "I'll run it."}, call], "tool_use"
    return [{"type": "text", "text": ANSWER}], "end_turn"


def anthropic_events(blocks: list[dict[str, Any]], stop: str, message: dict[str, Any]) -> list[bytes]:
    events = [sse("message_start", {"type": "message_start", "message": message}), sse("ping", {"type": "ping"})]
    for i, block in enumerate(blocks):
        if block["type"] == "text":
            start, delta = {"type": "text", "text": ""}, {"type": "text_delta", "text": block["text"]}
        else:
            start = {**block, "input": {}}
            delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}
        events.append(sse("content_block_start", {"type": "content_block_start", "index": i, "content_block": start}))
        events.append(sse("content_block_delta", {"type": "content_block_delta", "index": i, "delta": delta}))
        events.append(sse("content_block_stop", {"type": "content_block_stop", "index": i}))
    final = {"type": "message_delta", "delta": {"stop_reason": stop, "stop_sequence": None},
             "usage": {"output_tokens": 9}}
    return events + [sse("message_delta", final), sse("message_stop", {"type": "message_stop"})]


def shell_call(standin: StandIn, body: dict[str, Any]) -> dict[str, Any] | None:
    items = body.get("input") if isinstance(body.get("input"), list) else []
    if not standin.tool or any(i.get("type") in TOOL_OUTPUT_TYPES for i in items):
        return None
    arguments = {"exec_command": {"cmd": "echo hi"}, "shell": {"command": ["bash", "-lc", "echo hi"]},
                 "shell_command": {"command": "echo hi"}}
    for tool in body.get("tools") or []:
        if tool.get("type") == "function" and tool.get("name") in arguments:
            return {"type": "function_call", "id": f"fc_{uuid.uuid4().hex[:24]}",
                    "call_id": f"call_{uuid.uuid4().hex[:24]}", "name": tool["name"],
                    "arguments": json.dumps(arguments[tool["name"]]), "status": "completed"}
    return None


def responses_events(standin: StandIn, body: dict[str, Any]) -> list[bytes]:
    """One streamed Response: [reasoning item], then a function call or a text message."""
    seq = itertools.count(0)
    events: list[bytes] = []

    def emit(kind: str, **fields: Any) -> None:
        events.append(sse(kind, {"type": kind, "sequence_number": next(seq), **fields}))

    base = {"id": f"resp_{uuid.uuid4().hex[:24]}", "object": "response", "created_at": int(time.time()),
            "model": body.get("model"), "status": "in_progress", "output": [], "usage": None}
    emit("response.created", response=base)
    emit("response.in_progress", response=base)
    output: list[dict[str, Any]] = []
    if standin.reasoning:
        rs_id, thought = f"rs_{uuid.uuid4().hex[:24]}", "The user asked for something; I will do it."
        emit("response.output_item.added", output_index=0, item={"type": "reasoning", "id": rs_id, "summary": []})
        emit("response.reasoning_text.delta", item_id=rs_id, output_index=0, content_index=0, delta=thought)
        emit("response.reasoning_text.done", item_id=rs_id, output_index=0, content_index=0, text=thought)
        output.append({"type": "reasoning", "id": rs_id, "summary": [],
                       "content": [{"type": "reasoning_text", "text": thought}], "encrypted_content": None})
        emit("response.output_item.done", output_index=0, item=output[-1])
    index, call = len(output), shell_call(standin, body)
    if call is not None:
        emit("response.output_item.added", output_index=index, item={**call, "arguments": "", "status": "in_progress"})
        emit("response.function_call_arguments.delta", item_id=call["id"], output_index=index, delta=call["arguments"])
        emit("response.function_call_arguments.done", item_id=call["id"], output_index=index,
             arguments=call["arguments"])
        item = call
    else:
        msg_id, part = f"msg_{uuid.uuid4().hex[:24]}", {"type": "output_text", "text": "", "annotations": []}
        where = {"item_id": msg_id, "output_index": index, "content_index": 0}
        emit("response.output_item.added", output_index=index,
             item={"type": "message", "id": msg_id, "role": "assistant", "status": "in_progress", "content": []})
        emit("response.content_part.added", **where, part=part)
        emit("response.output_text.delta", **where, delta=ANSWER)
        emit("response.output_text.done", **where, text=ANSWER)
        emit("response.content_part.done", **where, part={**part, "text": ANSWER})
        item = {"type": "message", "id": msg_id, "role": "assistant", "status": "completed",
                "content": [{**part, "text": ANSWER}]}
    emit("response.output_item.done", output_index=index, item=item)
    usage = {"input_tokens": 12, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": 9,
             "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 21}
    emit("response.completed", response={**base, "status": "completed", "output": output + [item], "usage": usage})
    return events


def handler_for(standin: StandIn) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt: str, *args: Any) -> None:
            pass

        def answer(self, status: int, content_type: str, chunks: list[bytes]) -> None:
            self.send_response(status)
            self.send_header("content-type", content_type)
            self.send_header("content-length", str(sum(len(c) for c in chunks)))
            self.end_headers()
            for chunk in chunks:
                self.wfile.write(chunk)

        def do_GET(self) -> None:
            standin.record("GET", self.path, dict(self.headers), b"")
            found = self.path.split("?")[0].endswith("/models")
            reply = {"object": "list", "data": [], "models": []} if found else {"error": {"message": "not found"}}
            self.answer(200 if found else 404, "application/json", [json.dumps(reply).encode()])

        def do_POST(self) -> None:
            raw = self.rfile.read(int(self.headers.get("content-length") or 0))
            body = standin.record("POST", self.path, dict(self.headers), raw)
            path = self.path.split("?")[0]
            if path.endswith("/messages/count_tokens"):
                self.answer(200, "application/json", [b'{"input_tokens": 42}'])
            elif path.endswith("/messages"):
                blocks, stop = anthropic_blocks(standin, body)
                usage = {"input_tokens": 12, "output_tokens": 9, "cache_creation_input_tokens": 0,
                         "cache_read_input_tokens": 0}
                message = {"id": f"msg_{uuid.uuid4().hex[:24]}", "type": "message", "role": "assistant",
                           "model": body.get("model"), "content": [], "stop_reason": None, "stop_sequence": None,
                           "usage": usage}
                if body.get("stream"):
                    self.answer(200, "text/event-stream", anthropic_events(blocks, stop, message))
                else:
                    whole = {**message, "content": blocks, "stop_reason": stop}
                    self.answer(200, "application/json", [json.dumps(whole).encode()])
            elif path.endswith("/responses"):
                self.answer(200, "text/event-stream", responses_events(standin, body))
            else:
                self.answer(404, "application/json", [b'{"error": {"message": "not found"}}'])

    return Handler


def agent_env(scenario: Scenario, home: Path, base_url: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ANTHROPIC_", "OPENAI_", "CLAUDE_", "CODEX_"))}
    env.update(HOME=str(home), NO_COLOR="1")
    if scenario.agent == "claude_code":
        env.update(ANTHROPIC_BASE_URL=base_url, ANTHROPIC_API_KEY="dummy", CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1",
                   DISABLE_AUTOUPDATER="1", DISABLE_TELEMETRY="1", DISABLE_ERROR_REPORTING="1")
        if scenario.claude_model:
            env.update(ANTHROPIC_MODEL=scenario.model, ANTHROPIC_SMALL_FAST_MODEL=scenario.model)
    else:
        env.update(CODEX_HOME=str(home), ORCHARD_API_KEY="dummy")
        (home / "config.toml").write_text(codex_config(scenario.model, f"{base_url}/v1"))
    return env


def codex_config(model: str, base_url: str) -> str:
    return f"""model = "{model}"
model_provider = "orchard"
check_for_update_on_startup = false

[model_providers.orchard]
name = "Orchard"
base_url = "{base_url}"
wire_api = "responses"
env_key = "ORCHARD_API_KEY"

[analytics]
enabled = false

[feedback]
enabled = false

[otel]
exporter = "none"
"""


def capture(scenario: Scenario, bin_dir: Path, out: Path) -> None:
    folder = out / scenario.agent / scenario.name
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    standin = StandIn(folder, scenario.tool, scenario.reasoning)
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler_for(standin))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    binary = str(bin_dir.resolve() / ("claude" if scenario.agent == "claude_code" else "codex"))
    try:
        with tempfile.TemporaryDirectory(prefix="agent-home-") as home, tempfile.TemporaryDirectory() as work:
            env = agent_env(scenario, Path(home), f"http://127.0.0.1:{server.server_address[1]}")
            for args in scenario.commands:
                done = subprocess.run([binary, *args], check=False, env=env, cwd=work, stdin=subprocess.DEVNULL,
                                      capture_output=True, text=True, timeout=180)
                print(f"== {scenario.agent}/{scenario.name}: {' '.join(args)} -> exit {done.returncode}")
                print(done.stdout.strip()[-2000:])
                if done.returncode != 0:
                    raise SystemExit(f"{scenario.agent} failed:\n{done.stderr[-4000:]}")
    finally:
        server.shutdown()
    print(f"   {len(list(folder.iterdir()))} requests in {folder}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bin-dir", type=Path, default=Path(".cache/agents/node_modules/.bin"))
    parser.add_argument("--out", type=Path, default=Path("tests/fixtures/agents"))
    parser.add_argument("--only", nargs="*", help="scenarios as agent/name (default: all)")
    args = parser.parse_args()
    for scenario in SCENARIOS:
        if not args.only or f"{scenario.agent}/{scenario.name}" in args.only:
            capture(scenario, args.bin_dir, args.out)


if __name__ == "__main__":
    main()
