"""Responses API request bodies -> the neutral GenerateJob chat completions use (ChatPrompt + SamplingParams).

The item list becomes chat-template messages: `instructions` and leading system / developer messages are one
system message, consecutive assistant-side items (reasoning, assistant text, function calls) one assistant turn
with `reasoning_content` and `tool_calls`, each function_call_output a `tool` message. `input_image` parts of user
messages and function call outputs become `{"type": "image"}` parts in place (api/images.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from deployments.api.responses_schemas import (
    AllowedToolsChoice,
    ContentPart,
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionChoice,
    FunctionTool,
    InputImagePart,
    InputItem,
    InputTextPart,
    MediaPart,
    MessageItem,
    NamespaceTool,
    OutputTextPart,
    ReasoningItem,
    RefusalPart,
    ResponsesRequest,
    TextFormatJsonObject,
    TextFormatJsonSchema,
    UnknownItem,
    UnknownPart,
    UnsupportedItem,
)
from deployments.api.images import MessageContent, image_from_url
from deployments.api.mcp_schemas import McpCallItem, McpTool, McpToolChoice
from deployments.api.openai_convert import template_arguments
from deployments.api.unknown_fields import accept_unknown_type
from deployments.model_calls import ChatPrompt, GenerateJob, ImageInput, ToolChoiceMode
from engine.errors import InvalidRequestError
from engine.sampling.guided import GuidedDecoding
from engine.sampling.params import SamplingParams

# Accepted and not offered to the model, since Codex sends them by default and a model without them still works:
# web search (web_search = "cached"), and for model names it knows (gpt-5.x) its freeform `custom` apply_patch
# tool (a Lark grammar; exec_command still edits files) and client-run `tool_search`. Every other built-in tool
# is refused.
IGNORED_TOOL_TYPES = {"web_search", "web_search_2025_08_26", "web_search_preview", "web_search_preview_2025_03_11",
                      "custom", "tool_search"}
LOGPROBS_INCLUDE = "message.output_text.logprobs"
_EFFORT_FOR_TEMPLATES = {"none": "low", "minimal": "low", "xhigh": "high", "max": "high"}  # gpt-oss knows 3 levels


@dataclass
class ResponsesJob:
    job: GenerateJob
    items: list[InputItem]  # this request's own input, which the store keeps for a later previous_response_id
    tools: list[dict[str, Any]]  # the function tools, as Responses echoes them
    namespaces: dict[str, str]  # function name -> its namespace, for functions given in a namespace tool


def responses_job(body: ResponsesRequest, history: list[InputItem], request_id: str, log_id: str) -> ResponsesJob:
    """`history`: the items of the previous_response_id chain (inputs and outputs), before this request's."""
    if body.background:
        raise InvalidRequestError("'background': background responses are not supported: stream instead",
                                  param="background")
    own = [MessageItem(role="user", content=body.input)] if isinstance(body.input, str) else list(body.input)
    _refuse_unrenderable(own)
    functions, namespaces = _offered_tools(body)
    mode, name, offered = _tool_choice(body, functions)
    images: list[ImageInput] = []
    messages = template_messages(body.instructions, history + own, images, first_own=len(history))
    if not any(m["role"] != "system" for m in messages):
        raise InvalidRequestError("'input' holds no message to answer", param="input")
    template_kwargs: dict[str, Any] = {}
    effort = body.reasoning.effort if body.reasoning is not None else None
    if effort is not None:
        template_kwargs["enable_thinking"] = effort not in ("none", "minimal")
        template_kwargs["reasoning_effort"] = _EFFORT_FOR_TEMPLATES.get(effort, effort)
    chat_tools = [{"type": "function", "function": _function(t)} for t in offered]
    prompt = ChatPrompt(
        messages=messages,
        tools=chat_tools or None,
        template_kwargs=template_kwargs,
        tool_choice=mode,
        tool_name=name,
        parallel_tool_calls=body.parallel_tool_calls is not False,
        images=images,
    )
    job = GenerateJob(request_id, prompt, _sampling(body), stream=body.stream, log_id=log_id,
                      speculative=body.speculative is not False)
    return ResponsesJob(job, own, _echo_tools(body, functions), namespaces)


def _sampling(body: ResponsesRequest) -> SamplingParams:
    logprobs = LOGPROBS_INCLUDE in (body.include or ())
    return SamplingParams(
        max_tokens=body.max_output_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        logprobs=logprobs,
        top_logprobs=(body.top_logprobs or 0) if logprobs else 0,
        guided=_guided(body),
    )


def _guided(body: ResponsesRequest) -> GuidedDecoding | None:
    fmt = body.text.format if body.text is not None else None
    if isinstance(fmt, TextFormatJsonObject):
        return GuidedDecoding("json_object", "", param="text.format")
    if isinstance(fmt, TextFormatJsonSchema):
        return GuidedDecoding("json_schema", json.dumps(fmt.schema_), param="text.format")
    return None


# ---- tools ---------------------------------------------------------------------------------------
def _offered_tools(body: ResponsesRequest) -> tuple[list[FunctionTool], dict[str, str]]:
    """The function tools, those of namespaces too, and each namespaced function's namespace (one name space for
    all: the model calls a function by its name alone)."""
    offered: list[FunctionTool] = []
    namespaces: dict[str, str] = {}
    for index, tool in enumerate(body.tools or ()):
        if isinstance(tool, NamespaceTool):
            grouped = _functions(tool.tools, f"tools[{index}].tools")
            namespaces.update((function.name, tool.name) for function in grouped)
            offered += grouped
        elif isinstance(tool, McpTool):
            continue  # the tool loop's (api/mcp_requests.py): listed and offered by the ingress
        else:
            offered += _functions([tool], "tools", first_index=index)
    names = [function.name for function in offered]
    if duplicate := next((name for name in names if names.count(name) > 1), None):
        raise InvalidRequestError(f"'tools' holds two functions named '{duplicate}'", param="tools")
    return offered, namespaces


def _functions(tools: list[Any], where: str, first_index: int = 0) -> list[FunctionTool]:
    functions = []
    for index, tool in enumerate(tools, first_index):
        if isinstance(tool, FunctionTool):
            functions.append(tool)
        elif tool.type in IGNORED_TOOL_TYPES:
            accept_unknown_type("responses", "tool", tool.type)  # logged once, counted: not offered
        else:
            raise InvalidRequestError(
                f"'{where}[{index}]': built-in tools of type '{tool.type}' are not supported (Orchard runs no tools "
                "itself): give it as a function tool", param=f"{where}[{index}].type")
    return functions


def _tool_choice(
    body: ResponsesRequest, offered: list[FunctionTool]
) -> tuple[ToolChoiceMode, str | None, list[FunctionTool]]:
    """(mode, function name, the tools to offer): allowed_tools narrows the tools."""
    choice = body.tool_choice
    if choice is None or choice in ("auto", "none"):
        return ("auto" if choice is None else choice), None, offered  # type: ignore[return-value]
    names = [t.name for t in offered]
    mcp = any(isinstance(tool, McpTool) for tool in body.tools or ())  # their tools: checked once listed
    if isinstance(choice, McpToolChoice):
        if not any(isinstance(t, McpTool) and t.server_label == choice.server_label for t in body.tools or ()):
            raise InvalidRequestError(f"'tool_choice' names the MCP server '{choice.server_label}', which is not "
                                      "in 'tools'", param="tool_choice.server_label")
        return ("function", choice.name, offered) if choice.name else ("required", None, offered)
    if mcp and (choice == "required" or isinstance(choice, FunctionChoice)):
        return ("required", None, offered) if choice == "required" else ("function", choice.name, offered)
    if not offered:
        raise InvalidRequestError("'tool_choice' requires function tools in 'tools'", param="tool_choice")
    if choice == "required":
        return "required", None, offered
    if isinstance(choice, FunctionChoice):
        if choice.name not in names:
            raise InvalidRequestError(
                f"'tool_choice' names the function '{choice.name}', which is not in 'tools'", param="tool_choice")
        return "function", choice.name, offered
    if isinstance(choice, AllowedToolsChoice):
        allowed = {ref.name for ref in choice.tools if ref.type == "function"}
        if unknown := sorted(allowed - set(names)):
            raise InvalidRequestError(f"'tool_choice.tools' names functions not in 'tools': {', '.join(unknown)}",
                                      param="tool_choice.tools")
        if not allowed:
            raise InvalidRequestError("'tool_choice.tools' allows no function tool", param="tool_choice.tools")
        return choice.mode, None, [t for t in offered if t.name in allowed]
    raise InvalidRequestError(f"'tool_choice' of type '{choice.type}' names a built-in tool, which is not supported",
                              param="tool_choice")


def _function(tool: FunctionTool) -> dict[str, Any]:
    parameters = tool.parameters or {"type": "object", "properties": {}}
    function: dict[str, Any] = {"name": tool.name, "parameters": parameters}
    if tool.description is not None:
        function["description"] = tool.description
    return function


def _echo_tool(tool: FunctionTool) -> dict[str, Any]:
    return {"type": "function", "name": tool.name, "description": tool.description, "parameters": tool.parameters,
            "strict": tool.strict}


def _echo_tools(body: ResponsesRequest, functions: list[FunctionTool]) -> list[dict[str, Any]]:
    """Function tools and namespaces of them, as given (built-in tools not offered are not echoed)."""
    offered = {id(function) for function in functions}
    echoed = []
    for tool in body.tools or ():
        if isinstance(tool, NamespaceTool):
            grouped = [_echo_tool(t) for t in tool.tools if id(t) in offered]
            echoed.append({"type": "namespace", "name": tool.name, "description": tool.description, "tools": grouped})
        elif id(tool) in offered:
            echoed.append(_echo_tool(tool))
        elif isinstance(tool, McpTool):
            echoed.append(tool.model_dump(exclude_none=True, exclude={"headers", "authorization"}))  # no secrets
    return echoed


# ---- items -> template messages ---------------------------------------------------------------------
def _refuse_unrenderable(items: list[InputItem]) -> None:
    """Refuse what a text model here cannot see (named by its place in this request's input); ignore new types."""
    for index, item in enumerate(items):
        if isinstance(item, UnsupportedItem):
            raise InvalidRequestError(
                f"'input[{index}]': items of type '{item.type}' (a built-in tool's or another server's) are not "
                "supported", param=f"input[{index}].type")
        if isinstance(item, UnknownItem):
            accept_unknown_type("responses", "input item", item.type)
        parts = item.content if isinstance(item, MessageItem) else (
            item.output if isinstance(item, FunctionCallOutputItem) else None)
        where = "content" if isinstance(item, MessageItem) else "output"
        images_allowed = not isinstance(item, MessageItem) or item.role == "user"
        for number, part in enumerate(parts if isinstance(parts, list) else ()):
            param = f"input[{index}].{where}[{number}]"
            if isinstance(part, MediaPart):
                raise InvalidRequestError(
                    f"'{param}': '{part.type}' content is not supported (images are, as 'input_image')", param=param)
            if isinstance(part, InputImagePart) and not images_allowed:
                raise InvalidRequestError(
                    f"'{param}': 'input_image' content is read in user messages and function call outputs, not in "
                    f"'{item.role}' messages", param=param)
            if isinstance(part, UnknownPart):
                accept_unknown_type("responses", "content part", part.type)


@dataclass
class _AssistantTurn:
    texts: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    tool_calls: list[dict[str, Any]] = field(default_factory=list)

    def message(self) -> dict[str, Any]:
        rendered: dict[str, Any] = {"role": "assistant", "content": "\n".join(self.texts)}
        if self.reasoning:
            rendered["reasoning_content"] = "\n".join(self.reasoning)  # templates that show past reasoning
        if self.tool_calls:
            rendered["tool_calls"] = self.tool_calls
        return rendered


def template_messages(
    instructions: str | None, items: list[InputItem], images: list[ImageInput], first_own: int = 0
) -> list[dict[str, Any]]:
    """`images` receives the images of user messages and function call outputs in placeholder order; items
    before `first_own` come from previous_response_id (their images' errors name it)."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": instructions}] if instructions else []
    turn: _AssistantTurn | None = None
    names: dict[str, str] = {}  # call_id -> function name, for templates that name tool results
    for index, item in enumerate(items):
        if isinstance(item, McpCallItem):  # a call the tool loop ran: the turn's call, then its result
            turn = turn or _AssistantTurn()
            turn.tool_calls.append({"id": item.id, "type": "function",
                                    "function": {"name": item.name, "arguments": template_arguments(item.arguments)}})
            output = item.output if item.error is None else f"Error: {item.error_text()}"
            messages += [turn.message(), {"role": "tool", "tool_call_id": item.id, "name": item.name,
                                          "content": output or ""}]
            turn = None
            continue
        if isinstance(item, (ReasoningItem, FunctionCallItem)) or (
                isinstance(item, MessageItem) and item.role == "assistant"):
            # Text or reasoning after a call starts a new turn: a template writes a turn's calls last.
            if turn is not None and turn.tool_calls and not isinstance(item, FunctionCallItem):
                messages.append(turn.message())
                turn = None
            turn = turn or _AssistantTurn()
            _add_to_turn(turn, item, names)
            continue
        if turn is not None:
            messages.append(turn.message())
            turn = None
        where = f"input[{index - first_own}]" if index >= first_own else None
        if isinstance(item, MessageItem) and item.role == "user":
            messages.append({"role": "user", "content": _content(item.content, where and f"{where}.content", images)})
        elif isinstance(item, MessageItem):
            messages.append({"role": "system", "content": _text(item.content)})  # templates rarely know 'developer'
        elif isinstance(item, FunctionCallOutputItem):
            result = {"role": "tool", "tool_call_id": item.call_id,
                      "content": _content(item.output, where and f"{where}.output", images)}
            if item.call_id in names:
                result["name"] = names[item.call_id]
            messages.append(result)
    if turn is not None:
        messages.append(turn.message())
    return _one_leading_system_message(messages)


def _add_to_turn(turn: _AssistantTurn, item: InputItem, names: dict[str, str]) -> None:
    if isinstance(item, ReasoningItem):
        parts = item.content or item.summary  # the reasoning itself, else its summary
        text = "\n".join(p.text for p in parts)
        if text:
            turn.reasoning.append(text)
    elif isinstance(item, FunctionCallItem):
        names[item.call_id] = item.name
        turn.tool_calls.append({"id": item.call_id, "type": "function",
                                "function": {"name": item.name, "arguments": template_arguments(item.arguments)}})
    elif isinstance(item, MessageItem):
        turn.texts.append(_text(item.content))


def _one_leading_system_message(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Instructions and the developer messages after them as one system message: many templates take only
    messages[0] as the system prompt (Codex sends instructions, then developer messages)."""
    count = next((i for i, m in enumerate(messages) if m["role"] != "system"), len(messages))
    if count < 2:
        return messages
    joined = "\n\n".join(m["content"] for m in messages[:count])
    return [{"role": "system", "content": joined}, *messages[count:]]


def _text(content: str | list[ContentPart]) -> str:
    if isinstance(content, str):
        return content
    texts = []
    for part in content:
        if isinstance(part, (InputTextPart, OutputTextPart)):
            texts.append(part.text)
        elif isinstance(part, RefusalPart):
            texts.append(part.refusal)
    return "\n".join(texts)


def _content(
    content: str | list[ContentPart], where: str | None, images: list[ImageInput]
) -> str | list[dict[str, Any]]:
    """Text, with input_image parts in place; `where` is the content's param (None: from previous_response_id)."""
    if isinstance(content, str):
        return content
    built = MessageContent("\n")
    for number, part in enumerate(content):
        if isinstance(part, (InputTextPart, OutputTextPart)):
            built.add_text(part.text)
        elif isinstance(part, RefusalPart):
            built.add_text(part.refusal)
        elif isinstance(part, InputImagePart):
            built.add_image(_image(part, f"{where}[{number}]" if where else "previous_response_id"))
    return built.render(images)


def _image(part: InputImagePart, param: str) -> ImageInput:
    if part.image_url is not None:
        return image_from_url(part.image_url, param, part.detail)
    if part.file_id is not None:
        raise InvalidRequestError(
            f"'{param}': images given by 'file_id' need a Files API, which this server does not have: give "
            "'image_url' (a data URL, or an http(s) URL)", param=param)
    raise InvalidRequestError(f"'{param}': 'input_image' needs 'image_url'", param=param)
