"""Anthropic Messages bodies -> neutral ChatPrompts and GenerateJobs.

Content blocks become the OpenAI-style messages chat templates expect: tool_result blocks are
`tool` messages, tool_use blocks an assistant's `tool_calls`, thinking blocks its
`reasoning_content` (templates such as Qwen3's show it for the turns of the current tool loop).
Text documents are read as text; PDFs need a document reader (a 400 naming the block). Images (base64 or url
sources, in user turns and tool results) become `{"type": "image"}` parts in place (api/images.py).
Only custom tools are offered to the model: Anthropic's own (web_search_20250305, ...) are accepted and left out,
and a deferred one (`defer_loading`) joins once a tool result's `tool_reference` names it.
"""

from __future__ import annotations

import json
from typing import Any

from engine.errors import InvalidRequestError
from engine.sampling.guided import GuidedDecoding
from engine.sampling.params import SamplingParams
from deployments.api.anthropic_schemas import (
    DocumentBlock,
    ImageBlock,
    Message,
    MessagesRequest,
    RedactedThinkingBlock,
    TextBlock,
    ThinkingBlock,
    ToolDefinition,
    ToolReferenceBlock,
    ToolResultBlock,
    ToolUseBlock,
    _MessagesFields,
)
from deployments.api.mcp_schemas import McpToolResultBlock, McpToolUseBlock
from deployments.api.images import MessageContent, image_from_base64, image_from_url
from deployments.model_calls import ChatPrompt, GenerateJob, ImageInput, ToolChoiceMode


def messages_job(body: MessagesRequest, request_id: str, log_id: str) -> GenerateJob:
    prompt = chat_prompt(body)
    sampling = SamplingParams(
        max_tokens=body.max_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=body.top_k or 0,
        stop=tuple(body.stop_sequences or ()),
        guided=_output_format(body, forced_call=prompt.tool_choice in ("required", "function")),
    )
    return GenerateJob(request_id, prompt, sampling, stream=body.stream, log_id=log_id, clamp_max_tokens=True,
                       speculative=body.speculative is not False)


def _output_format(body: MessagesRequest, forced_call: bool) -> GuidedDecoding | None:
    """output_config.format (or the beta's top-level output_format): the text answer matches the JSON schema."""
    from_config = body.output_config.format if body.output_config is not None else None
    if from_config is not None and body.output_format is not None:
        raise InvalidRequestError("Give 'output_config.format' or 'output_format', not both", param="output_format")
    if from_config is not None:
        fmt, param = from_config, "output_config.format"
    else:
        fmt, param = body.output_format, "output_format"
    if fmt is None:
        return None
    if forced_call:  # both would constrain the same output
        raise InvalidRequestError(
            f"'{param}' cannot be combined with a tool_choice that forces a tool call", param=param
        )
    return GuidedDecoding("json_schema", json.dumps(fmt.schema_), param=param)


def chat_prompt(body: _MessagesFields) -> ChatPrompt:
    """The prompt of a Messages (or count_tokens) body: both count the same tokens."""
    tools = _offered_tools(body)
    mode, name, parallel = _tool_choice(body, tools)
    template_kwargs: dict[str, Any] = {}
    if body.thinking is not None and body.thinking.type in ("enabled", "disabled"):
        template_kwargs["enable_thinking"] = body.thinking.type == "enabled"
    template_kwargs.update(body.chat_template_kwargs or {})
    images: list[ImageInput] = []
    return ChatPrompt(
        messages=_messages(body, images),
        tools=tools,
        template_kwargs=template_kwargs,
        tool_choice=mode,
        tool_name=name,
        parallel_tool_calls=parallel,
        images=images,
    )


def _offered_tools(body: _MessagesFields) -> list[dict[str, Any]] | None:
    """The custom tools the model sees: not Anthropic's own, and a deferred one only once loaded or named."""
    loaded = _referenced_tools(body)
    if body.tool_choice is not None and body.tool_choice.name:
        loaded.add(body.tool_choice.name)
    offered = [
        _tool(t) for t in body.tools or []
        if t.custom and (not t.defer_loading or t.name in loaded)
    ]
    return offered or None


def _referenced_tools(body: _MessagesFields) -> set[str]:
    names = set()
    for message in body.messages:
        for block in message.content if isinstance(message.content, list) else ():
            if isinstance(block, ToolResultBlock) and isinstance(block.content, list):
                names.update(part.tool_name for part in block.content if isinstance(part, ToolReferenceBlock))
    return names


def _tool(tool: ToolDefinition) -> dict[str, Any]:
    function: dict[str, Any] = {"name": tool.name, "parameters": tool.input_schema}
    if tool.description is not None:
        function["description"] = tool.description
    return {"type": "function", "function": function}


def _tool_choice(body: _MessagesFields, tools: list[dict[str, Any]] | None) -> tuple[ToolChoiceMode, str | None, bool]:
    choice = body.tool_choice
    if choice is None:
        return "auto", None, True
    parallel = not choice.disable_parallel_tool_use
    if choice.type in ("auto", "none"):
        return choice.type, None, parallel
    mcp = bool(getattr(body, "mcp_servers", None))  # their tools are known once listed: the tool loop checks
    if not tools and not mcp:
        raise InvalidRequestError(f"tool_choice '{choice.type}' requires 'tools' to be given", param="tool_choice")
    if choice.type == "any":
        return "required", None, parallel
    anthropic_tool = next((t for t in body.tools or [] if not t.custom and t.name == choice.name), None)
    if anthropic_tool is not None:
        raise InvalidRequestError(
            f"tool_choice.name '{choice.name}' is Anthropic's '{anthropic_tool.type}' tool, which this server cannot "
            "run: only custom tools (with an input_schema) can be called",
            param="tool_choice.name",
        )
    names = [t["function"]["name"] for t in tools or []]
    if not choice.name or (choice.name not in names and not mcp):
        raise InvalidRequestError(
            f"tool_choice.name '{choice.name}' is not the name of a tool in 'tools'", param="tool_choice.name"
        )
    return "function", choice.name, parallel


def _messages(body: _MessagesFields, images: list[ImageInput]) -> list[dict[str, Any]]:
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
            messages += _user_messages(message, index, images)
        else:
            messages += _assistant_messages(message, index)
    if system:
        messages.insert(0, {"role": "system", "content": "\n\n".join(system)})
    return messages


def _system_text(content: Any, param: str = "system") -> str:
    if isinstance(content, str):
        return content
    if not all(isinstance(block, TextBlock) for block in content):
        raise InvalidRequestError("A system prompt may only hold text blocks", param=param)
    return "\n\n".join(block.text for block in content)


def _user_messages(message: Message, index: int, images: list[ImageInput]) -> list[dict[str, Any]]:
    """A user turn: its tool results as `tool` messages, its text and images as a user message, in order."""
    if isinstance(message.content, str):
        return [{"role": "user", "content": message.content}]
    out: list[dict[str, Any]] = []
    content = MessageContent("\n\n")
    for position, block in enumerate(message.content):
        param = f"messages.{index}.content.{position}"
        if isinstance(block, ToolResultBlock):
            if content:
                out.append({"role": "user", "content": content.render(images)})
                content = MessageContent("\n\n")
            out.append({"role": "tool", "tool_call_id": block.tool_use_id,
                        "content": _tool_result_content(block, param, images)})
        elif isinstance(block, TextBlock):
            content.add_text(block.text)
        elif isinstance(block, DocumentBlock):
            content.add_text(_document_text(block, param))
        elif isinstance(block, ImageBlock):
            content.add_image(_image(block, param))
        else:
            _refuse_block(block, param)
    if content or not out:
        out.append({"role": "user", "content": content.render(images)})
    return out


def _tool_result_content(block: ToolResultBlock, param: str, images: list[ImageInput]) -> str | list[dict[str, Any]]:
    prefix = "Error: " if block.is_error else ""
    if isinstance(block.content, str):
        return prefix + block.content
    content = MessageContent("\n\n")
    for position, part in enumerate(block.content):
        if isinstance(part, TextBlock):
            content.add_text(part.text)
        elif isinstance(part, DocumentBlock):
            content.add_text(_document_text(part, f"{param}.content.{position}"))
        elif isinstance(part, ToolReferenceBlock):
            content.add_text(f"Tool '{part.tool_name}' loaded.")
        elif isinstance(part, ImageBlock):
            content.add_image(_image(part, f"{param}.content.{position}"))
        else:
            _refuse_block(part, f"{param}.content.{position}")
    return content.render(images, prefix)


def _image(block: ImageBlock, param: str) -> ImageInput:
    """A `base64` source is decoded now; a `url` source is fetched by the ingress (where remote media is allowed)."""
    source = block.source
    kind = source.get("type")
    if kind == "base64" and isinstance(source.get("data"), str):
        media_type = source.get("media_type")
        return image_from_base64(source["data"], media_type if isinstance(media_type, str) else None, param)
    if kind == "url" and isinstance(source.get("url"), str):
        return image_from_url(source["url"], param)
    if kind == "file":
        raise InvalidRequestError(
            f"{param}: images with a 'file' source need a Files API, which this server does not have: send the "
            "image as a 'base64' or 'url' source", param=param)
    raise InvalidRequestError(
        f"{param}: an image's source is {{\"type\": \"base64\", \"media_type\", \"data\"}} or "
        f"{{\"type\": \"url\", \"url\"}}, not a '{kind}' source", param=param)


def _document_text(block: DocumentBlock, param: str) -> str:
    """A plain-text document (`text` source, or `content` holding text blocks) with its title and context."""
    source = block.source
    if source.get("type") == "text" and isinstance(source.get("data"), str):
        body = source["data"]
    elif source.get("type") == "content" and isinstance(source.get("content"), str):
        body = source["content"]
    elif source.get("type") == "content" and isinstance(source.get("content"), list) and all(
        isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
        for part in source["content"]
    ):
        body = "\n\n".join(part["text"] for part in source["content"])
    else:
        raise InvalidRequestError(
            f"Documents with a '{source.get('type')}' source (PDFs, URLs, files) need a document reader, which is not "
            "supported yet: send the text as a 'text' source",
            param=f"{param}.source",
        )
    return "\n\n".join(part for part in (block.title, block.context, body) if part)


def _assistant_messages(message: Message, index: int) -> list[dict[str, Any]]:
    """An assistant turn; an MCP tool result in it (the connector's, replayed) splits it: the calls before it, the
    result as a `tool` message, then the rest of the turn."""
    if isinstance(message.content, str):
        return [{"role": "assistant", "content": message.content}]
    out: list[dict[str, Any]] = []
    texts, reasoning, calls = [], [], []
    for position, block in enumerate(message.content):
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ThinkingBlock):
            reasoning.append(block.thinking)
        elif isinstance(block, (ToolUseBlock, McpToolUseBlock)):
            calls.append({"id": block.id, "type": "function", "function": {"name": block.name, "arguments": block.input}})
        elif isinstance(block, McpToolResultBlock):
            out.append(_assistant_turn(texts, reasoning, calls))
            texts, reasoning, calls = [], [], []
            prefix = "Error: " if block.is_error else ""
            out.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": prefix + block.text()})
        elif isinstance(block, RedactedThinkingBlock):
            continue  # encrypted by another provider: nothing a local model can read
        else:
            _refuse_block(block, f"messages.{index}.content.{position}")
    if texts or reasoning or calls or not out:
        out.append(_assistant_turn(texts, reasoning, calls))
    return out


def _assistant_turn(texts: list[str], reasoning: list[str], calls: list[dict[str, Any]]) -> dict[str, Any]:
    rendered: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if reasoning:
        rendered["reasoning_content"] = "\n\n".join(reasoning)
    if calls:
        rendered["tool_calls"] = calls
    return rendered


def _refuse_block(block: Any, param: str) -> None:
    raise InvalidRequestError(f"Content blocks of type '{block.type}' are not allowed in this turn", param=param)
