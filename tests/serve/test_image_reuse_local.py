"""Another question on an image already asked about, through the in-process stack with the real `openai` client: the
replica reuses its processor's output and sends no pixels to the engine process, which merges the features it
kept; where it no longer keeps them (evicted by another image) it asks for the pixels and the request goes again;
an engine that keeps no features makes the replica send pixels always. Every answer (text and logprobs) equals a
server's that processes and sends every image anew."""

from __future__ import annotations

import asyncio
import logging

import pytest

from deployments.config import ModelConfig
from deployments.model.service import process_engine_client
from tests.engine.test_batching import LOGPROB_TOLERANCE
from tests.serve.local_stack import local_stack
from tests.serve.test_metrics_local import Scrape
from tests.serve.test_vision_local import VL, clients, openai_image_message, vl_config  # noqa: F401 (a fixture)
from tests.support.vlm_images import png_bytes

RESENT = "sent again with its images' pixels"


def ask(image: bytes, question: str) -> dict:
    messages = openai_image_message(image)
    messages[0]["content"][-1]["text"] = question
    return dict(model=VL, messages=messages, max_tokens=6, temperature=0, logprobs=True)


async def answers(config: ModelConfig, asks: list[tuple[bytes, str]], tmp_path, engine_client=None) -> dict:
    extra = {} if engine_client is None else {"new_engine_client": engine_client}
    async with local_stack([config], tmp_path, **extra) as stack:
        oa, _ = clients(stack)
        out = []
        for image, question in asks:
            choice = (await oa.chat.completions.create(**ask(image, question))).choices[0]
            out.append((choice.message.content, [t.logprob for t in choice.logprobs.content]))
        scrape = Scrape((await stack.http.get("/metrics")).text)
        name = "orchard:vision_feature_cache_lookups_total"
        lookups = tuple(scrape.values.get((name, (("model_name", VL), ("result", r)))) for r in ("miss", "hit"))
        kept = scrape.values.get(("orchard:vision_feature_cache_bytes", (("model_name", VL),)))
        return {"answers": out, "lookups": lookups, "kept_bytes": kept}


def test_a_repeated_image_goes_without_pixels_and_again_with_them_once_evicted(vl_config, tmp_path, caplog):
    a, b = png_bytes(112, 84, seed=71), png_bytes(84, 112, seed=72)  # the same token count: the same feature bytes
    asks = [(a, "t1 t2"), (a, "t3 t4 t5"), (b, "t1 t2"), (a, "t6")]
    anew = vl_config.model_copy(update={"processed_image_cache_bytes": 0})
    reference = asyncio.run(answers(anew, asks, tmp_path, process_engine_client))
    # Pixels sent every time, and a's KV through its last image token in the prefix cache: a, then b through the
    # tower (misses); a asked again prefills only its question, as text (no lookup at all).
    assert reference["lookups"] == (2.0, 0.0)
    uncached = asyncio.run(answers(anew.model_copy(update={"enable_prefix_cache": False}), asks, tmp_path,
                                   process_engine_client))
    assert uncached["lookups"] == (2.0, 2.0)  # a kept, then b: the engine's own cache
    one_image = int(uncached["kept_bytes"]) // 2
    # Without the prefix cache, so that every request needs its features.
    reusing = vl_config.model_copy(update={"vision_feature_cache_bytes": one_image, "enable_prefix_cache": False})
    with caplog.at_level(logging.INFO, logger="deployments.model.pixel_sends"):
        seen = asyncio.run(answers(reusing, asks, tmp_path, process_engine_client))
    # a: miss; a again, no pixels: held (hit); b: miss, evicting a; a again, no pixels: refused (miss), resent
    # with them (miss, the tower runs).
    assert seen["lookups"] == (4.0, 1.0)
    resent = [r.getMessage() for r in caplog.records if RESENT in r.getMessage()]
    assert len(resent) == 1 and resent[0].endswith("The engine no longer keeps these images' features")
    for ours, uncached_answer, theirs in zip(seen["answers"], uncached["answers"], reference["answers"]):
        assert ours[0] == uncached_answer[0] == theirs[0] != ""
        # The reference's questions after a cached image run through mlx-lm's text twin (mx.fast.rope), these through
        # mlx-vlm's M-RoPE: the house's cross-path bound (1.5e-5 apart seen on the CPU).
        assert ours[1] == pytest.approx(theirs[1], abs=LOGPROB_TOLERANCE)
        assert uncached_answer[1] == pytest.approx(theirs[1], abs=LOGPROB_TOLERANCE)


def test_an_engine_keeping_no_features_gets_pixels_always(vl_config, tmp_path, caplog):
    a = png_bytes(112, 84, seed=73)
    asks = [(a, "t1"), (a, "t2 t3"), (a, "t4")]
    none_kept = vl_config.model_copy(update={"vision_feature_cache_bytes": 0})
    with caplog.at_level(logging.INFO, logger="deployments.model.pixel_sends"):
        seen = asyncio.run(answers(none_kept, asks, tmp_path))
    resent = [r.getMessage() for r in caplog.records if RESENT in r.getMessage()]
    assert len(resent) == 1 and resent[0].endswith("This engine needs the images' pixels")  # then never left out
    reference = asyncio.run(answers(none_kept.model_copy(update={"processed_image_cache_bytes": 0}), asks, tmp_path))
    assert seen["answers"] == reference["answers"]

