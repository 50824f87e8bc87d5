"""Prompts to token ids with the model's tokenizer; token ids to text for logprobs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

from deployments.chat import generic_tools
from deployments.chat.prompt_bound import message_texts, prompt_limit
from deployments.chat.vision_prompts import VisionPromptEncoder
from engine.errors import InvalidRequestError
from engine.vision.inputs import VisionInputs
from engine.output.request_output import TokenLogprob
from deployments.model_calls import ChatPrompt, TextPrompt, TokenLogprobInfo, TopTokenLogprob

# apply_chat_template's own parameters: a request's chat_template_kwargs may set the template's variables
# (enable_thinking, reasoning_effort, ...), never these. "chat_template" would swap the model's template for the
# client's own: sandboxed Jinja, so no code runs, but its loops can hold a tokenize thread without bound.
TEMPLATE_CALL_PARAMETERS = frozenset({
    "chat_template", "tools", "documents", "add_generation_prompt", "continue_final_message", "tokenize", "padding",
    "truncation", "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
    "conversation", "messages",
})


@dataclass
class EncodedPrompt:
    token_ids: list[int]
    text: str  # the rendered chat prompt ("" for token-id prompts): output parsers read its end
    vision: VisionInputs | None = None  # a prompt with images (a multimodal model)
    cache_keys: tuple[int, ...] | None = None  # the prefix cache's keys, where images make them differ from the ids
    images_repeated: bool = False  # its images were processed for an earlier request (their pixels may stay here)


class PromptEncoder:
    def __init__(
        self, tokenizer: Any, tools_in_system_prompt: bool = False, tools_token_budget: int | None = None,
        vision: VisionPromptEncoder | None = None, context_length: int | None = None,
    ) -> None:
        self._tokenizer = tokenizer
        # With a context length: a prompt that certainly exceeds it is refused from its length, before the template
        # and the tokenizer run (prompt_bound.py); None where this tokenizer gives no bound (the exact check stays).
        self._limit = prompt_limit(tokenizer, context_length) if context_length is not None else None
        self._vision = vision  # a multimodal model's images; None: the model takes text only
        # The generic tool format (chat/generic_tools.py): the template is never given tools or tool turns.
        self._tools_in_system_prompt = tools_in_system_prompt
        # Tools described in full would take more tokens than this: they are described compactly (Claude Code's
        # take 8,500 tokens in full, more than a small model's whole context).
        self._tools_token_budget = tools_token_budget

    def token_ids(self, prompt: ChatPrompt | TextPrompt) -> list[int]:
        return self.encode(prompt).token_ids

    def encode(self, prompt: ChatPrompt | TextPrompt) -> EncodedPrompt:
        if isinstance(prompt, ChatPrompt):
            self._check_length(message_texts(prompt.messages), "messages")
            if prompt.images or prompt.videos:
                return self._with_images(prompt)
            text = self._chat_text(prompt)
            # The rendered text (tools, tool calls, past reasoning): the tokenizer then takes a bounded text.
            self._check_length([text], "messages")
            # The template already holds any BOS/special tokens the model expects.
            return EncodedPrompt(list(self._tokenizer.encode(text, add_special_tokens=False)), text)
        if prompt.token_ids is not None:
            return EncodedPrompt(list(prompt.token_ids), "")
        self._check_length([prompt.text or ""], "prompt")
        return EncodedPrompt(list(self._tokenizer.encode(prompt.text or "")), prompt.text or "")

    def _check_length(self, texts: Iterable[str], param: str) -> None:
        if self._limit is not None:
            self._limit.check(texts, param)

    def _with_images(self, prompt: ChatPrompt) -> EncodedPrompt:
        if self._vision is None:
            raise InvalidRequestError(
                "This model takes text only: images and video need a vision-language model (model_type: multimodal)",
                param=(prompt.images or prompt.videos)[0].param,
            )
        text = self._chat_text(prompt)
        self._check_length([text], "messages")
        encoded = self._vision.encode(text, prompt.images, prompt.videos)
        return EncodedPrompt(encoded.token_ids, text, encoded.vision, encoded.cache_keys, encoded.images_repeated)

    def _chat_text(self, prompt: ChatPrompt) -> str:
        if not getattr(self._tokenizer, "chat_template", None):
            raise InvalidRequestError(
                "This model has no chat template: use /v1/completions, or load it with chat_template_file",
                param="messages",
            )
        # tool_choice "none": the model is not shown the tools, so it has nothing to call.
        tools = prompt.tools if prompt.tools and prompt.tool_choice != "none" else None
        if self._tools_in_system_prompt:
            return self._generic_tools_text(prompt, tools)
        return self._render(prompt.messages, tools, prompt.template_kwargs)

    def _generic_tools_text(self, prompt: ChatPrompt, tools: list[dict[str, Any]] | None) -> str:
        messages = generic_tools.history_as_text(prompt.messages)
        if not tools:
            return self._render(messages, None, prompt.template_kwargs)
        block = generic_tools.tools_block(tools, prompt.tool_choice, prompt.tool_name)
        if self._tools_token_budget is not None and self._over_budget(block, self._tools_token_budget):
            block = generic_tools.tools_block(tools, prompt.tool_choice, prompt.tool_name, compact=True)
        try:
            return self._render(generic_tools.with_system_block(messages, block), None, prompt.template_kwargs)
        except InvalidRequestError:
            if messages and messages[0].get("role") == "system":
                raise  # the client's own system turn fails too
            # Some templates refuse a system turn (Gemma's): the tools then open the first user turn.
            return self._render(generic_tools.with_user_block(messages, block), None, prompt.template_kwargs)

    def _over_budget(self, block: str, budget: int) -> bool:
        """Whether the tools' block takes more than `budget` tokens; one certainly longer is not tokenized."""
        if self._limit is not None and self._limit.exceeds(block, budget):
            return True
        return len(self._tokenizer.encode(block)) > budget

    def _render(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, kwargs: dict[str, Any]
    ) -> str:
        for key in kwargs:
            if key in TEMPLATE_CALL_PARAMETERS:
                raise InvalidRequestError(
                    f"'chat_template_kwargs.{key}' is not a template variable but a parameter of the template call; "
                    "the model's own template and settings apply", param=f"chat_template_kwargs.{key}")
        try:
            return self._tokenizer.apply_chat_template(
                messages, tools=tools, add_generation_prompt=True, tokenize=False, **kwargs
            )
        except Exception as exc:  # jinja raises many types (TemplateError, TypeError, raise_exception's)
            raise InvalidRequestError(f"The chat template could not render these messages: {exc}", param="messages")


class TokenTexts:
    """Token id -> (text, UTF-8 bytes), cached: logprobs name every sampled and top token."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def text(self, token_id: int) -> tuple[str, list[int]]:
        cached = self._cache.get(token_id)
        if cached is None:
            text = self._tokenizer.decode([token_id])
            cached = self._cache[token_id] = (text, list(text.encode("utf-8", errors="replace")))
        return cached

    def logprob_infos(self, logprobs: list[TokenLogprob] | None) -> list[TokenLogprobInfo] | None:
        if logprobs is None:
            return None
        infos = []
        for entry in logprobs:
            token, token_bytes = self.text(entry.token_id)
            top = [TopTokenLogprob(*self.text(t.token_id), t.logprob) for t in entry.top_logprobs]
            infos.append(TokenLogprobInfo(token, token_bytes, entry.logprob, top))
        return infos
