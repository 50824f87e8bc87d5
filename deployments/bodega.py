"""Bodega compatibility, in one place: its model fields are accepted under their own names and mapped to ours.

Bodega (the server whose load-model body and serve options Orchard accepts) names the engine's knobs `cb_*`;
its sequential mode (`continuous_batching: false`) runs at most `max_concurrency` sequences at once. Fields whose
Bodega meaning Orchard does not offer are refused with a message saying so, never reinterpreted. `draft_model_path`
and `num_draft_tokens` become our `speculative:` (a draft model; `num_draft_tokens` alone: n-gram prompt lookup).
"""

from __future__ import annotations

from typing import Any

# Bodega's name -> ours.
ALIASES = {
    "cb_max_num_seqs": "max_num_seqs",
    "cb_prefill_batch_size": "max_prefill_seqs",
    "cb_completion_batch_size": "max_decode_seqs",
    "cb_chunked_prefill_tokens": "prefill_chunk_tokens",
    "cb_enable_prefix_cache": "enable_prefix_cache",
}

# Bodega's speculative-decoding fields, mapped onto our `speculative:` (deployments/speculative.py).
DRAFT_FIELDS = ("draft_model_path", "num_draft_tokens")
DEFAULT_MAX_CONCURRENCY = 1  # sequential mode's sequences at once
# Bodega's fields that are none of ours, and what each becomes (docs/configuration.md lists them).
BODEGA_ONLY_FIELDS = {
    "continuous_batching": "false: sequential mode, at most max_concurrency sequences at once (sets max_prefill_seqs "
                           "and max_decode_seqs; default true, and false when max_concurrency is given, as in Bodega)",
    "max_concurrency": f"the sequences sequential mode runs at once (default {DEFAULT_MAX_CONCURRENCY}; given without "
                       "continuous_batching, it means sequential mode; ignored with continuous_batching: true)",
    "draft_model_path": "a draft model: speculative with method draft and this draft_model_path",
    "num_draft_tokens": "with draft_model_path, speculative.num_draft_tokens; alone, n-gram prompt lookup with that "
                        "many drafts",
    "enable_auto_tool_choice": "accepted, either value: Orchard parses tool calls whenever a request sends tools "
                               "(tool_choice auto, as OpenAI)",
    "disable_auto_resize": "false (the default) accepted: images are resized as the model's processor says; true is "
                           "refused (Orchard does not serve images at other sizes)",
    "prompt_cache_size": "Bodega's prompt cache slots (default 0); Orchard's block prefix cache caches recurring "
                         "prompts on its own (enable_prefix_cache, within prefix_cache_bytes): accepted, and a "
                         "size above 0 with enable_prefix_cache false is refused",
}


def from_bodega(fields: Any) -> Any:
    """A model entry with Bodega's names rewritten to ours (ValueError naming the field on conflicts)."""
    if not isinstance(fields, dict):
        return fields  # pydantic reports the type
    fields = dict(fields)
    _drop_no_op_fields(fields)
    sent_as: dict[str, str] = {}  # our name -> the Bodega name the body used, for messages
    for bodega, ours in ALIASES.items():
        if bodega not in fields:
            continue
        if ours in fields:
            raise ValueError(f"'{bodega}' and '{ours}' name the same setting: give one")
        fields[ours] = fields.pop(bodega)
        sent_as[ours] = bodega
    _apply_draft_fields(fields)
    _apply_sequential_mode(fields, sent_as)
    _apply_prompt_cache_size(fields)
    return fields


def _drop_no_op_fields(fields: dict[str, Any]) -> None:
    """Bodega's switches whose accepted values change nothing here (BODEGA_ONLY_FIELDS says why)."""
    choice = fields.pop("enable_auto_tool_choice", None)
    if choice is not None and not isinstance(choice, bool):
        raise ValueError("'enable_auto_tool_choice' must be true or false")
    resize = fields.pop("disable_auto_resize", None)
    if resize is not None and not isinstance(resize, bool):
        raise ValueError("'disable_auto_resize' must be true or false")
    if resize:
        raise ValueError("'disable_auto_resize: true' is not served: images are always resized as the model's "
                         "processor says")


def _apply_draft_fields(fields: dict[str, Any]) -> None:
    """`draft_model_path` (+ `num_draft_tokens`, default 4): a draft model; `num_draft_tokens` alone: n-gram
    prompt lookup with that many drafts (output is the model's own either way, so speculating is never wrong)."""
    given = {name: fields.pop(name) for name in DRAFT_FIELDS if fields.get(name) is not None}
    for name in DRAFT_FIELDS:
        fields.pop(name, None)  # null: not given
    if not given:
        return
    if fields.get("speculative") is not None:
        names = " and ".join(f"'{name}'" for name in given)
        raise ValueError(f"{names} and 'speculative' both configure speculative decoding: give one")
    if "draft_model_path" in given:
        fields["speculative"] = {"method": "draft", **given}
    else:
        fields["speculative"] = {"method": "ngram", **given}


def _apply_sequential_mode(fields: dict[str, Any], sent_as: dict[str, str]) -> None:
    """`continuous_batching: false` runs at most `max_concurrency` (default 1) sequences at once. Bodega's own default
    is sequential, so a body naming `max_concurrency` without `continuous_batching` means that too; a body naming
    neither keeps Orchard's default, continuous batching."""
    batching = fields.pop("continuous_batching", "max_concurrency" not in fields)
    concurrency = fields.pop("max_concurrency", DEFAULT_MAX_CONCURRENCY)
    if not isinstance(batching, bool):
        raise ValueError("'continuous_batching' must be true or false")
    if not isinstance(concurrency, int) or isinstance(concurrency, bool) or concurrency < 1:
        raise ValueError("'max_concurrency' must be an integer >= 1")
    if batching:
        return
    for name in ("max_prefill_seqs", "max_decode_seqs"):
        if name in fields:
            raise ValueError(f"'{sent_as.get(name, name)}' cannot be set with continuous_batching: false (use "
                             "max_concurrency)")
        fields[name] = concurrency


def _apply_prompt_cache_size(fields: dict[str, Any]) -> None:
    """Bodega's prompt cache slots: what they ask for (recurring prompts served from cache) is Orchard's prefix cache,
    on by default; only a contradiction is refused."""
    size = fields.pop("prompt_cache_size", None)
    if size is None:
        return
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise ValueError("'prompt_cache_size' must be an integer >= 0")
    if size > 0 and fields.get("enable_prefix_cache") is False:
        raise ValueError("'prompt_cache_size' asks for prompt caching, which 'enable_prefix_cache: false' turns off")
