"""KVBlockStore.request_cache with a media tail (kv/cache_manager.py's match_media_tail): the last block's first
positions only, in plain and quantized KV, equal to the same positions of the cache the blocks were cut from."""

from __future__ import annotations

import mlx.core as mx
import pytest

from engine.kv.batch_cache import new_request_cache
from engine.kv.block_store import KVBlockStore
from engine.kv.cache_manager import PrefixCache
from engine.kv.quantization import KVQuantization
from engine.models.loader import load_model
from tests.support.tiny_models import LLAMA, write_model

BLOCK = 8


@pytest.fixture(scope="module")
def wide_heads(tmp_path_factory, wordlevel_tokenizer_dir):
    """A tiny llama whose 64-wide heads MLX can quantize in groups of 32."""
    config = dict(LLAMA, vocab_size=256, head_dim=64)
    return load_model(write_model(tmp_path_factory.mktemp("wide-heads"), config, wordlevel_tokenizer_dir))


@pytest.mark.parametrize("quantization", [None, KVQuantization(8, 32)], ids=["plain", "quantized"])
def test_the_tail_blocks_first_positions_equal_the_source_cache(wide_heads, quantization):
    model = wide_heads.model
    tokens = list(range(1, 3 * BLOCK + 3))
    source = new_request_cache(model, quantization)
    model(mx.array([tokens]), cache=source)
    store = KVBlockStore(model, PrefixCache(BLOCK, capacity_bytes=1 << 30), quantization)
    store.insert(tokens, source)
    store.flush()
    hashes = [block.block_hash for block in store.cache.match(tokens)]
    assert len(hashes) == 3
    rebuilt = store.request_cache(hashes, tail_tokens=5)
    for made, original in zip(rebuilt, source):
        assert made.offset == 2 * BLOCK + 5
        for ours, theirs in zip(made.state[:2], original.state[:2]):
            for part, whole in (zip(ours, theirs) if quantization is not None else [(ours, theirs)]):
                assert mx.array_equal(part[..., : 2 * BLOCK + 5, :], whole[..., : 2 * BLOCK + 5, :])
