"""`orchard chat`: an interactive shell against a running server (or an in-process one with --local), streamed
over the OpenAI-compatible API. On a terminal: readline history, colours, reasoning dimmed; piped: the same
commands read from stdin, answers printed plain."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

import httpx

from deployments.cli.chat_messages import stream_mcp_answer
from deployments.cli.chat_stream import Answer, AnswerError, AnswerStats, stream_answer
from deployments.cli.server_client import (
    ServedModel,
    ServerError,
    auth_headers,
    default_url,
    served_models,
    server_health,
    unreachable_message,
)

HELP = """commands:
  /model [ID]      list the models, or switch to ID
  /system [TEXT]   show the system message, or set it (/system off removes it)
  /clear           forget the conversation (the system message stays)
  /stats           tokens, tok/s and TTFT of the last answer
  /help            this list
  /exit            quit (or Ctrl-D)
a message of several lines: end lines with \\ or put it between lines of \"\"\"."""

DIM, YELLOW, BOLD, RESET = "\x1b[2m", "\x1b[33m", "\x1b[1m", "\x1b[0m"
BLOCK = '"""'


def add_parser(commands: argparse._SubParsersAction) -> None:
    chat = commands.add_parser("chat", help="chat with a model of a running server (or --local, in process)")
    chat.add_argument("--model", default=None, help="model id (default: the server's first chat model)")
    chat.add_argument("--url", default=None, help=f"server URL (default: $ORCHARD_URL or {default_url()})")
    chat.add_argument("--local", nargs="?", const="default", default=None, metavar="MODEL_PATH",
                      help="no server: run MODEL_PATH (default: the embedded SmolLM2) in this process")
    chat.add_argument("--api-key", default=os.environ.get("ORCHARD_API_KEY"), help="default: $ORCHARD_API_KEY")
    chat.add_argument("--system", default=None, help="a system message to start with")
    chat.add_argument("--max-tokens", type=int, default=1024)
    chat.add_argument("--temperature", type=float, default=None, help="default: the model's own")
    chat.add_argument("--tools", default=None, metavar="FILE",
                      help="offer the tools of this JSON file (OpenAI's `tools` list); calls are shown, not run")
    chat.add_argument("--tool-choice", default=None, help="auto, required, none")
    chat.add_argument("--mcp", action="append", default=None, metavar="NAME",
                      help="the server runs the tools of its MCP server NAME (serve_config.yaml's mcp.servers; "
                           "repeatable); answers go over /v1/messages, calls and results shown as they run")


@dataclass
class Session:
    url: str
    model: str
    models: list[ServedModel]
    system: str | None = None
    messages: list[dict] = field(default_factory=list)
    last: AnswerStats | None = None
    failed_answers: int = 0  # piped, any makes the exit status 1
    request_fields: dict = field(default_factory=dict)  # max_tokens, temperature, tools, tool_choice
    mcp_servers: list[str] = field(default_factory=list)  # --mcp: the server's MCP servers its tool loop uses


class Screen:
    """Where answers go: ANSI colours only on a terminal that takes them."""

    def __init__(self, out: TextIO, color: bool) -> None:
        self.out, self.color = out, color
        self._in_reasoning = False

    def _write(self, text: str, style: str = "") -> None:
        self.out.write(f"{style}{text}{RESET}" if style and self.color else text)
        self.out.flush()

    def reasoning(self, text: str) -> None:
        if not self._in_reasoning:
            self._in_reasoning = True
            self._write("" if self.color else "<think>\n")
        self._write(text, DIM)

    def text(self, text: str) -> None:
        self._end_reasoning()
        self._write(text)

    def _end_reasoning(self) -> None:
        if self._in_reasoning:
            self._in_reasoning = False
            self._write("\n\n" if self.color else "\n</think>\n\n")

    def answer_done(self, answer: Answer) -> None:
        self._end_reasoning()
        if answer.text:
            self._write("\n")
        for call in answer.tool_calls:
            self._write(f"[tool call] {call.name}({call.arguments})\n", YELLOW)
        if answer.finish_reason in ("length", "max_tokens"):
            self._write("[cut at --max-tokens]\n", DIM)

    def tool_call(self, server: str, name: str, arguments: str) -> None:
        self._end_reasoning()
        self._write(f"\n[{server}] {name}({arguments})\n", YELLOW)

    def tool_result(self, text: str, is_error: bool) -> None:
        shown = text if len(text) <= 500 else text[:500] + f"... ({len(text):,} characters)"
        self._write(("error: " if is_error else "-> ") + shown + "\n", DIM)

    def stopped(self) -> None:
        self._in_reasoning = False
        self._write("\n[stopped]\n", DIM)

    def note(self, text: str) -> None:
        self._write(text + "\n", DIM)

    def error(self, text: str) -> None:
        self._in_reasoning = False
        sys.stderr.write(f"{text}\n")
        sys.stderr.flush()


def run(args: argparse.Namespace) -> int:
    if args.local is not None:
        return _run_local(args)
    return _chat(args, args.url or default_url())


def _run_local(args: argparse.Namespace) -> int:
    from deployments.cli.local_server import LocalServer
    from deployments.config import ModelConfig

    if args.url is not None:
        print("orchard chat: --local and --url exclude each other", file=sys.stderr)
        return 2
    model_id = args.model or ("SmolLM2-135M-Instruct" if args.local == "default" else Path(args.local).name)
    print(f"loading {args.local} in this process ...", file=sys.stderr)
    logging.getLogger("ray.serve.orchard").setLevel(logging.WARNING)  # the server's per-request lines
    server = LocalServer([ModelConfig(model_id=model_id, model_path=args.local)])
    try:
        server.start()
    except Exception as exc:  # noqa: BLE001 - whatever the load raised, the user gets one line
        print(f"orchard chat: cannot load {args.local}: {getattr(exc, 'message', None) or exc}", file=sys.stderr)
        return 1
    try:
        return _chat(args, server.url)
    finally:
        server.stop()


def _chat(args: argparse.Namespace, url: str) -> int:
    try:
        session = _open_session(args, url.rstrip("/").removesuffix("/v1"))  # OpenAI clients' base URL works too
    except ServerError as exc:
        print(f"orchard chat: {exc}", file=sys.stderr)
        return 1
    interactive = sys.stdin.isatty()
    color = sys.stdout.isatty() and "NO_COLOR" not in os.environ and os.environ.get("TERM") != "dumb"
    screen = Screen(sys.stdout, color)
    read_line = _terminal_reader(screen) if interactive else _pipe_reader
    if interactive:
        screen.note(f"orchard chat: {session.model} at {session.url}. /help for commands, Ctrl-D to quit.")
    with httpx.Client(headers=auth_headers(args.api_key), timeout=httpx.Timeout(600, connect=5)) as http:
        try:
            status = _loop(session, http, screen, read_line)
            return 1 if status == 0 and session.failed_answers and not interactive else status
        finally:
            if interactive:
                _save_history()


def _open_session(args: argparse.Namespace, url: str) -> Session:
    models = [m for m in served_models(server_health(url, args.api_key)) if m.chats]
    names = ", ".join(m.id for m in models) or "none"
    if args.model is not None and args.model not in {m.id for m in models}:
        raise ServerError(f"no chat model '{args.model}' at {url}; available: {names}")
    if not models:
        raise ServerError(f"no chat model is loaded at {url} (load one: POST /v1/admin/load-model, or in "
                          "serve_config.yaml)")
    fields: dict = {"max_tokens": args.max_tokens}
    if args.temperature is not None:
        fields["temperature"] = args.temperature
    if args.tools is not None:
        try:
            fields["tools"] = json.loads(Path(args.tools).read_text())
        except (OSError, ValueError) as exc:
            raise ServerError(f"--tools {args.tools}: {exc}") from exc
    if args.mcp and args.tools is not None:
        raise ServerError("--tools and --mcp exclude each other (the server runs --mcp's tools; --tools are shown)")
    if args.tool_choice is not None:
        fields["tool_choice"] = _anthropic_choice(args.tool_choice) if args.mcp else args.tool_choice
    return Session(url, args.model or models[0].id, models, system=args.system, request_fields=fields,
                   mcp_servers=args.mcp or [])


def _anthropic_choice(choice: str) -> dict:
    return {"type": {"required": "any"}.get(choice, choice)}


def _loop(session: Session, http: httpx.Client, screen: Screen, read_line: Callable[[str], str | None]) -> int:
    while True:
        try:
            message = _read_message(read_line)
        except KeyboardInterrupt:  # at the prompt: drop what was typed, as Python's REPL does
            screen.out.write("\n")
            continue
        if message is None:
            return 0
        if not message.strip():
            continue
        if message.startswith("/"):
            if _command(session, screen, message.strip()) == "exit":
                return 0
            continue
        _ask(session, http, screen, message)


def _ask(session: Session, http: httpx.Client, screen: Screen, message: str) -> None:
    turn = [{"role": "user", "content": message}]
    system = [{"role": "system", "content": session.system}] if session.system else []
    body = {"model": session.model, "messages": system + session.messages + turn, **session.request_fields}
    try:
        if session.mcp_servers:
            body["mcp_servers"] = [{"type": "url", "name": name} for name in session.mcp_servers]
            answer = stream_mcp_answer(http, session.url, body, screen)
        else:
            answer = stream_answer(http, session.url, body, screen)
    except KeyboardInterrupt:  # leaving the stream closes the connection: the server aborts the answer
        screen.stopped()
        return
    except AnswerError as exc:
        session.failed_answers += 1
        screen.error(f"error: {exc}")
        return
    except httpx.HTTPError as exc:
        session.failed_answers += 1
        screen.error(f"error: {unreachable_message(session.url, exc)}")
        return
    screen.answer_done(answer)
    session.last = answer.stats
    session.messages += turn + _assistant_turn(answer)


def _assistant_turn(answer: Answer) -> list[dict]:
    """The answer as history; tool calls are shown, never run, and the model is told so in their results. Over
    /v1/messages (--mcp) its blocks, the server's tool calls and results among them."""
    if answer.blocks:
        return [{"role": "assistant", "content": answer.blocks}]
    if not answer.tool_calls:
        return [{"role": "assistant", "content": answer.text}]
    calls = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
             for c in answer.tool_calls]
    results = [{"role": "tool", "tool_call_id": c.id, "content": "orchard chat does not run tools"}
               for c in answer.tool_calls]
    return [{"role": "assistant", "content": answer.text or None, "tool_calls": calls}, *results]


def _command(session: Session, screen: Screen, line: str) -> str | None:
    name, _, argument = line.partition(" ")
    argument = argument.strip()
    if name in ("/exit", "/quit", "/bye"):
        return "exit"
    if name == "/help":
        screen.note(HELP)
    elif name == "/clear":
        session.messages.clear()
        screen.note("conversation cleared")
    elif name == "/stats":
        screen.note(session.last.describe() if session.last is not None else "no answer yet")
    elif name == "/system":
        if argument:
            session.system = None if argument == "off" else argument
        screen.note(f"system: {session.system}" if session.system else "no system message")
    elif name == "/model":
        _switch_model(session, screen, argument)
    else:
        screen.note(f"unknown command {name}; /help lists them")
    return None


def _switch_model(session: Session, screen: Screen, model: str) -> None:
    try:
        session.models = [m for m in served_models(server_health(session.url)) if m.chats]
    except ServerError as exc:
        screen.note(f"error: {exc}")
        return
    if not model:
        for m in session.models:
            screen.note(f"{'*' if m.id == session.model else ' '} {m.id} ({m.status})")
        return
    if model not in {m.id for m in session.models}:
        screen.note(f"no chat model '{model}'; available: {', '.join(m.id for m in session.models) or 'none'}")
        return
    session.model = model
    screen.note(f"model: {model} (the conversation goes on with it; /clear to start afresh)")


def _read_message(read_line: Callable[[str], str | None]) -> str | None:
    """One message: a line; lines ending in a backslash joined; or the lines between two \"\"\" lines."""
    first = read_line(">>> ")
    if first is None:
        return None
    if first.strip() == BLOCK:
        lines: list[str] = []
        while (line := read_line("... ")) is not None and line.strip() != BLOCK:
            lines.append(line)
        return "\n".join(lines)
    lines = [first]
    while lines[-1].endswith("\\"):
        lines[-1] = lines[-1][:-1]
        line = read_line("... ")
        if line is None:
            break
        lines.append(line)
    return "\n".join(lines)


def _pipe_reader(prompt: str) -> str | None:
    line = sys.stdin.readline()
    return line.rstrip("\n") if line else None


def _history_path() -> Path:
    home = os.environ.get("ORCHARD_HOME")
    return (Path(home) if home else Path.home() / ".cache" / "orchard") / "chat_history"


def _terminal_reader(screen: Screen) -> Callable[[str], str | None]:
    import readline  # line editing and history for input()

    try:
        readline.read_history_file(_history_path())
    except OSError:
        pass
    readline.set_history_length(1000)
    prompt_style = (BOLD, RESET) if screen.color else ("", "")

    def read_line(prompt: str) -> str | None:
        try:  # \x01..\x02 tell readline the colour codes take no columns
            return input(f"\x01{prompt_style[0]}\x02{prompt}\x01{prompt_style[1]}\x02" if screen.color else prompt)
        except EOFError:
            screen.out.write("\n")
            return None

    return read_line


def _save_history() -> None:
    import readline

    try:
        _history_path().parent.mkdir(parents=True, exist_ok=True)
        readline.write_history_file(_history_path())
    except OSError:
        pass
