"""engine/kv/whole_buffer.py: a short forward over the whole KV buffer (unwritten tail masked) gives the
exact-length forward's logits and leaves the same KV, for a lone row and for a left-padded batch."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import BatchKVCache

from engine.kv.batch_cache import merge_request_caches, new_request_cache
from engine.kv.whole_buffer import whole_buffer_caches


def prefilled(model, prompts: list[list[int]]) -> list:
    """One cache per prompt (prefilled), merged into a left-padded batch when there are several."""
    caches = []
    for prompt in prompts:
        cache = new_request_cache(model)
        mx.eval(model(mx.array([prompt], mx.uint32), cache=cache))
        caches.append(cache)
    return caches[0] if len(caches) == 1 else merge_request_caches(caches)


def grow_buffers(model, caches, tokens: mx.array) -> None:
    """One forward that makes each buffer longer than what it holds (mlx-lm grows by 256 positions)."""
    mx.eval(model(tokens, cache=caches))


def written_kv(caches) -> list[np.ndarray]:
    return [np.array(layer.keys_and_values()[which]) for layer in caches for which in (0, 1)]


def check_same_forward(model, prompts: list[list[int]], width: int) -> None:
    rows = len(prompts)
    exact, viewed = prefilled(model, prompts), prefilled(model, prompts)
    first = mx.array([[3, 4]] * rows, mx.uint32)
    grow_buffers(model, exact, first), grow_buffers(model, viewed, first)
    views = whole_buffer_caches(viewed, width)
    assert views is not None and views[0].layer.keys.shape[2] > views[0].layer.size() + width
    tokens = mx.array([[5 + i + r for i in range(width)] for r in range(rows)], mx.uint32)
    want = model(tokens, cache=exact)
    got = model(tokens, cache=views)
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-5, atol=1e-5)
    assert np.array_equal(np.array(got.argmax(-1)), np.array(want.argmax(-1)))
    for mine, theirs in zip(written_kv(viewed), written_kv(exact)):
        assert np.array_equal(mine, theirs)


def test_lone_row_forward_over_whole_buffer_equals_exact(tiny_llama):
    check_same_forward(tiny_llama.model, [[1, 2, 3, 4, 5, 6, 7]], width=5)


def test_padded_batch_forward_over_whole_buffer_equals_exact(tiny_llama):
    check_same_forward(tiny_llama.model, [[1, 2, 3, 4, 5, 6, 7], [8, 9, 10]], width=4)


def test_no_view_when_a_buffer_lacks_room(tiny_llama):
    model = tiny_llama.model
    caches = prefilled(model, [[1, 2, 3], [4, 5]])
    assert isinstance(caches[0], BatchKVCache)
    assert caches[0].keys.shape[2] == caches[0].size()  # merged: exactly as long as what it holds
    assert whole_buffer_caches(caches, 2) is None
    grow_buffers(model, caches, mx.array([[1, 2], [3, 4]], mx.uint32))
    room = caches[0].keys.shape[2] - caches[0].size()
    assert whole_buffer_caches(caches, room) is not None
    assert whole_buffer_caches(caches, room + 1) is None
