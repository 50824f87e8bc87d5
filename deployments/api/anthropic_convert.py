"""Anthropic Messages bodies -> neutral ChatPrompts and GenerateJobs.

Content blocks become the OpenAI-style messages chat templates expect: tool_result blocks are
`tool` messages, tool_use blocks an assistant's `tool_calls`, thinking blocks its
`reasoning_content` (templates such as Qwen3's show it for the turns of the current tool loop).
"""

from __future__ import annotations

from typing import Any

from engine.errors import InvalidRequestError
from engine.sampling.params import SamplingParams
from deployments.api.anthropic_schemas import (
    DocumentBlock,
    ImageBlock,
    Message,
    MessagesRequest,
    RedactedThinkingBlock,
    TextBlock,
    ThinkingBlock,
    ToolChoice,
    ToolResultBlock,
    ToolUseBlock,
    _MessagesFields,
)
from deployments.model_calls import ChatPrompt, GenerateJob, ToolChoiceMode


def messages_job(body: MessagesRequest, request_id: str, log_id: str) -> GenerateJob:
    sampling = SamplingParams(
        max_tokens=body.max_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=body.top_k or 0,
        stop=tuple(body.stop_sequences or ()),
    )
    prompt = chat_prompt(body)
    return GenerateJob(request_id, prompt, sampling, stream=body.stream, log_id=log_id, clamp_max_tokens=True)


def chat_prompt(body: _MessagesFields) -> ChatPrompt:
    """The prompt of a Messages (or count_tokens) body: both count the same tokens."""
    tools = [_tool(t) for t in body.tools] if body.tools else None
    mode, name, parallel = _tool_choice(body.tool_choice, tools)
    template_kwargs: dict[str, Any] = {}
    if body.thinking is not None and body.thinking.type in ("enabled", "disabled"):
        template_kwargs["enable_thinking"] = body.thinking.type == "enabled"
    template_kwargs.update(body.chat_template_kwargs or {})
    return ChatPrompt(
        messages=_messages(body),
        tools=tools,
        template_kwargs=template_kwargs,
        tool_choice=mode,
        tool_name=name,
        parallel_tool_calls=parallel,
    )


def _tool(tool: Any) -> dict[str, Any]:
    function = {"name": tool.name, "parameters": tool.input_schema}
    if tool.description is not None:
        function["description"] = tool.description
    return {"type": "function", "function": function}


def _tool_choice(
    choice: ToolChoice | None, tools: list[dict[str, Any]] | None
) -> tuple[ToolChoiceMode, str | None, bool]:
    if choice is None:
        return "auto", None, True
    parallel = not choice.disable_parallel_tool_use
    if choice.type in ("auto", "none"):
        return choice.type, None, parallel
    if not tools:
        raise InvalidRequestError(f"tool_choice '{choice.type}' requires 'tools' to be given", param="tool_choice")
    if choice.type == "any":
        return "required", None, parallel
    names = [t["function"]["name"] for t in tools]
    if not choice.name or choice.name not in names:
        raise InvalidRequestError(
            f"tool_choice.name '{choice.name}' is not the name of a tool in 'tools'", param="tool_choice.name"
        )
    return "function", choice.name, parallel


def _messages(body: _MessagesFields) -> list[dict[str, Any]]:
    system = [] if body.system is None else [_system_text(body.system)]
    messages: list[dict[str, Any]] = []
    for index, message in enumerate(body.messages):
        if message.role == "system":
            text = _system_text(message.content, f"messages.{index}.content")
            if messages:  # a system turn later in the conversation stays where it is
                messages.append({"role": "system", "content": text})
            else:
                system.append(text)
        elif message.role == "user":
            messages += _user_messages(message, index)
        else:
            messages.append(_assistant_message(message, index))
    if system:
        messages.insert(0, {"role": "system", "content": "\n\n".join(system)})
    return messages


def _system_text(content: Any, param: str = "system") -> str:
    if isinstance(content, str):
        return content
    if not all(isinstance(block, TextBlock) for block in content):
        raise InvalidRequestError("A system prompt may only hold text blocks", param=param)
    return "\n\n".join(block.text for block in content)


def _user_messages(message: Message, index: int) -> list[dict[str, Any]]:
    """A user turn: its tool results as `tool` messages, its text as a user message, in order."""
    if isinstance(message.content, str):
        return [{"role": "user", "content": message.content}]
    out: list[dict[str, Any]] = []
    texts: list[str] = []
    for block in message.content:
        if isinstance(block, ToolResultBlock):
            if texts:
                out.append({"role": "user", "content": "\n\n".join(texts)})
                texts = []
            out.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": _tool_result_text(block, index)})
        elif isinstance(block, TextBlock):
            texts.append(block.text)
        else:
            _refuse_block(block, index)
    if texts or not out:
        out.append({"role": "user", "content": "\n\n".join(texts)})
    return out


def _tool_result_text(block: ToolResultBlock, index: int) -> str:
    if isinstance(block.content, str):
        text = block.content
    else:
        for part in block.content:
            if not isinstance(part, TextBlock):
                _refuse_block(part, index)
        text = "\n\n".join(part.text for part in block.content if isinstance(part, TextBlock))
    return f"Error: {text}" if block.is_error else text


def _assistant_message(message: Message, index: int) -> dict[str, Any]:
    if isinstance(message.content, str):
        return {"role": "assistant", "content": message.content}
    texts, reasoning, calls = [], [], []
    for block in message.content:
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ThinkingBlock):
            reasoning.append(block.thinking)
        elif isinstance(block, ToolUseBlock):
            calls.append({"id": block.id, "type": "function", "function": {"name": block.name, "arguments": block.input}})
        elif isinstance(block, RedactedThinkingBlock):
            continue  # encrypted by another provider: nothing a local model can read
        else:
            _refuse_block(block, index)
    rendered: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if reasoning:
        rendered["reasoning_content"] = "\n\n".join(reasoning)
    if calls:
        rendered["tool_calls"] = calls
    return rendered


def _refuse_block(block: Any, index: int) -> None:
    if isinstance(block, (ImageBlock, DocumentBlock)):
        raise InvalidRequestError(
            f"Content blocks of type '{block.type}' need a multimodal model, which is not supported yet",
            param=f"messages.{index}.content",
        )
    raise InvalidRequestError(
        f"Content blocks of type '{block.type}' are not allowed in this turn", param=f"messages.{index}.content"
    )
