"""Parser names (configured, or inferred from the chat template) and one parser per request.

`tool_call_parser` / `reasoning_parser` take Bodega's names; the qwen3 family variants share
the Hermes format. A model without a tool format of its own gets the generic one (chat/generic_tools.py: tools in
the system prompt, calls in the Hermes convention). A request's parser chains reasoning (first) and tool calls (on
the content).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from engine.errors import InvalidRequestError
from deployments.output_deltas import ContentDelta, ParsedEvent
from deployments.chat.parsers.harmony import HarmonyParser
from deployments.chat.parsers.reasoning import ThinkReasoningParser, prompt_opens_reasoning
from deployments.chat.parsers.tool_formats import GLM4_MOE, HERMES, MINIMAX_M2, QWEN3_CODER, ToolFormat, param_types
from deployments.chat.parsers.tool_parser import ToolCallParser, new_call_id

HARMONY = "harmony"
GENERIC = "generic"
TOOL_FORMATS: dict[str, ToolFormat] = {
    "qwen3": HERMES, "qwen3_moe": HERMES, "qwen3_next": HERMES, "qwen3_vl": HERMES, "hermes": HERMES,
    "qwen3_coder": QWEN3_CODER, "glm4_moe": GLM4_MOE, "minimax_m2": MINIMAX_M2, GENERIC: HERMES,
}
TOOL_PARSER_NAMES = (*TOOL_FORMATS, HARMONY)
# Every <think> family; qwen3_coder writes no reasoning, but naming it is harmless.
REASONING_PARSER_NAMES = ("qwen3", "qwen3_moe", "qwen3_next", "qwen3_vl", "qwen3_coder", "deepseek_r1",
                          "glm4_moe", "minimax_m2", HARMONY)


class OutputParser(Protocol):
    def feed(self, text: str) -> list[ParsedEvent]: ...

    def finish(self, cut: bool = False) -> list[ParsedEvent]:
        """The events the end of the output releases; `cut`: it ended at max_tokens."""
        ...


@dataclass(frozen=True)
class ParserNames:
    tool: str | None = None
    reasoning: str | None = None

    @property
    def is_harmony(self) -> bool:
        return HARMONY in (self.tool, self.reasoning)

    @property
    def tools_in_system_prompt(self) -> bool:
        """The generic format: the prompt describes the tools itself, not the chat template."""
        return self.tool == GENERIC

    def keeps_special_tokens(self, tools_enabled: bool) -> bool:
        """Harmony's channel markers are special tokens, and some families mark tool calls with
        special tokens: the detokenizer must keep them in the text then (as vLLM's parsers do).
        The generic format's markers are plain text."""
        return self.is_harmony or (tools_enabled and self.tool not in (None, GENERIC))


def infer_parser_names(chat_template: str | None) -> ParserNames:
    """The parsers a chat template's own markup implies (None where it implies none)."""
    template = chat_template or ""
    if "<|channel|>" in template:
        return ParserNames(HARMONY, HARMONY)
    reasoning = None
    if "<think>" in template or "</think>" in template:
        reasoning = "qwen3"
    tool = None
    if "<minimax:tool_call>" in template:
        tool = "minimax_m2"
    elif "<arg_key>" in template:
        tool = "glm4_moe"
    elif "<function=" in template and "<parameter=" in template:
        tool = "qwen3_coder"
    elif "<tool_call>" in template:
        tool = "qwen3"
    return ParserNames(tool, reasoning)


def resolve_parser_names(tool: str | None, reasoning: str | None, chat_template: str | None) -> ParserNames:
    """Configured names win; a missing one is inferred from the chat template. A template with no tool format we
    read gets the generic one, so that tools are never dropped (a template's own format we cannot parse would turn
    every call into content)."""
    inferred = infer_parser_names(chat_template)
    names = ParserNames(tool or inferred.tool or GENERIC, reasoning or inferred.reasoning)
    if names.tool is not None and names.tool not in TOOL_PARSER_NAMES:
        raise InvalidRequestError(f"Unknown tool_call_parser '{names.tool}'", param="tool_call_parser")
    if names.reasoning is not None and names.reasoning not in REASONING_PARSER_NAMES:
        raise InvalidRequestError(f"Unknown reasoning_parser '{names.reasoning}'", param="reasoning_parser")
    return names


@dataclass
class ParseOptions:
    """What one request asks of its output parser."""

    tools: list[dict[str, Any]] | None = None  # OpenAI-style definitions; None/empty: no tool parsing
    parallel_tool_calls: bool = True
    prompt_text: str = ""  # the rendered prompt (does it open a <think> block?)
    new_id: Callable[[], str] = field(default=new_call_id)


class ChainedParser:
    """Reasoning split first; the content it lets through goes to the tool-call parser."""

    def __init__(self, reasoning: ThinkReasoningParser | None, tools: ToolCallParser | None) -> None:
        self._reasoning = reasoning
        self._tools = tools

    def feed(self, text: str) -> list[ParsedEvent]:
        events = self._reasoning.feed(text) if self._reasoning else [ContentDelta(text)]
        return self._through_tools(events)

    def finish(self, cut: bool = False) -> list[ParsedEvent]:
        events = self._through_tools(self._reasoning.finish()) if self._reasoning else []
        return events + (self._tools.finish(cut) if self._tools else [])

    def _through_tools(self, events: list[ParsedEvent]) -> list[ParsedEvent]:
        if self._tools is None:
            return events
        out: list[ParsedEvent] = []
        for event in events:
            out += self._tools.feed(event.text) if isinstance(event, ContentDelta) else [event]
        return out


def build_output_parser(names: ParserNames, options: ParseOptions) -> OutputParser | None:
    """The request's parser, or None when its output is plain text."""
    tools_enabled = bool(options.tools)
    max_calls = None if options.parallel_tool_calls else 1
    if names.is_harmony:
        return HarmonyParser(tools_enabled, max_calls, options.new_id)
    reasoning = None
    if names.reasoning is not None:
        reasoning = ThinkReasoningParser(starts_in_reasoning=prompt_opens_reasoning(options.prompt_text))
    tools = None
    if names.tool is not None and tools_enabled:
        tools = ToolCallParser(TOOL_FORMATS[names.tool], param_types(options.tools), max_calls, options.new_id)
    if reasoning is None and tools is None:
        return None
    return ChainedParser(reasoning, tools)
