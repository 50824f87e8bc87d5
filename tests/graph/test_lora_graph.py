"""Per-request LoRA adapters through the real graph: admin load-adapter on two models, the openai client choosing
'MODEL:NAME'. Alpha streams over its replica's stream channel; beta through Ray's handle, where the adapter rides
Serve's model multiplexing (multiplexed_model_id, the replica's serve.multiplexed loader). The graph is left as it
was found (tests/serve/test_lora_local.py and tests/engine/test_lora.py check the answers against fused adapters)."""

from __future__ import annotations

import pytest

from engine.models.loader import load_model
from tests.graph.shared_graph import ALPHA, BETA
from tests.support.tiny_adapters import random_lora, write_mlx_lm_adapter

ADAPTER = "style"
PROMPT = [{"role": "user", "content": "t5 t9 t13 t21"}]


@pytest.fixture()
def adapter_folder(tiny_models):
    """Under the graph's model_roots (the tiny models' folder), as an admin load requires."""
    return write_mlx_lm_adapter(tiny_models.alpha.parent / "adapters" / ADAPTER,
                                random_lora(load_model(tiny_models.alpha).model, 4, 21), scale=2.0)


def test_the_openai_client_chooses_adapters_by_model_id(shared_graph, adapter_folder):
    http, client = shared_graph.http(), shared_graph.openai()
    ids = [f"{model}:{ADAPTER}" for model in (ALPHA, BETA)]
    try:
        for model in (ALPHA, BETA):
            loaded = http.post("/v1/admin/load-adapter", json={"model": model, "adapter": ADAPTER,
                                                               "path": str(adapter_folder)})
            assert loaded.status_code == 200, loaded.text
        cards = {m.id: m for m in client.models.list().data}
        assert all(cards[i].parent == model for i, model in zip(ids, (ALPHA, BETA)))
        for model, adapted in zip((ALPHA, BETA), ids):
            base = client.chat.completions.create(model=model, messages=PROMPT, max_tokens=8, temperature=0)
            whole = client.chat.completions.create(model=adapted, messages=PROMPT, max_tokens=8, temperature=0)
            chunks = list(client.chat.completions.create(model=adapted, messages=PROMPT, max_tokens=8, temperature=0,
                                                         stream=True))
            streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            assert whole.model == adapted and streamed == whole.choices[0].message.content
            assert whole.choices[0].message.content != base.choices[0].message.content
    finally:
        for model in (ALPHA, BETA):
            http.post("/v1/admin/unload-adapter", json={"model": model, "adapter": ADAPTER})
    assert client.models.list().data and not any(m.id in ids for m in client.models.list().data)
