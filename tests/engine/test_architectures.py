"""Every mlx-lm cache type batches through the same protocol: sliding-window and hybrid models too."""

from __future__ import annotations

import pytest

from engine import EngineConfig, EngineCore, Request
from engine.models.loader import load_model
from tests.engine.test_batching import assert_same_stream, params, random_prompts, run_alone
from tests.support.drive import Arrival, run_core
from tests.support.tiny_models import write_model

GEMMA3_SLIDING = {
    "model_type": "gemma3_text",
    "hidden_size": 64,
    "num_hidden_layers": 3,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "query_pre_attn_scalar": 16,
    "sliding_window": 8,  # far shorter than the prompts, so the rotating caches wrap
    "sliding_window_pattern": 3,
    "max_position_embeddings": 2048,
    "vocab_size": 256,
}

QWEN3_NEXT_HYBRID = {
    "model_type": "qwen3_next",
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "linear_num_value_heads": 4,
    "linear_num_key_heads": 2,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "decoder_sparse_step": 1,
    "shared_expert_intermediate_size": 64,
    "mlp_only_layers": [],
    "moe_intermediate_size": 32,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "partial_rotary_factor": 0.25,
    "max_position_embeddings": 2048,
    "full_attention_interval": 2,
    "vocab_size": 256,
}


@pytest.fixture(scope="module", params=["gemma3_sliding", "qwen3_next_hybrid"])
def arch_model(request, tmp_path_factory, wordlevel_tokenizer_dir):
    config = {"gemma3_sliding": GEMMA3_SLIDING, "qwen3_next_hybrid": QWEN3_NEXT_HYBRID}[request.param]
    folder = write_model(tmp_path_factory.mktemp(request.param), config, wordlevel_tokenizer_dir, scale=3.0)
    return load_model(folder)


def test_staggered_batch_matches_alone(arch_model):
    prompts = random_prompts(6, seed=11, max_len=30)
    arrivals = [Arrival(i, Request(f"r{i}", prompts[i], params(i, max_tokens=14))) for i in range(6)]
    core = EngineCore(arch_model, EngineConfig(prefill_chunk_tokens=8, max_prefill_seqs=2))
    batched = run_core(core, arrivals)
    for i in range(6):
        alone = run_alone(arch_model, f"r{i}", prompts[i], params(i, max_tokens=14))
        assert_same_stream(alone, batched[f"r{i}"])


def test_chunked_prefill_matches_one_shot(arch_model):
    prompt = random_prompts(1, seed=5, max_len=10)[0] + list(range(30))
    sampling = params(0, max_tokens=8)
    one_shot = run_alone(arch_model, "a", prompt, sampling, prefill_chunk_tokens=0)
    chunked = run_alone(arch_model, "a", prompt, sampling, prefill_chunk_tokens=7)
    assert_same_stream(one_shot, chunked)
