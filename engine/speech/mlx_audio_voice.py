"""One of mlx-audio's text-to-speech models (the folder's config.json names it: kitten_tts, kokoro, ...) as a
Synthesizer. mlx-audio's generate() already cuts a long text into chunks; Orchard hands it a sentence at a time, so
every model streams sentence by sentence the same way."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Iterator

import numpy as np

from engine.errors import ModelLoadError
from engine.speech.synthesis import SpeechSpec, SpokenPiece, text_pieces

DEFAULT = "default"  # the voice name of a model that has no named voices


class MlxAudioVoice:
    def __init__(self, folder: Path) -> None:
        from mlx_audio.tts.utils import load_model

        try:
            self.model = load_model(str(folder))
        except (ValueError, KeyError, FileNotFoundError, ImportError) as exc:
            raise ModelLoadError(f"{folder}: not a text-to-speech model mlx-audio can load ({exc})"[:500]) from exc
        self.path = folder
        self.sample_rate = int(getattr(self.model, "sample_rate", 24_000))
        self.voices = _voices(self.model)

    def pieces(self, spec: SpeechSpec) -> Iterator[SpokenPiece]:
        options = {"speed": spec.speed}
        if spec.voice != DEFAULT:
            options["voice"] = spec.voice
        for text in text_pieces(spec.text):
            for result in self.model.generate(text=text, **options):
                samples = np.asarray(result.audio, dtype=np.float32).reshape(-1)
                yield SpokenPiece(np.clip(samples, -1.0, 1.0), int(getattr(result, "token_count", 0) or 0))


def _voices(model) -> tuple[str, ...]:
    """The model's named voices (its generate()'s default voice first, then its aliases), or ("default",)."""
    named = sorted(getattr(model, "voices", None) or ())
    if not named:
        return (DEFAULT,)
    aliases = sorted(getattr(model, "voice_aliases", None) or ())
    default = inspect.signature(model.generate).parameters.get("voice")
    first = default.default if default is not None and default.default in named else named[0]
    return (first, *[v for v in named + aliases if v != first])
