"""A Whisper model folder (mlx-audio's layout) loaded for the speech engine: mlx-audio's Model, our vocabulary view,
and the log-mel features of 30 s windows. float32 on the CPU (float16 there is ~5x slower and wanders off the
audio, measured on Whisper base), float16 on a GPU, as Whisper was trained."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten
from mlx_audio.stt.models.whisper.audio import HOP_LENGTH, N_FRAMES, N_SAMPLES, log_mel_spectrogram
from mlx_audio.stt.models.whisper.whisper import Model, ModelDimensions

from engine.speech.whisper_tokens import WhisperTokens, load_tokenizer, whisper_tokens

WINDOW_SAMPLES = N_SAMPLES  # 30 s at 16 kHz: what the encoder reads at once
WINDOW_FRAMES = N_FRAMES  # its 3,000 mel frames (the encoder halves them: 1,500 audio positions)


@dataclass
class LoadedWhisper:
    model: Model
    tokens: WhisperTokens
    tokenizer: object  # tokenizers.Tokenizer
    dtype: mx.Dtype
    path: Path

    @property
    def dims(self) -> ModelDimensions:
        return self.model.dims

    def decode_text(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode([t for t in token_ids if t < self.tokens.eot])

    def encode_text(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids


def default_dtype() -> mx.Dtype:
    return mx.float16 if mx.default_device() == mx.gpu else mx.float32


def load_whisper(folder: Path, dtype: mx.Dtype | None = None) -> LoadedWhisper:
    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text())
    if config.get("model_type", "whisper") != "whisper":
        raise ValueError(f"{folder}: model_type '{config.get('model_type')}' is not whisper")
    dtype = dtype or default_dtype()
    model = Model(ModelDimensions.from_dict(config), dtype=dtype)
    weights = mx.load(str(folder / "model.safetensors"))
    weights = model.sanitize(weights)  # HF names, conv layout, the model's dtype
    expected = {name for name, _ in tree_flatten(model.parameters())}
    missing = sorted(expected - set(weights))
    if missing:
        raise ValueError(f"{folder}: weights missing for {', '.join(missing[:3])}")
    model.update(tree_unflatten([(k, v) for k, v in weights.items() if k in expected]))
    mx.eval(model.parameters())
    generation = folder / "generation_config.json"
    if generation.is_file():  # the heads whose cross-attention follows the audio (word times); else the upper half
        heads = json.loads(generation.read_text()).get("alignment_heads")
        if heads:
            model.set_alignment_heads(heads)
    tokenizer = load_tokenizer(folder)
    return LoadedWhisper(model, whisper_tokens(tokenizer, model.dims.n_vocab), tokenizer, dtype, folder)


def window_mel(samples: np.ndarray, n_mels: int) -> mx.array:
    """One window's log-mel features, (WINDOW_FRAMES, n_mels), as OpenAI's transcribe() makes them: the audio's
    frames, then zero frames to 30 s (zeros, not the features of silence: on Whisper base, "Hello world" came out
    as "The Low World" with the latter)."""
    samples = samples[:WINDOW_SAMPLES]
    mel = log_mel_spectrogram(mx.array(samples), n_mels=n_mels, padding=WINDOW_SAMPLES)
    frames = min(len(samples) // HOP_LENGTH, WINDOW_FRAMES)
    return mx.pad(mel[:frames], [(0, WINDOW_FRAMES - frames), (0, 0)])
