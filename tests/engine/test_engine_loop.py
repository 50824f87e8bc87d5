"""EngineLoop and EngineCore.step's hooks: when a step's outputs leave the engine thread."""

from __future__ import annotations

import queue
import threading

from engine import EngineConfig, EngineCore, Request, SamplingParams
import concurrent.futures.thread as futures_thread

from engine.client.loop import EngineLoop, GuidedIntake
from engine.client.messages import AddRequest, Shutdown
from engine.errors import EngineDeadError
from engine.sampling.guided import GuidedDecoding
from engine.sampling.structured import GuideCompiler
from tests.engine.test_batching import run_alone

GREEDY = dict(temperature=0.0, ignore_eos=True)


def test_every_step_calls_before_device_work_once(tiny_llama):
    # EngineLoop posts the previous step's outputs from this hook: a step that skipped it would hold
    # them back a step, one that called it twice would post nothing the second time (harmless but wrong).
    core = EngineCore(tiny_llama, EngineConfig(max_prefill_seqs=1, prefill_chunk_tokens=4, prefill_step_tokens=0))
    core.add_request(Request("a", list(range(1, 11)), SamplingParams(max_tokens=3, **GREEDY)))
    core.add_request(Request("b", [1, 2], SamplingParams(max_tokens=3, **GREEDY)))
    calls_per_step, rows_at_call = [], []
    while core.has_unfinished_requests():
        calls = []
        core.step(before_device_work=lambda: (calls.append(1), rows_at_call.append(len(core.runner.batch))))
        calls_per_step.append(len(calls))
    assert len(calls_per_step) >= 5 and calls_per_step == [1] * len(calls_per_step)
    assert max(rows_at_call) == 2  # called once the decode batch for the step is assembled


def test_first_tokens_are_posted_before_the_next_step_copies_their_prompts(tiny_llama):
    """EngineLoop holds a step's outputs until the next step's forward is built, except a step's that
    completed prompts: their first tokens must not wait for the next step's prefix-cache copies."""
    prompt = list(range(1, 41))  # five blocks of 8
    commands: queue.SimpleQueue = queue.SimpleQueue()
    posts: list[tuple[dict[str, list[int]], int]] = []  # (tokens per request, prefix-cache blocks then)
    done = threading.Event()
    built: list[EngineCore] = []

    def post(outputs) -> None:
        posts.append(({o.request_id: o.new_token_ids for o in outputs}, built[0].runner.prefix_cache.stats.num_blocks))
        if any(o.is_last for o in outputs):
            done.set()

    def engine_thread() -> None:  # MLX streams belong to the thread that made them
        built.append(EngineCore(tiny_llama, EngineConfig(prefix_block_size=8)))
        EngineLoop(built[0], commands, post, lambda stats: None).run()

    loop = threading.Thread(target=engine_thread, daemon=True)  # a hung loop must not hang pytest's exit
    loop.start()
    commands.put(AddRequest(Request("a", prompt, SamplingParams(max_tokens=4, **GREEDY))))
    assert done.wait(60)
    commands.put(Shutdown())
    loop.join(60)

    first_post_tokens, blocks_when_posted = next(p for p in posts if p[0].get("a"))
    assert len(first_post_tokens["a"]) == 1 and blocks_when_posted == 0
    assert built[0].runner.prefix_cache.stats.num_blocks == 5  # the copies still happen, a step later
    tokens = [t for tokens, _ in posts for t in tokens.get("a", [])]
    assert tokens == run_alone(tiny_llama, "a", prompt, SamplingParams(max_tokens=4, **GREEDY)).token_ids


def test_a_guided_request_arriving_as_the_engine_stops_ends_with_an_error_not_a_traceback(tiny_bpe_llama, monkeypatch):
    """Once its pool is shut down, or the interpreter exits (concurrent.futures then refuses new work before atexit
    stops an engine left running), GuidedIntake cannot compile a new schema: the request ends with EngineDeadError
    on its stream and nothing stays compiling."""
    guides = GuideCompiler(tiny_bpe_llama.tokenizer, tiny_bpe_llama.vocab_size, tiny_bpe_llama.eos_token_ids)
    enqueued, posted = [], []
    intake = GuidedIntake(guides, enqueued.append, posted.extend)

    def guided(request_id: str, pattern: str) -> Request:
        return Request(request_id, [1, 2, 3], SamplingParams(max_tokens=4, guided=GuidedDecoding("regex", pattern)))

    monkeypatch.setattr(futures_thread, "_shutdown", True)  # as at interpreter exit
    intake.admit(guided("at-exit", "[ab]+"))
    monkeypatch.setattr(futures_thread, "_shutdown", False)
    intake.shutdown()
    intake.admit(guided("after-shutdown", "[cd]+"))
    assert enqueued == [] and not intake.cancel("at-exit") and not intake.cancel("after-shutdown")
    assert [o.request_id for o in posted] == ["at-exit", "after-shutdown"]
    assert all(isinstance(o.error, EngineDeadError) for o in posted)
