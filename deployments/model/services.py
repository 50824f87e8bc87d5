"""Which service a model's process runs, by model_type (no Ray here: the in-process backend uses it too). Each
service is imported when a model of its type starts: building an application (`serve run`'s import of
deployments.app, in a process per application) then imports no MLX, mlx-lm or torch."""

from __future__ import annotations

from typing import Any, AsyncIterator

from deployments.config import ModelConfig
from deployments.image_calls import ImageEvent, ImageJob
from deployments.model_calls import AdapterListing
from deployments.speech_calls import SpeakJob, SpeechAudioEvent, TranscribeJob, TranscriptEvent
from engine.errors import InvalidRequestError


def new_model_service(config: ModelConfig) -> Any:
    """The service a model's replica runs: a chat engine, a sentence-transformers embedder, a speech-to-text engine,
    a voice or an image model."""
    if config.is_image_model:
        from deployments.images.service import ImageService  # mflux and MLX load with the model

        return ImageService(config)
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


def transcribe_with(service: Any, config: ModelConfig, job: TranscribeJob) -> AsyncIterator[TranscriptEvent]:
    """A speech-to-text model's transcript events; any other model answers a 400 saying what it is."""
    return _route_events(service, config, "transcribe", job, TranscriptEvent,
                         "/v1/audio/transcriptions needs a model of model_type stt")


def speak_with(service: Any, config: ModelConfig, job: SpeakJob) -> AsyncIterator[SpeechAudioEvent]:
    """A text-to-speech model's audio events; any other model answers a 400 saying what it is."""
    return _route_events(service, config, "speak", job, SpeechAudioEvent,
                         "/v1/audio/speech needs a model of model_type tts")


def images_with(service: Any, config: ModelConfig, job: ImageJob) -> AsyncIterator[ImageEvent]:
    """An image model's events; any other model answers a 400 saying what it is."""
    return _route_events(service, config, "generate_images", job, ImageEvent,
                         "the image routes need a model of model_type image-generation or image-edit")


async def _route_events(service: Any, config: ModelConfig, method: str, job: Any, event_type: type,
                        needs: str) -> AsyncIterator[Any]:
    if not hasattr(service, method):
        yield event_type(error=InvalidRequestError(f"The model '{config.id}' is a {config.model_type} model: {needs}",
                                                   param="model"))
        return
    async for event in getattr(service, method)(job):
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
