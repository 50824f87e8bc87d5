"""Which service a model's process runs, by model_type (no Ray here: the in-process backend uses it too). Each
service is imported when a model of its type starts: building an application (`serve run`'s import of
deployments.app, in a process per application) then imports no MLX, mlx-lm or torch."""

from __future__ import annotations

from typing import Any, AsyncIterator

from deployments.config import ModelConfig
from deployments.model_calls import AdapterListing
from deployments.speech_calls import SpeakJob, SpeechAudioEvent, TranscribeJob, TranscriptEvent
from engine.errors import InvalidRequestError


def new_model_service(config: ModelConfig) -> Any:
    """The service a model's replica runs: a chat engine, a sentence-transformers embedder, a speech-to-text engine
    or a voice."""
    if config.model_type == "tts":
        from deployments.speech.voice_service import TextToSpeechService  # the voice's runtime loads with it

        return TextToSpeechService(config)
    if config.model_type == "stt":
        from deployments.speech.service import SpeechService  # MLX and PyAV load with the model

        return SpeechService(config)
    if config.model_type == "embedding":
        from deployments.embeddings.service import EmbeddingService  # numpy only; torch loads with the model

        return EmbeddingService(config)
    from deployments.model.service import ModelService  # the engine (MLX, mlx-lm) loads with a chat model

    return ModelService(config)


async def transcribe_with(service: Any, config: ModelConfig, job: TranscribeJob) -> AsyncIterator[TranscriptEvent]:
    """A speech-to-text model's transcript events; any other model answers a 400 saying what it is."""
    if not hasattr(service, "transcribe"):
        yield TranscriptEvent(error=InvalidRequestError(
            f"The model '{config.id}' is a {config.model_type} model: /v1/audio/transcriptions needs a model of "
            "model_type stt", param="model"))
        return
    async for event in service.transcribe(job):
        yield event


async def speak_with(service: Any, config: ModelConfig, job: SpeakJob) -> AsyncIterator[SpeechAudioEvent]:
    """A text-to-speech model's audio events; any other model answers a 400 saying what it is."""
    if not hasattr(service, "speak"):
        yield SpeechAudioEvent(error=InvalidRequestError(
            f"The model '{config.id}' is a {config.model_type} model: /v1/audio/speech needs a model of "
            "model_type tts", param="model"))
        return
    async for event in service.speak(job):
        yield event


async def adapter_call(service: Any, config: ModelConfig, name: str, path: str | None) -> AdapterListing:
    """Load (`path` given) or unload a text model's per-request adapter (deployments/model/adapters.py); any other
    model's answer is the typed error saying why not."""
    adapters = getattr(service, "adapters", None)
    if adapters is None:
        return AdapterListing(error=InvalidRequestError(
            f"The model '{config.id}' is a {config.model_type} model: LoRA adapters go on text models (model_type lm)",
            param="model"))
    return await (adapters.load(name, path) if path is not None else adapters.unload(name))
