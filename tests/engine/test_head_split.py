"""The head split computes exactly the model's logits at the chosen positions, and only where it may."""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.utils import _get_classes

from engine.kv.batch_cache import new_request_cache
from engine.models.head_split import HeadSplit, agrees, head_split, logits_at


def test_split_logits_equal_the_model_call_at_the_chosen_positions(tiny_llama):
    model = tiny_llama.model
    split = head_split(model)
    assert split is not None
    tokens = mx.array([[5, 9, 2, 7, 1, 3], [4, 4, 8, 6, 2, 0]], mx.uint32)
    rows, positions = [0, 1, 1], [5, 2, 4]
    whole = logits_at(model, None, tokens, new_request_cache(model), rows, positions)
    parts = logits_at(model, split, tokens, new_request_cache(model), rows, positions)
    assert parts.shape == (3, tiny_llama.vocab_size)
    assert mx.allclose(whole, parts, atol=1e-5, rtol=1e-5).item()
    expected = model(tokens, cache=new_request_cache(model))
    for i, (row, position) in enumerate(zip(rows, positions)):
        assert mx.allclose(parts[i], expected[row, position], atol=1e-5, rtol=1e-5).item()


def test_a_head_that_differs_from_the_call_is_refused(tiny_llama):
    split = head_split(tiny_llama.model)
    scaled = HeadSplit(split.backbone, lambda hidden: split.head(hidden) * 1.01)
    assert not agrees(tiny_llama.model, scaled)


def test_families_with_logit_softcapping_stay_whole():
    config = {
        "model_type": "gemma2", "hidden_size": 32, "num_hidden_layers": 1, "intermediate_size": 64,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16, "rms_norm_eps": 1e-6,
        "vocab_size": 64, "rope_theta": 10000.0, "query_pre_attn_scalar": 16, "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0,
    }
    model_class, args_class = _get_classes(config)
    assert head_split(model_class(args_class.from_dict(config))) is None
