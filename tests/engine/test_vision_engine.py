"""Vision-language models in the engine: our greedy tokens and logprobs equal mlx-vlm's own generate; prompts with
images batched (with text-only ones, images of different sizes) equal each alone; the prefix cache hits the same
image and never a changed one. Two families with different processors: Qwen2.5-VL (M-RoPE) and Gemma 3."""

from __future__ import annotations

from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest

from deployments.chat.vision_prompts import MediaTokens, VisionPromptEncoder
from deployments.model_calls import ImageInput, VideoInput
from engine import EngineConfig, EngineCore, Request, SamplingParams
from engine.kv.batch_cache import new_request_cache
from engine.runner.text_after_images import shifted_text, shifted_twin
from engine.runner.vision_prefill import run_vision_prefill
from engine.scheduler_output import PrefillChunk
from engine.vision.loader import load_vision_model, load_vision_processor, read_media_token_ids
from engine.vision.text_twin import twin_prefill
from tests.engine.test_batching import assert_same_stream
from tests.support.drive import Arrival, collect, run_core
from tests.support.tiny_vlms import write_gemma3, write_qwen25_vl
from tests.support.vlm_reference import mlx_vlm_greedy, process_chat
from tests.support.vlm_images import png_bytes

FAMILIES = {"qwen2_5_vl": write_qwen25_vl, "gemma3": write_gemma3}
QUESTION = "t11 t12 t13 t14"
BLOCK = 8


class Family:
    """A tiny model folder, loaded for the engine, with its processor for building prompts."""

    def __init__(self, folder):
        self.folder = folder
        self.loaded = load_vision_model(folder)
        self.processor = load_vision_processor(folder)
        self.encoder = VisionPromptEncoder(self.processor, MediaTokens(*read_media_token_ids(folder)), max_image_pixels=10**7)

    def chat_text(self, messages) -> str:
        return self.processor.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def request(
        self, request_id: str, images: list[bytes], text: str = QUESTION, max_tokens: int = 8,
        video: list[bytes] | None = None,
    ) -> Request:
        """A user turn with `images` (or a `video` given as its frames) before `text`."""
        media = [{"type": "image"} for _ in images] + ([{"type": "video"}] if video else [])
        rendered = self.chat_text([{"role": "user", "content": [*media, {"type": "text", "text": text}]}])
        sampling = greedy(max_tokens)
        if not media:
            ids = self.processor.tokenizer.encode(rendered, add_special_tokens=False)
            return Request(request_id, ids, sampling)
        inputs = [ImageInput(data, f"messages.0.content.{i}", "image/png") for i, data in enumerate(images)]
        frames = [ImageInput(data, f"messages.0.content.0.video.{i}") for i, data in enumerate(video or [])]
        videos = [VideoInput("messages.0.content.0", frames=frames)] if video else []
        prompt = self.encoder.encode(rendered, inputs, videos)
        return Request(request_id, prompt.token_ids, sampling, vision=prompt.vision, prompt_cache_keys=prompt.cache_keys)


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=True)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory) -> Family:
    return Family(FAMILIES[request.param](tmp_path_factory.mktemp(request.param)))


def alone(family: Family, request: Request, **config):
    core = EngineCore(family.loaded, EngineConfig(enable_prefix_cache=False, **config))
    return run_core(core, [Arrival(0, request)])[request.request_id]


def test_greedy_tokens_and_logprobs_equal_mlx_vlm_generate(family):
    from mlx_vlm.utils import load

    image = png_bytes(112, 84, seed=3)
    ours = alone(family, family.request("ours", [image]))
    model, processor = load(str(family.folder))
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]
    theirs = mlx_vlm_greedy(model, processor, process_chat(processor, messages, [_pil(image)]), max_tokens=8)
    assert ours.token_ids == theirs.token_ids
    assert max(abs(a - b) for a, b in zip(ours.logprobs, theirs.chosen_logprobs())) < 1e-4
    other = alone(family, family.request("other", [png_bytes(112, 84, seed=4)]))
    assert other.logprobs != ours.logprobs  # the image reaches the model


def test_an_images_repeated_frames_sent_once_answer_as_the_processors_own_pixels(family):
    """Qwen2.5-VL's processor repeats each still image's frame (its temporal patch of 2): the encoder sends the frame
    once, half the bytes, and the engine repeats it on the device; the answer equals that of the processor's own
    pixels bit for bit. Gemma 3's pixels hold no repeated frame and go as the processor made them."""
    data = png_bytes(112, 84, seed=12)
    request = family.request("folded", [data])
    rendered = family.chat_text([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}])
    theirs = np.asarray(family.processor(text=[rendered], images=[_pil(data)], add_special_tokens=False)["pixel_values"])
    vision = request.vision
    if "qwen" not in family.folder.name:
        assert vision.pixel_frames == 1 and np.array_equal(vision.pixel_values, theirs)
        return
    assert vision.pixel_frames == 2 and vision.pixel_values.nbytes * 2 == theirs.nbytes
    assert vision.model_pixel_shape() == theirs.shape
    whole = replace(vision, pixel_values=theirs, pixel_frames=1)
    unfolded = alone(family, Request("whole", request.prompt_token_ids, greedy(8), vision=whole))
    folded = alone(family, request)
    assert folded.token_ids == unfolded.token_ids and folded.logprobs == unfolded.logprobs


def _pil(data: bytes):
    import io

    from PIL import Image

    return Image.open(io.BytesIO(data)).convert("RGB")


def test_eight_requests_with_images_of_different_sizes_and_text_only_batched_equal_each_alone(family):
    sizes = [(56, 56), (112, 84), (84, 140), None, (140, 140), None, (56, 112), (168, 84)]

    def requests() -> list[Request]:  # fresh ones for each run: a Request carries its progress
        made = [
            family.request(f"r{i}", [] if size is None else [png_bytes(*size, seed=i)], text=f"t{20 + i} " + QUESTION)
            for i, size in enumerate(sizes)
        ]
        return made + [family.request("two-images", [png_bytes(56, 56, seed=9), png_bytes(84, 84, seed=10)])]

    expected = {r.request_id: alone(family, r) for r in requests()}
    core = EngineCore(family.loaded, EngineConfig(enable_prefix_cache=False, max_prefill_seqs=4, prefill_chunk_tokens=16))
    batched = run_core(core, [Arrival(i // 3, r) for i, r in enumerate(requests())])
    assert len(batched) == len(expected) == 9
    for request_id, stream in expected.items():
        assert_same_stream(stream, batched[request_id])


def test_requests_with_images_written_over_rows_that_left_equal_each_alone(family):
    # As on a GPU (defer_leaves), joiners take dead rows' places in a plain batch; the M-RoPE rows' shifts stay
    # folded into the offsets the fill lays out anew.
    if "qwen2_5_vl" not in str(family.folder):
        pytest.skip("Gemma 3's sliding-window caches batch through mlx-lm (no rows to fill)")
    sizes = [(56, 56), None, (112, 84), (84, 140), (56, 112), None]

    def requests() -> list[Request]:
        return [family.request(f"r{i}", [] if size is None else [png_bytes(*size, seed=i)],
                               text=f"t{20 + i} " + QUESTION, max_tokens=3 + 3 * i) for i, size in enumerate(sizes)]

    expected = {r.request_id: alone(family, r) for r in requests()}
    # r3's prompt, the longest, alone takes two chunks: its row is kept vacant a step whatever the towers' learnt
    # cost charges the step budget (a few % of it each here; a measured budget left that to timing).
    lengths = [len(r.prompt_token_ids) for r in requests()]
    assert lengths.index(max(lengths)) == 3 and sorted(lengths)[-2] < max(lengths)
    config = EngineConfig(enable_prefix_cache=False, max_prefill_seqs=4, prefill_chunk_tokens=max(lengths) - 1,
                          prefill_step_tokens=4096)
    core = EngineCore(family.loaded, config)
    core.runner.batch.defer_leaves = True
    pending, results, filled = requests(), {}, 0
    for step in range(200):
        if step in (0, 7):  # four rows, then two more once the first two have left
            for request in pending[:4] if step == 0 else pending[4:]:
                core.add_request(request)
        elif not core.has_unfinished_requests():
            break
        before = list(core.runner.batch.request_ids)
        collect(core.step(), results)
        after = core.runner.batch.request_ids
        joined = [rid for rid in after if rid not in before and rid.startswith("r")]
        kept_in_place = all(rid == before[i] for i, rid in enumerate(after) if rid in before)
        if joined and len(after) == len(before) and kept_in_place:
            filled += len(joined)  # written over dead rows: every other row where it was
    assert filled == 3  # r3 over the row kept vacant for it (its prompt completes a step late), r4 and r5
    for request_id, stream in expected.items():
        assert_same_stream(stream, results[request_id])


def test_chunked_prefill_of_an_image_prompt_equals_one_chunk(family):
    whole = alone(family, family.request("whole", [png_bytes(140, 140, seed=5)]))
    chunked = alone(family, family.request("chunked", [png_bytes(140, 140, seed=5)]), prefill_chunk_tokens=7)
    assert_same_stream(whole, chunked)


def test_same_image_hits_the_prefix_cache_with_equal_logprobs_and_a_changed_image_misses(family):
    core = EngineCore(family.loaded, EngineConfig(prefix_block_size=BLOCK))
    text = " ".join(f"t{30 + i}" for i in range(24))
    first = run_core(core, [Arrival(0, family.request("first", [png_bytes(112, 84, seed=1)], text))])["first"]
    again = run_core(core, [Arrival(0, family.request("again", [png_bytes(112, 84, seed=1)], text))])["again"]
    changed = run_core(core, [Arrival(0, family.request("changed", [png_bytes(112, 84, seed=2)], text))])["changed"]
    assert first.finish.usage.cached_tokens == 0
    prompt_tokens = again.finish.usage.prompt_tokens
    assert again.finish.usage.cached_tokens == (prompt_tokens - 1) // BLOCK * BLOCK > 0
    assert_same_stream(first, again)
    # Only blocks before the image can match (the template's opening tokens), never one holding it; a model
    # cached in whole-cache snapshots (Gemma's sliding window) keeps one at each prompt's last block boundary only.
    image_start = family.request("probe", [png_bytes(112, 84, seed=2)], text).prompt_cache_keys
    first_image_token = next(i for i, key in enumerate(image_start) if key < 0)
    expected = first_image_token // BLOCK * BLOCK if core.scheduler.kv.cuts_blocks else 0
    assert changed.finish.usage.cached_tokens == expected
    assert changed.logprobs != first.logprobs
    assert_same_stream(alone(family, family.request("changed-alone", [png_bytes(112, 84, seed=2)], text)), changed)


def test_a_second_turn_about_the_same_image_reuses_its_kv(family):
    core = EngineCore(family.loaded, EngineConfig(prefix_block_size=BLOCK))
    image = png_bytes(112, 84, seed=6)
    turn1 = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]
    first = run_core(core, [Arrival(0, family.request("turn1", [image]))])["turn1"]
    turn2 = turn1 + [{"role": "assistant", "content": first.text}, {"role": "user", "content": "t40 t41"}]
    rendered = family.chat_text(turn2)
    prompt = family.encoder.encode(rendered, [ImageInput(image, "messages.0.content.0", "image/png")])
    request = Request("turn2", prompt.token_ids, greedy(4), vision=prompt.vision, prompt_cache_keys=prompt.cache_keys)
    lookups = _lookups(core)
    second = run_core(core, [Arrival(0, request)])["turn2"]
    last_image_token = max(i for i, key in enumerate(prompt.cache_keys) if key < 0)
    assert second.finish.usage.cached_tokens > last_image_token
    # Qwen2.5-VL (M-RoPE): the turn's text after the cached image runs as text at the prompt's rope delta, with
    # no embedding of the prompt (no feature lookup); Gemma 3 keeps the embedding path (and keeps no features).
    as_text = family.loaded.model.uses_rope_deltas
    assert core.runner.vision_prompts.after_images.agrees is as_text
    if as_text:
        assert _lookups(core) == lookups
    assert_same_stream(alone(family, Request("turn2-alone", prompt.token_ids, greedy(4), vision=prompt.vision)), second)


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "padded"])
def test_another_question_on_a_cached_image_reuses_its_kv_through_the_images_last_token(family, padded):
    """`padded`: prefill shapes padded (a GPU's default), so the question after the cached image runs right-padded
    to its length bucket (109 tokens as 128 with the tiny Qwen2.5-VL), its cache cut back to its real length."""
    config = EngineConfig(prefix_block_size=BLOCK, pad_prefill_shapes=padded, prefill_warmup_seconds=0)
    core = EngineCore(family.loaded, config)
    image = png_bytes(112, 84, seed=7)
    run_core(core, [Arrival(0, family.request("first", [image], " ".join(f"t{30 + i}" for i in range(24))))])
    other = " ".join(f"t{60 + i}" for i in range(24))
    lookups = _lookups(core)
    second = run_core(core, [Arrival(0, family.request("second", [image], other))])["second"]
    keys = family.request("probe", [image], other).prompt_cache_keys
    media_end = max(i for i, key in enumerate(keys) if key < 0) + 1
    if core.scheduler.kv.cuts_blocks:
        # The image ends inside a block whose text differs: that block's first positions are reused, and the
        # question runs as text (Qwen2.5-VL) with no embedding of the prompt.
        assert media_end % BLOCK and second.finish.usage.cached_tokens == media_end
        if family.loaded.model.uses_rope_deltas:
            assert _lookups(core) == lookups
    assert_same_stream(alone(family, family.request("second-alone", [image], other)), second)
    core.scheduler.kv.prefix_cache.check_integrity()


def test_a_cached_images_next_question_runs_no_tower_even_where_its_features_are_not_kept(family):
    """Its KV through the image's last token is in the prefix cache, its features are not: the tower, run ahead of
    admission for requests with images (EngineCore), is not run for it; it answers as alone."""
    model = family.loaded.model
    if model.batched_tower is None:
        pytest.skip("the family's tower runs in its prompt's embedding, never ahead")
    core = EngineCore(family.loaded, EngineConfig(prefix_block_size=BLOCK, vision_feature_cache_bytes=0))
    image = png_bytes(112, 84, seed=8)
    run_core(core, [Arrival(0, family.request("first", [image], " ".join(f"t{30 + i}" for i in range(24))))])
    towers = model.tower_stats.images
    other = " ".join(f"t{60 + i}" for i in range(24))
    second = run_core(core, [Arrival(0, family.request("second", [image], other))])["second"]
    assert model.tower_stats.images == towers and second.finish.usage.cached_tokens > 0
    assert_same_stream(alone(family, family.request("second-alone", [image], other)), second)


@pytest.mark.parametrize("delta", [0, -17, 9])
def test_text_after_images_through_the_text_twin_equals_mlx_vlms_m_rope(family, delta):
    """Qwen2.5-VL's text after its images runs through mlx-lm's text twin, its rotary offset shifted by the prompt's
    delta (ShiftedPositions): the same logits and the same KV as mlx-vlm's M-RoPE language model at that delta."""
    model = family.loaded.model
    if model.text_twin is None or not model.uses_rope_deltas:
        pytest.skip("the family has no M-RoPE twin: its text after images keeps mlx-vlm's path")
    twin = twin_prefill(model.text_twin)
    assert twin is not None and twin.split is not None
    prefix, chunk = mx.array([list(range(10, 40))]), mx.array([list(range(50, 57))])
    caches = [new_request_cache(model), new_request_cache(model)]
    for cache in caches:
        model(prefix, cache=cache)
    ours = shifted_twin(twin.model, delta, twin.split).model(chunk, cache=caches[0])
    theirs = shifted_text(model, delta, None).model(chunk, cache=caches[1])
    assert mx.allclose(ours, theirs, atol=1e-4).item()
    assert caches[0][0].offset == caches[1][0].offset == 37
    assert mx.allclose(caches[0][0].state[0], caches[1][0].state[0], atol=1e-4).item()


def _lookups(core: EngineCore) -> tuple[int, int]:
    stats = core.stats().vision_features
    return stats.hits, stats.misses


def test_a_video_of_frames_equals_mlx_vlm_and_batches_with_images_and_text(tmp_path_factory):
    """Qwen2.5-VL takes video: frames sampled as its processor asks, video tokens keyed by the frames' content."""
    import mlx.core as mx
    from mlx_vlm.utils import load

    from tests.support.vlm_reference import ProcessedChat

    family = Family(write_qwen25_vl(tmp_path_factory.mktemp("qwen-video")))
    frames = [png_bytes(112, 84, seed=40 + i) for i in range(6)]
    request = family.request("video", [], video=frames)
    ours = alone(family, request)
    vision = request.vision
    model, processor = load(str(family.folder))
    ids = mx.array([list(request.prompt_token_ids)])
    chat = ProcessedChat("", ids, mx.ones(ids.shape), None, {k: mx.array(v) for k, v in vision.model_arrays.items()})
    theirs = mlx_vlm_greedy(model, processor, chat, max_tokens=8)
    assert ours.token_ids == theirs.token_ids
    assert max(abs(a - b) for a, b in zip(ours.logprobs, theirs.chosen_logprobs())) < 1e-4
    assert "pixel_values_videos" in vision.model_arrays and vision.pixel_values is None

    def mixed() -> list[Request]:
        return [family.request("v", [], video=frames), family.request("i", [png_bytes(56, 56, seed=1)]),
                family.request("t", []), family.request("v2", [], video=frames[::-1])]

    expected = {r.request_id: alone(family, r) for r in mixed()}
    assert expected["v2"].logprobs != expected["v"].logprobs  # the frames' order reaches the model
    core = EngineCore(family.loaded, EngineConfig(prefix_block_size=BLOCK, prefill_chunk_tokens=16))
    batched = run_core(core, [Arrival(0, r) for r in mixed()])
    for request_id, stream in expected.items():
        assert_same_stream(stream, batched[request_id])
    again = run_core(core, [Arrival(0, family.request("again", [], video=frames))])["again"]
    assert again.finish.usage.cached_tokens == (again.finish.usage.prompt_tokens - 1) // BLOCK * BLOCK
    assert_same_stream(ours, again)


def test_image_features_enter_the_language_model_in_its_dtype(tmp_path):
    """A float32 vision tower beside a bf16 language model: the prompt's embeddings, and so its KV, are bf16 (one
    float32 row would turn a whole decode batch float32)."""
    import mlx.core as mx
    from mlx_vlm.utils import load_model

    from engine.kv.batch_cache import new_request_cache
    from engine.vision.model import VisionLanguageModel

    family = Family(write_qwen25_vl(tmp_path / "qwen"))
    vlm = load_model(family.folder)
    vlm.language_model.set_dtype(mx.bfloat16)
    model = VisionLanguageModel(vlm)
    request = family.request("mixed-dtypes", [png_bytes(112, 84, seed=3)])
    embedded = model.embed_prompt(request.prompt_token_ids, request.vision)
    assert model.text_dtype == mx.bfloat16 and vlm.vision_tower.patch_embed.proj.weight.dtype == mx.float32
    assert embedded.inputs_embeds.dtype == mx.bfloat16
    cache = new_request_cache(model)
    model.prefill_embedded(embedded, 0, len(request.prompt_token_ids), cache)
    assert cache[0].keys.dtype == mx.bfloat16


def test_text_prompts_of_a_vision_model_compute_logits_at_their_last_position_only(family):
    """The language model splits into backbone + head (full logits of a 640-token prompt over a 152k vocabulary
    would be 390 MB), and the split's logits are the model's own."""
    core = EngineCore(family.loaded, EngineConfig())
    assert core.runner.head_split is not None


def test_a_short_completing_chunk_in_one_forward_equals_a_body_and_a_tail_forward(family):
    """A GPU runs a completing chunk of <= 2,048 tokens in one forward (runner/vision_prefill.py), the CPU as a body
    and a one-token tail forward: the same logits and KV."""
    request = family.request("one", [png_bytes(112, 84, seed=8)])
    model = family.loaded.model
    embedded = model.embed_prompt(request.prompt_token_ids, request.vision)
    chunk = PrefillChunk("one", 0, tuple(request.prompt_token_ids), True)
    two, one = (run_vision_prefill(model, [chunk], [new_request_cache(model)], {"one": embedded}, one_forward)
                for one_forward in (0, 256))
    assert two.last_logits.shape == one.last_logits.shape
    assert mx.allclose(two.last_logits, one.last_logits, atol=1e-4).item()
    # The KV each wrote (Gemma 3's sliding-window caches lay it out otherwise): the next token's logits on it.
    token = mx.array([[int(mx.argmax(two.last_logits[0]).item())]])
    delta = mx.array([[embedded.rope_delta]])
    after_two, after_one = (model(token, cache=result.caches[0], rope_deltas=delta) for result in (two, one))
    assert mx.allclose(after_two, after_one, atol=1e-4).item()
