"""The docs' Python client code, copied line for line into functions (comments, prints and all): this is how the
conformance tests read Orchard's answers. A snippet's `requests` is the caller's (BodegaServer.requests, a
`requests.Session` that reaches Orchard at http://localhost:44468); what it prints is captured by `run`.

Where the docs elide a value (`json={...}` at L840, a `file_id` from an earlier upload) the function takes it as an
argument; nothing else differs from the docs' text.
"""

from __future__ import annotations

import base64
import contextlib
import io
import json
from dataclasses import dataclass
from typing import Any, Callable


@dataclass
class Ran:
    value: Any  # what the snippet left for the test (its responses, its parsed results)
    printed: str


def run(snippet: Callable[..., Any], *args: Any) -> Ran:
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        value = snippet(*args)
    return Ran(value, printed.getvalue())


def quick_start(requests) -> tuple[Any, Any]:
    """L131-155 (E11, E12): load without model_id, then chat."""
    BASE_URL = "http://localhost:44468"
    # Load a model
    response = requests.post(
        f"{BASE_URL}/v1/admin/load-model",
        json={
            "model_path": "SRSWTI/bodega-raptor-8b-mxfp4",
            "model_type": "lm",
            "context_length": 32768
        }
    )
    print(response.json())
    loaded = response
    # Chat completion
    response = requests.post(
        f"{BASE_URL}/v1/chat/completions",
        json={
            "model": "bodega-raptor-8b",
            "messages": [
                {"role": "user", "content": "Explain quantum computing in simple terms."}
            ],
            "max_tokens": 500,
            "temperature": 0.7
        }
    )
    print(response.json()["choices"][0]["message"]["content"])
    return loaded, response


def stream_story(requests) -> Any:
    """L176-196 (E15): a streamed chat read by the docs' SSE loop."""
    response = requests.post(
        "http://localhost:44468/v1/chat/completions",
        json={
            "model": "bodega-raptor-8b",
            "messages": [
                {"role": "user", "content": "Write a short story about AI."}
            ],
            "stream": True
        },
        stream=True
    )
    print_stream(response)
    return response


def print_stream(response) -> None:
    """L185-196, the docs' stream parser (also what L283 and L866 point to: "identical to ... chat completions")."""
    for line in response.iter_lines():
        if line:
            line = line.decode('utf-8')
            if line.startswith('data: '):
                data = line[6:]
                if data != '[DONE]':
                    chunk = json.loads(data)
                    content = chunk["choices"][0]["delta"].get("content", "")
                    if content:
                        print(content, end="", flush=True)


ADDRESS_SCHEMA = {  # L249-268
    "type": "json_schema",
    "json_schema": {
        "name": "AddressExtractor",
        "schema": {
            "type": "object",
            "properties": {
                "address": {
                    "type": "object",
                    "properties": {
                        "street": {"type": "string"},
                        "city": {"type": "string"},
                        "state": {"type": "string", "description": "2 letter abbreviation"},
                        "zip": {"type": "string", "description": "5 digit zip code"}
                    },
                    "required": ["street", "city", "state", "zip"]
                }
            },
            "required": ["address"]
        }
    }
}


def extract_address(requests, stream: bool) -> Any:
    """L248-281 (E18), and with "stream": true as L283 says it also works (E19: read with the docs' stream loop)."""
    schema = ADDRESS_SCHEMA
    response = requests.post(
        "http://localhost:44468/v1/chat/completions",
        json={
            "model": "bodega-raptor-8b",
            "messages": [
                {"role": "system", "content": "Extract the address from the user input into the specified JSON format."},
                {"role": "user", "content": "Please format this address: 1 Hacker Wy Menlo Park CA 94025"}
            ],
            "response_format": schema,
            "stream": stream
        }
    )
    if stream:
        print_stream(response)
        return response
    # Returns: '{"address": {"street": "1 Hacker Wy", "city": "Menlo Park", "state": "CA", "zip": "94025"}}'
    print(response.json()["choices"][0]["message"]["content"])
    return response


def describe_scan(requests) -> Any:
    """L309-332 (E21): a local image as a base64 data URL (document_scan.png in the working directory)."""
    def encode_image(image_path):
        with open(image_path, "rb") as image_file:
            return base64.b64encode(image_file.read()).decode('utf-8')

    base64_image = encode_image("document_scan.png")
    response = requests.post(
        "http://localhost:44468/v1/chat/completions",
        json={
            "model": "bodega-solomon-9b",
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "Extract all text from this scanned document."},
                        {
                            "type": "image_url",
                            "image_url": {"url": f"data:image/png;base64,{base64_image}"}
                        }
                    ]
                }
            ]
        }
    )
    print(response.json()["choices"][0]["message"]["content"])
    return response


def load_with_qwen3_parsers(requests) -> Any:
    """L399-410 (E29)."""
    response = requests.post(
        "http://localhost:44468/v1/admin/load-model",
        json={
            "model_path": "SRSWTI/bodega-raptor-8b-mxfp4",
            "model_type": "lm",
            "context_length": 32768,
            "max_concurrency": 1,
            "reasoning_parser": "qwen3",
            "tool_call_parser": "qwen3"
        }
    )
    print(response.json())
    return response


def unload_raptor_09b(requests) -> Any:
    """L490-491 (E33)."""
    response = requests.delete("http://localhost:44468/v1/admin/unload-model/bodega-raptor-0.9b")
    print(response.json())
    return response


def delete_cached_raptor(requests) -> Any:
    """L498-499 (E34)."""
    model_id = "SRSWTI/bodega-raptor-8b-mxfp4"
    response = requests.delete(f"http://localhost:44468/v1/models/local/{model_id}")
    print(response.json())
    return response


def print_loaded_models(requests) -> list[Any]:
    """L502-508 (E35)."""
    response = requests.get("http://localhost:44468/v1/admin/loaded-models")
    models = response.json().get("data", [])
    for model in models:
        print(f"[{model['status'].upper()}] {model['id']} — PID: {model['pid']}")
        mem = model.get('memory', {})
        print(f"  └ Metal Active (GPU): {mem.get('metal_active_mb', 0):.1f} MB")
        print(f"  └ Process RSS overhead (CPU): {mem.get('rss_mb', 0):.1f} MB")
        print(f"  └ Total System Pool: {mem.get('total_mb', 0):.1f} MB\n")
    return models


def download_with_progress(requests) -> list[dict[str, Any]]:
    """L555-567 (E38); returns the events it printed."""
    events = []
    response = requests.post(
        "http://localhost:44468/v1/admin/download-model-stream",
        json={"model_path": "SRSWTI/bodega-raptor-8b-mxfp4"},
        stream=True
    )
    for line in response.iter_lines():
        if line:
            line = line.decode('utf-8')
            if line.startswith('data: ') and line[6:] != '[DONE]':
                progress = json.loads(line[6:])
                events.append(progress)
                print(f"{progress['status']} — {progress.get('progress', 0)}%")
                if 'current_file' in progress:
                    print(f"  File: {progress['current_file']}")
    return events


def think_through_puzzle(requests) -> dict[str, Any]:
    """L576-586 (E40); returns the message it read."""
    response = requests.post(
        "http://localhost:44468/v1/chat/completions",
        json={
            "model": "bodega-raptor-8b",
            "messages": [{"role": "user", "content": "Solve this logic puzzle: ..."}],
            "chat_template_kwargs": {"enable_thinking": True}
        }
    )
    message = response.json()["choices"][0]["message"]
    if "reasoning_content" in message:
        print("Thinking:", message["reasoning_content"])
    print("Answer:", message["content"])
    return message


def three_colors(requests) -> Any:
    """L588-600 (E41); returns the parsed JSON."""
    response = requests.post(
        "http://localhost:44468/v1/chat/completions",
        json={
            "model": "bodega-raptor-8b",
            "messages": [
                {"role": "system", "content": "You are a helpful assistant that outputs JSON."},
                {"role": "user", "content": "List three colors with their hex codes."}
            ],
            "response_format": {"type": "json_object"}
        }
    )
    result = json.loads(response.json()["choices"][0]["message"]["content"])
    print(result)
    return result


def print_queue_stats(requests) -> dict[str, Any]:
    """L816-818 (E51)."""
    response = requests.get("http://localhost:44468/v1/queue/stats")
    stats = response.json()["queue_stats"]
    print(f"Queue size: {stats.get('queue_size', 0)}")
    print(f"Active requests: {stats.get('active_requests', 0)}")
    return stats


def handle_errors(requests, body: dict[str, Any]) -> Any:
    """L840-848 (E52): the docs elide the body (`json={...}`); the caller gives it."""
    result = None
    response = requests.post("http://localhost:44468/v1/chat/completions", json=body)
    if response.status_code == 503:
        print("No model loaded. Load a model first.")
    elif response.status_code == 400:
        print("Invalid request parameters.")
    elif response.status_code == 200:
        result = response.json()
    else:
        print(f"Error: {response.status_code}")
    return response, result
