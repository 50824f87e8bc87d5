"""`orchard chat` as a user runs it (subprocesses), against a real server: the ingress over
in-process engines on a loopback port (deployments/cli/local_server.py). The shell is driven piped and through a
pseudo-terminal; its answers must be the server's own greedy answers."""

from __future__ import annotations

import json
import os
import re
import select
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from deployments.cli.chat import Screen
from deployments.cli.chat_stream import Answer, _take_chunk
from deployments.cli.local_server import LocalServer
from deployments.config import ModelConfig
from tests.support.tiny_models import write_smollm2_tokenizer_model

REPO = Path(__file__).resolve().parents[2]
ORCHARD = [sys.executable, "-m", "deployments.cli.main"]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


@pytest.fixture(scope="module")
def server(tiny_models, tmp_path_factory):
    """tiny/alpha (a 256-word tokenizer) and tiny/tools (SmolLM2's tokenizer, so constrained tool calls work)."""
    tools_model = write_smollm2_tokenizer_model(tmp_path_factory.mktemp("cli-tools"), seed=2, scale=3.0)
    configs = [ModelConfig(model_id="tiny/alpha", model_path=str(tiny_models.alpha), context_length=512),
               ModelConfig(model_id="tiny/tools", model_path=str(tools_model), context_length=512)]
    with LocalServer(configs) as running:
        yield running


@pytest.fixture()
def home(tmp_path) -> Path:
    return tmp_path / "orchard-home"


def orchard(*args: str, stdin: str = "", home: Path | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "NO_COLOR": "1", **({"ORCHARD_HOME": str(home)} if home is not None else {})}
    return subprocess.run([*ORCHARD, *args], input=stdin, capture_output=True, text=True, cwd=REPO, env=env,
                          timeout=timeout, check=False)


def direct_answer(server: LocalServer, model: str, messages: list[dict], max_tokens: int) -> dict:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0}
    response = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


# ---- piped -----------------------------------------------------------------------------------
def test_piped_chat_answers_as_the_server_does_with_history_stats_and_a_multiline_message(server):
    script = 't1 t2\n/stats\n"""\nt3\nt4\n"""\n/stats\n'
    result = orchard("chat", "--url", server.url, "--model", "tiny/alpha", "--temperature", "0", "--max-tokens", "6",
                     stdin=script)
    assert result.returncode == 0, result.stderr
    assert "\x1b" not in result.stdout  # piped: no ANSI
    first = direct_answer(server, "tiny/alpha", [{"role": "user", "content": "t1 t2"}], 6)
    first_text = first["choices"][0]["message"]["content"]
    second = direct_answer(server, "tiny/alpha", [{"role": "user", "content": "t1 t2"},
                                                  {"role": "assistant", "content": first_text},
                                                  {"role": "user", "content": "t3\nt4"}], 6)
    lines = result.stdout.splitlines()
    assert lines[:2] == [first_text, "[cut at --max-tokens]"]
    stats = re.fullmatch(r"(\d+) tokens, ([\d.]+|-) tok/s, TTFT ([\d.]+) s, ([\d.]+) s in all; "
                         r"prompt (\d+) tokens \((\d+) from the prefix cache\)", lines[2])
    assert stats, lines[2]
    assert int(stats[1]) == first["usage"]["completion_tokens"] and int(stats[5]) == first["usage"]["prompt_tokens"]
    assert float(stats[3]) <= float(stats[4])
    assert lines[3:5] == [second["choices"][0]["message"]["content"], "[cut at --max-tokens]"]  # it saw the first turn
    assert lines[5].startswith(f"{second['usage']['completion_tokens']} tokens, ") and len(lines) == 6


def test_piped_commands_switch_model_set_system_and_clear(server):
    script = ("/model\n/model tiny/nope\n/model tiny/tools\n/system Be brief.\n/system\nt1\n/clear\n/system off\n"
              "/exit\nt2\n")
    result = orchard("chat", "--url", f"{server.url}/v1", "--temperature", "0", "--max-tokens", "4", stdin=script)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[:7] == [
        "* tiny/alpha (running)", "  tiny/tools (running)",
        "no chat model 'tiny/nope'; available: tiny/alpha, tiny/tools",
        "model: tiny/tools (the conversation goes on with it; /clear to start afresh)",
        "system: Be brief.", "system: Be brief.",
        direct_answer(server, "tiny/tools", [{"role": "system", "content": "Be brief."},
                                             {"role": "user", "content": "t1"}], 4)["choices"][0]["message"]["content"],
    ]
    assert lines[7:] == ["[cut at --max-tokens]", "conversation cleared", "no system message"]  # /exit: t2 unasked


def test_piped_tool_call_is_shown_and_a_refused_request_fails_the_run(server, tmp_path):
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps(TOOLS))
    result = orchard("chat", "--url", server.url, "--model", "tiny/tools", "--tools", str(tools),
                     "--tool-choice", "required", "--max-tokens", "60", stdin="weather in Paris?\n")
    assert result.returncode == 0, result.stderr
    call = re.fullmatch(r"\[tool call\] get_weather\((.*)\)", result.stdout.splitlines()[0])
    # the arguments as far as written: a random model's city may run past --max-tokens
    assert call and call[1].replace(" ", "").startswith('{"city":"'), result.stdout
    refused = orchard("chat", "--url", server.url, "--max-tokens", "0", stdin="t1\n")
    assert refused.returncode == 1 and refused.stdout == ""
    assert refused.stderr.startswith("error: ") and "max_tokens" in refused.stderr and "(HTTP 400)" in refused.stderr


def test_local_chat_runs_the_model_in_process_with_no_server(server, tiny_models):
    result = orchard("chat", "--local", str(tiny_models.alpha), "--temperature", "0", "--max-tokens", "6",
                     stdin="t1 t2\n/model\n")
    assert result.returncode == 0, result.stderr
    expected = direct_answer(server, "tiny/alpha", [{"role": "user", "content": "t1 t2"}], 6)  # the same weights
    assert result.stdout.splitlines() == [expected["choices"][0]["message"]["content"], "[cut at --max-tokens]",
                                          "* alpha (running)"]
    assert result.stderr == f"loading {tiny_models.alpha} in this process ...\n"


# ---- errors before the shell opens -------------------------------------------------------------
def test_no_server_is_a_clear_message_and_exit_1():
    result = orchard("chat", "--url", "http://127.0.0.1:9", stdin="t1\n")
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr.startswith("orchard chat: no Orchard server answers at http://127.0.0.1:9 (ConnectError")
    assert "Start one with `orchard serve`" in result.stderr


def test_unknown_model_lists_the_available_ones(server):
    result = orchard("chat", "--url", server.url, "--model", "no-such-model", stdin="t1\n")
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr == (f"orchard chat: no chat model 'no-such-model' at {server.url}; "
                             "available: tiny/alpha, tiny/tools\n")


# ---- a terminal ----------------------------------------------------------------------------------
class Pty:
    """The shell on a pseudo-terminal, as a user's terminal runs it."""

    def __init__(self, args: list[str], home: Path) -> None:
        import pty

        self.master, slave = pty.openpty()
        env = {k: v for k, v in os.environ.items() if k != "NO_COLOR"}
        env.update(ORCHARD_HOME=str(home), TERM="xterm-256color")
        self.process = subprocess.Popen([*ORCHARD, *args], stdin=slave, stdout=slave, stderr=slave, cwd=REPO, env=env,
                                        start_new_session=True)
        os.close(slave)
        self.seen = ""

    def send(self, text: str) -> None:
        os.write(self.master, text.encode())

    def expect(self, pattern: str, timeout_s: float = 60) -> re.Match:
        deadline = time.monotonic() + timeout_s
        while (found := re.search(pattern, self.seen, re.DOTALL)) is None:
            left = deadline - time.monotonic()
            assert left > 0, f"no {pattern!r} within {timeout_s} s; the terminal shows:\n{self.seen!r}"
            if select.select([self.master], [], [], left)[0]:
                try:
                    self.seen += os.read(self.master, 65536).decode(errors="replace")
                except OSError:  # the shell exited and closed the terminal
                    pass
        self.seen = self.seen[found.end():]
        return found

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        os.close(self.master)


def test_terminal_session_streams_in_colour_keeps_history_and_quits_on_ctrl_d(server, home):
    answer = direct_answer(server, "tiny/alpha", [{"role": "user", "content": "t5 \nt6"}], 5)["choices"][0]["message"]
    shell = Pty(["chat", "--url", server.url, "--temperature", "0", "--max-tokens", "5"], home)
    try:
        shell.expect(r"\x1b\[2morchard chat: tiny/alpha at " + re.escape(server.url) + r"\. /help")
        shell.expect(r"\x1b\[1m\x02?>>> ")  # a bold prompt (readline drops the \x01..\x02 markers)
        shell.send("t5 \\\r")  # a line ending in a backslash goes on
        shell.expect(r"\.\.\. ")
        shell.send("t6\r")
        shown = shell.expect(r"t6\r\n(.*?)\r\n.*?>>> ")[1]  # one message of the two lines, answered as the server does
        assert ANSI.sub("", shown) == answer["content"]
        shell.send("/stats\r")
        shell.expect(r"\x1b\[2m\d+ tokens, [\d.-]+ tok/s, TTFT [\d.]+ s")
        # Ctrl-D at the prompt: typed ahead while the terminal is still cooked, the line discipline turns it into a
        # NUL byte once readline switches to raw mode, and readline never sees an EOF (as in any readline shell)
        shell.expect(r">>> ")
        shell.send("\x04")
        assert shell.process.wait(timeout=30) == 0
    finally:
        shell.close()
    assert {"t6", "/stats"} <= set((home / "chat_history").read_text().splitlines())


ANSI = re.compile(r"\x1b\[[0-9;]*m")


# ---- reasoning, rendered -------------------------------------------------------------------------
def test_reasoning_is_dimmed_and_separate_on_a_terminal_and_marked_when_plain():
    """The chunks a reasoning model streams (`reasoning_content`, then `content`), through the shell's renderer."""
    chunks = [{"choices": [{"index": 0, "delta": {"reasoning_content": "Paris is"}}]},
              {"choices": [{"index": 0, "delta": {"reasoning_content": " the capital."}}]},
              {"choices": [{"index": 0, "delta": {"content": "Paris."}, "finish_reason": "stop"}]},
              {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 7}}]
    for color, expected in ((True, "\x1b[2mParis is\x1b[0m\x1b[2m the capital.\x1b[0m\n\nParis.\n"),
                            (False, "<think>\nParis is the capital.\n</think>\n\nParis.\n")):
        out, answer = _Capture(), Answer()
        screen = Screen(out, color)
        for chunk in chunks:
            _take_chunk(chunk, answer, screen, time.perf_counter())
        screen.answer_done(answer)
        assert out.text == expected
        assert (answer.reasoning, answer.text, answer.finish_reason) == ("Paris is the capital.", "Paris.", "stop")
        assert (answer.stats.prompt_tokens, answer.stats.completion_tokens) == (9, 7)


class _Capture:
    def __init__(self) -> None:
        self.text = ""

    def write(self, text: str) -> None:
        self.text += text

    def flush(self) -> None:
        pass
