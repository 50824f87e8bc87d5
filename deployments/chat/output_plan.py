"""Per request, on the model side: which output parser reads the text, and what sampling it needs.

Parsing runs next to the engine (not in the ingress) so raw markup never crosses the Ray
handle and the ingress only renders neutral deltas. Forced tool calls become a guided regex.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from deployments.chat.parsers.forced import forced_call_regex
from deployments.chat.parsers.selection import OutputParser, ParseOptions, ParserNames, build_output_parser
from engine.sampling.guided import GuidedDecoding
from engine.sampling.params import SamplingParams
from deployments.model_calls import ChatPrompt, GenerateJob


@dataclass
class OutputPlan:
    sampling: SamplingParams
    parser: OutputParser | None


def plan_output(names: ParserNames, job: GenerateJob, prompt_text: str) -> OutputPlan:
    prompt = job.prompt
    if not isinstance(prompt, ChatPrompt):  # /v1/completions: raw text, no parsing
        return OutputPlan(job.sampling, None)
    tools = prompt.tools if prompt.tools and prompt.tool_choice != "none" else None
    forced = bool(tools) and prompt.tool_choice in ("required", "function")
    sampling = job.sampling
    if names.keeps_special_tokens(tools_enabled=bool(tools)):
        sampling = dataclasses.replace(sampling, skip_special_tokens=False)
    if forced:
        regex = forced_call_regex(names, tools or [], prompt.tool_name if prompt.tool_choice == "function" else None)
        sampling = dataclasses.replace(sampling, guided=GuidedDecoding("regex", regex, param="tool_choice"))
    if sampling.guided is not None:
        # A guide (a forced call, response_format) holds from the first token: what it writes is the answer, even
        # where the prompt opened a <think> block (a Qwen3-2507 thinking or R1-style template).
        prompt_text = ""
    options = ParseOptions(tools=tools, parallel_tool_calls=prompt.parallel_tool_calls, prompt_text=prompt_text)
    return OutputPlan(sampling, build_output_parser(names, options))
