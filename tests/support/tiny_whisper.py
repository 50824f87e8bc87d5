"""A tiny random-weight Whisper (mlx-audio's architecture and layout, Whisper's real multilingual vocabulary) written
as a model folder, and real speech made with espeak-ng."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten, tree_map
from mlx_audio.stt.models.whisper.whisper import Model, ModelDimensions

from engine.speech.default_speech_model import write_whisper_tokenizer

TINY_WHISPER = {
    "model_type": "whisper", "n_mels": 80, "n_audio_ctx": 1500, "n_audio_state": 64, "n_audio_head": 2,
    "n_audio_layer": 1, "n_vocab": 51865, "n_text_ctx": 448, "n_text_state": 64, "n_text_head": 2,
    "n_text_layer": 2,
}


def write_tiny_whisper(folder: Path, seed: int = 0, scale: float = 1.0) -> Path:
    """`scale` multiplies the random matrices: larger makes the next token peakier (greedy ties rarer)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    mx.random.seed(seed)
    model = Model(ModelDimensions.from_dict(TINY_WHISPER), dtype=mx.float32)
    # mlx-audio starts the learned positions at zero (they come with the weights): random ones here, so that a
    # decoder that feeds a token at the wrong position answers differently.
    model.decoder.positional_embedding = mx.random.normal(model.decoder.positional_embedding.shape) * 0.5
    model.update(tree_map(lambda p: p * scale if p.ndim > 1 else p, model.parameters()))
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(folder / "model.safetensors"), weights)
    (folder / "config.json").write_text(json.dumps(TINY_WHISPER))
    write_whisper_tokenizer(folder / "tokenizer.json")
    return folder


def espeak_wav(text: str, path: Path, voice: str = "en-us", words_per_minute: int = 160) -> bytes:
    """`text` spoken by espeak-ng (the Debian package scripts/install.sh installs) as a 22.05 kHz wav."""
    subprocess.run(["espeak-ng", "-v", voice, "-s", str(words_per_minute), "-w", str(path), text], check=True,
                   capture_output=True, timeout=60)
    return Path(path).read_bytes()
