"""Image generation through the real graph (the session's shared graph on Ray Serve): a tiny random FLUX.2 [klein]
(model_type image-generation) as its own application, reached by the `openai` client's images.generate over HTTP,
its progress and images crossing Ray's handle stream; listed with its type and memory."""

from __future__ import annotations

import base64
import io

from PIL import Image

from tests.graph.shared_graph import IMAGES as MODEL


def test_openai_images_through_ray_with_progress_and_the_same_image_streamed(shared_graph):
    client = shared_graph.openai(timeout=180)
    whole = client.images.generate(model=MODEL, prompt="a puffin", size="64x64", extra_body={"seed": 9, "steps": 2})
    with shared_graph.http(timeout=180) as http:
        streamed = http.post("/v1/images/generations", json={"model": MODEL, "prompt": "a puffin", "size": "64x64",
                                                             "seed": 9, "steps": 2, "stream": True})
        listed = {m["id"]: m for m in http.get("/v1/admin/loaded-models").json()["data"]}
    assert Image.open(io.BytesIO(base64.b64decode(whole.data[0].b64_json))).size == (64, 64)
    lines = streamed.text.splitlines()
    assert ": image 1 of 1, step 2 of 2" in lines
    completed = [line for line in lines if line.startswith("data: ")]
    assert len(completed) == 1 and whole.data[0].b64_json in completed[0]
    assert listed[MODEL]["type"] == "image-generation" and listed[MODEL]["memory"]["total_mb"] > 0
