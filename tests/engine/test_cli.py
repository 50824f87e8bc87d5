"""`orchard generate`: one chat answer through the thread engine client, the same text as the engine alone."""

from __future__ import annotations

from deployments.cli.main import main
from engine.sampling.params import SamplingParams
from tests.engine.test_batching import run_alone


def test_generate_prints_the_greedy_answer(tiny_llama, capsys):
    assert main(["generate", "t5 t7 t9", "--model", str(tiny_llama.path), "--max-tokens", "6"]) == 0
    printed = capsys.readouterr()
    messages = [{"role": "user", "content": "t5 t7 t9"}]
    prompt = tiny_llama.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    alone = run_alone(tiny_llama, "cli", prompt, SamplingParams(max_tokens=6, temperature=0.0))
    assert printed.out == alone.text + "\n"
    assert f"[{len(alone.token_ids)} tokens in" in printed.err
