"""Prompts to token ids with the model's tokenizer; token ids to text for logprobs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.errors import InvalidRequestError
from engine.output.request_output import TokenLogprob
from deployments.model_calls import ChatPrompt, TextPrompt, TokenLogprobInfo, TopTokenLogprob


@dataclass
class EncodedPrompt:
    token_ids: list[int]
    text: str  # the rendered chat prompt ("" for token-id prompts): output parsers read its end


class PromptEncoder:
    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer

    def token_ids(self, prompt: ChatPrompt | TextPrompt) -> list[int]:
        return self.encode(prompt).token_ids

    def encode(self, prompt: ChatPrompt | TextPrompt) -> EncodedPrompt:
        if isinstance(prompt, ChatPrompt):
            text = self._chat_text(prompt)
            # The template already holds any BOS/special tokens the model expects.
            return EncodedPrompt(list(self._tokenizer.encode(text, add_special_tokens=False)), text)
        if prompt.token_ids is not None:
            return EncodedPrompt(list(prompt.token_ids), "")
        return EncodedPrompt(list(self._tokenizer.encode(prompt.text or "")), prompt.text or "")

    def _chat_text(self, prompt: ChatPrompt) -> str:
        if not getattr(self._tokenizer, "chat_template", None):
            raise InvalidRequestError(
                "This model has no chat template: use /v1/completions, or load it with chat_template_file",
                param="messages",
            )
        # tool_choice "none": the model is not shown the tools, so it has nothing to call.
        tools = prompt.tools if prompt.tools and prompt.tool_choice != "none" else None
        try:
            return self._tokenizer.apply_chat_template(
                prompt.messages,
                tools=tools,
                add_generation_prompt=True,
                tokenize=False,
                **prompt.template_kwargs,
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
