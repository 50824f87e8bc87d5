"""OpenAI request bodies -> neutral GenerateJobs (prompt + SamplingParams)."""

from __future__ import annotations

import json
from typing import Any

from engine.errors import InvalidRequestError
from engine.sampling.guided import GuidedDecoding
from engine.sampling.params import SamplingParams, make_logit_bias
from deployments.api.openai_schemas import (
    AssistantMessage,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    ImagePart,
    VideoFramesPart,
    VideoUrlPart,
    NamedToolChoice,
    SystemMessage,
    TextPart,
    ToolMessage,
    _SamplingFields,
)
from deployments.api.images import MessageContent, image_from_url, video_from_frames, video_from_url
from deployments.model_calls import ChatPrompt, GenerateJob, ImageInput, TextPrompt, ToolChoiceMode, VideoInput


def chat_job(body: ChatCompletionRequest, request_id: str, log_id: str) -> GenerateJob:
    _refuse_common_unsupported(body)
    if body.max_tokens is not None and body.max_completion_tokens is not None and (
        body.max_tokens != body.max_completion_tokens
    ):
        raise InvalidRequestError(
            "Give 'max_completion_tokens' or 'max_tokens', not two different values", param="max_completion_tokens"
        )
    max_tokens = body.max_completion_tokens or body.max_tokens
    top_logprobs = body.top_logprobs or 0
    if top_logprobs and not body.logprobs:
        raise InvalidRequestError("'top_logprobs' needs 'logprobs' set to true", param="top_logprobs")
    sampling = _sampling(body, max_tokens, logprobs=body.logprobs, top_logprobs=top_logprobs)
    tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
    mode, tool_name = tool_choice(body.tool_choice, tools)
    images: list[ImageInput] = []
    videos: list[VideoInput] = []
    prompt = ChatPrompt(
        messages=[
            _template_message(m, f"messages.{index}.content", images, videos) for index, m in enumerate(body.messages)
        ],
        tools=tools,
        template_kwargs=dict(body.chat_template_kwargs or {}),
        tool_choice=mode,
        tool_name=tool_name,
        parallel_tool_calls=body.parallel_tool_calls is not False,
        images=images,
        videos=videos,
    )
    return GenerateJob(request_id, prompt, sampling, stream=body.stream, log_id=log_id,
                       speculative=body.speculative is not False)


def tool_choice(
    choice: str | NamedToolChoice | None, tools: list[dict[str, Any]] | None, param: str = "tool_choice"
) -> tuple[ToolChoiceMode, str | None]:
    """OpenAI's tool_choice as (mode, function name); a choice that needs tools must have them."""
    if choice is None or choice in ("auto", "none"):
        return ("auto" if choice is None else choice), None  # type: ignore[return-value]
    if not tools:
        raise InvalidRequestError(f"'{param}' requires 'tools' to be given", param=param)
    if choice == "required":
        return "required", None
    assert isinstance(choice, NamedToolChoice)
    names = [t["function"]["name"] for t in tools]
    if choice.function.name not in names:
        raise InvalidRequestError(
            f"'{param}' names the function '{choice.function.name}', which is not in 'tools'", param=param
        )
    return "function", choice.function.name


def completion_job(body: CompletionRequest, request_id: str, log_id: str) -> GenerateJob:
    _refuse_common_unsupported(body)
    if body.echo:
        raise InvalidRequestError("'echo' is not supported", param="echo")
    if body.suffix:
        raise InvalidRequestError("'suffix' is not supported", param="suffix")
    if body.best_of not in (None, 1):
        raise InvalidRequestError("Only best_of=1 is supported", param="best_of")
    want_logprobs = body.logprobs is not None
    sampling = _sampling(body, body.max_tokens, logprobs=want_logprobs, top_logprobs=body.logprobs or 0)
    return GenerateJob(request_id, _text_prompt(body.prompt), sampling, stream=body.stream, log_id=log_id,
                       speculative=body.speculative is not False)


def _sampling(body: _SamplingFields, max_tokens: int | None, *, logprobs: bool, top_logprobs: int) -> SamplingParams:
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=body.top_k or 0,
        min_p=body.min_p or 0.0,
        repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        logit_bias=make_logit_bias(body.logit_bias),
        seed=body.seed,
        stop=stop,
        stop_token_ids=tuple(body.stop_token_ids or ()),
        ignore_eos=body.ignore_eos,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        guided=_guided(body),
    )


def _guided(body: _SamplingFields) -> GuidedDecoding | None:
    """response_format (OpenAI) or one of vLLM's guided_* extras -> what the output must match."""
    asked = []
    fmt = body.response_format
    if fmt is not None and fmt.type == "json_object":
        asked.append(GuidedDecoding("json_object", "", param="response_format"))
    elif fmt is not None and fmt.type == "json_schema":
        schema = fmt.json_schema.schema_
        if schema is None:  # a named format without a schema: any JSON object
            asked.append(GuidedDecoding("json_object", "", param="response_format"))
        else:
            asked.append(GuidedDecoding("json_schema", json.dumps(schema), param="response_format"))
    if body.guided_json is not None:
        text = body.guided_json if isinstance(body.guided_json, str) else json.dumps(body.guided_json)
        asked.append(GuidedDecoding("json_schema", text, param="guided_json"))
    if body.guided_regex is not None:
        asked.append(GuidedDecoding("regex", body.guided_regex, param="guided_regex"))
    if body.guided_choice is not None:
        asked.append(GuidedDecoding("choice", json.dumps(body.guided_choice), param="guided_choice"))
    if len(asked) > 1:
        raise InvalidRequestError(
            "Give one output constraint: " + ", ".join(f"'{g.param}'" for g in asked) + " were all set",
            param=asked[1].param,
        )
    return asked[0] if asked else None


def _refuse_common_unsupported(body: _SamplingFields) -> None:
    if body.n not in (None, 1):
        raise InvalidRequestError("Only n=1 is supported", param="n")
    if body.stream_options is not None and not body.stream:
        raise InvalidRequestError("'stream_options' is only allowed when 'stream' is true", param="stream_options")


def _template_message(
    message: ChatMessage, param: str, images: list[ImageInput], videos: list[VideoInput]
) -> dict[str, Any]:
    """A message as chat templates expect it: text content (content parts with images in place, which join
    `images`), tool-call arguments as objects."""
    role = "system" if isinstance(message, SystemMessage) else message.role  # templates rarely know 'developer'
    rendered: dict[str, Any] = {"role": role, "content": _content(message.content, param, images, videos)}
    if isinstance(message, AssistantMessage) and message.reasoning_content:
        rendered["reasoning_content"] = message.reasoning_content  # templates that show past reasoning
    if isinstance(message, AssistantMessage) and message.tool_calls:
        rendered["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": template_arguments(c.function.arguments)}}
            for c in message.tool_calls
        ]
    if isinstance(message, ToolMessage):
        rendered["tool_call_id"] = message.tool_call_id
    if getattr(message, "name", None):
        rendered["name"] = message.name
    return rendered


def _content(
    content: Any, param: str, images: list[ImageInput], videos: list[VideoInput]
) -> str | list[dict[str, Any]]:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    built = MessageContent("\n")
    for position, part in enumerate(content):
        if isinstance(part, TextPart):
            built.add_text(part.text)
        elif isinstance(part, ImagePart):
            built.add_image(image_from_url(part.image_url.url, f"{param}.{position}", part.image_url.detail))
        elif isinstance(part, VideoUrlPart):
            built.add_video(video_from_url(part.video_url.url, f"{param}.{position}"))
        elif isinstance(part, VideoFramesPart):
            built.add_video(video_from_frames(part.video, f"{param}.{position}"))
        else:
            raise InvalidRequestError(
                f"{param}.{position}: content parts of type '{part.type}' are not supported (images are, as "
                "'image_url' parts, videos as 'video_url' or 'video' parts)", param=f"{param}.{position}")
    return built.render(images, videos=videos)


def template_arguments(arguments: str) -> Any:
    """A call's arguments as chat templates expect them: an object, or the text as given if it is not JSON."""
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments  # templates print it as given


def _text_prompt(prompt: str | list[str] | list[int] | list[list[int]]) -> TextPrompt:
    if isinstance(prompt, str):
        return TextPrompt(text=prompt)
    if prompt and all(isinstance(p, int) for p in prompt):
        return TextPrompt(token_ids=list(prompt))  # type: ignore[arg-type]
    if len(prompt) == 1:  # a batch of one
        only = prompt[0]
        return TextPrompt(text=only) if isinstance(only, str) else TextPrompt(token_ids=list(only))
    raise InvalidRequestError("Only one prompt per request is supported", param="prompt")
