"""One FAISS index + JSON metadata per document, each in its own folder, published by one atomic rename.

Layout: <root>/<file_id>/{index.faiss, meta.json}. A document is written into <root>/.tmp-<file_id>-<nonce>/,
each file fsynced, then the folder is renamed to <root>/<file_id>: a crash leaves either no document or a whole one,
and the .tmp-* / .trash-* leftovers are removed at the next start. file_id is the sha256 of the uploaded bytes.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

import faiss
import numpy as np

from deployments.rag_calls import DocumentInfo, DocumentNotFoundError, SearchHit
from engine.errors import InvalidRequestError

from .chunking import Chunk

logger = logging.getLogger(__name__)

META_FILE = "meta.json"
INDEX_FILE = "index.faiss"
META_VERSION = 1
_TEMP_PREFIX = ".tmp-"
_TRASH_PREFIX = ".trash-"


def default_root() -> Path:
    """$ORCHARD_HOME/rag, else ~/.cache/orchard/rag."""
    home = os.environ.get("ORCHARD_HOME")
    return Path(home) / "rag" if home else Path.home() / ".cache" / "orchard" / "rag"


@dataclass(frozen=True)
class BrokenEntry:
    """A document folder found at start that could not be loaded; it stays on disk and is not served."""

    path: Path
    reason: str


@dataclass
class _Document:
    info: DocumentInfo
    chunks: list[Chunk]
    index: faiss.IndexFlatIP


class DocumentStore:
    """Thread-safe: a lock per document serialises its add / delete; searches read a consistent snapshot."""

    def __init__(self, root: Path | None = None) -> None:
        self.root = Path(root) if root is not None else default_root()
        self.root.mkdir(parents=True, exist_ok=True)
        self.broken: list[BrokenEntry] = []
        self._documents: dict[str, _Document] = {}
        self._documents_lock = threading.Lock()
        self._file_locks: dict[str, threading.Lock] = {}
        self._load_all()

    # ---- reading

    def get(self, file_id: str) -> DocumentInfo | None:
        document = self._documents.get(file_id)
        return document.info if document else None

    def list_documents(self) -> list[DocumentInfo]:
        with self._documents_lock:
            infos = [document.info for document in self._documents.values()]
        return sorted(infos, key=lambda info: (info.created_at, info.file_id))

    def search(self, file_ids: list[str], query_vector: np.ndarray, top_k: int) -> list[SearchHit]:
        """The top_k chunks over the given documents, best first (ties broken by file, then chunk)."""
        if not file_ids:
            raise InvalidRequestError("file_ids must name at least one document", param="file_id")
        if top_k < 1:
            raise InvalidRequestError(f"top_k must be >= 1, got {top_k}", param="top_k")
        with self._documents_lock:
            missing = [file_id for file_id in file_ids if file_id not in self._documents]
            documents = [self._documents[file_id] for file_id in dict.fromkeys(file_ids) if file_id not in missing]
        if missing:
            raise DocumentNotFoundError(f"no document with file_id {missing[0]!r}", param="file_id")
        query = np.ascontiguousarray(np.asarray(query_vector, dtype=np.float32).reshape(1, -1))
        hits: list[SearchHit] = []
        for document in documents:
            if query.shape[1] != document.index.d:
                raise InvalidRequestError(
                    f"query vector has {query.shape[1]} dimensions; document {document.info.file_id!r} "
                    f"was indexed with {document.index.d}",
                    param="query",
                )
            scores, positions = document.index.search(query, min(top_k, document.index.ntotal))
            for score, position in zip(scores[0], positions[0], strict=True):
                chunk = document.chunks[int(position)]
                hits.append(SearchHit(document.info.file_id, document.info.filename, chunk.page, chunk.index,
                                      chunk.text, float(score)))
        hits.sort(key=lambda hit: (-hit.score, hit.file_id, hit.chunk))
        return hits[:top_k]

    # ---- writing

    def file_lock(self, file_id: str) -> threading.Lock:
        with self._documents_lock:
            return self._file_locks.setdefault(file_id, threading.Lock())

    def add(self, info: DocumentInfo, chunks: list[Chunk], vectors: np.ndarray) -> tuple[DocumentInfo, bool]:
        """Writes and publishes the document; (info, True), or (the stored info, False) when file_id is already held."""
        vectors = np.ascontiguousarray(vectors, dtype=np.float32)
        if vectors.ndim != 2 or vectors.shape[0] != len(chunks) or not chunks:
            raise ValueError(f"need one vector row per chunk: {vectors.shape} for {len(chunks)} chunks")
        with self.file_lock(info.file_id):
            existing = self.get(info.file_id)
            if existing is not None:
                return existing, False
            index = faiss.IndexFlatIP(vectors.shape[1])
            index.add(vectors)
            self._write(info, chunks, index)
            with self._documents_lock:
                self._documents[info.file_id] = _Document(info, chunks, index)
                self.broken = [entry for entry in self.broken if entry.path.name != info.file_id]
        return info, True

    def delete(self, file_id: str) -> DocumentInfo:
        with self.file_lock(file_id):
            with self._documents_lock:
                document = self._documents.pop(file_id, None)
            if document is None:
                raise DocumentNotFoundError(f"no document with file_id {file_id!r}", param="file_id")
            self._remove_folder(self.root / file_id)
        return document.info

    def _write(self, info: DocumentInfo, chunks: list[Chunk], index: faiss.IndexFlatIP) -> None:
        temp = self.root / f"{_TEMP_PREFIX}{info.file_id}-{uuid.uuid4().hex}"
        temp.mkdir()
        try:
            faiss.write_index(index, str(temp / INDEX_FILE))
            _fsync_file(temp / INDEX_FILE)
            meta = {"version": META_VERSION, "document": asdict(info), "dimension": index.d,
                    "chunks": [asdict(chunk) for chunk in chunks]}
            (temp / META_FILE).write_text(json.dumps(meta, ensure_ascii=False), encoding="utf-8")
            _fsync_file(temp / META_FILE)
            _fsync_file(temp)
            target = self.root / info.file_id
            if target.exists() or target.is_symlink():  # a broken leftover of this id (reported at start): replaced
                self._remove_folder(target)
            os.replace(temp, target)
        except BaseException:
            shutil.rmtree(temp, ignore_errors=True)
            raise
        try:
            _fsync_file(self.root)
        except BaseException:
            # The caller is told the upload failed and the document is not served: it must not come back at start.
            self._remove_folder(target)
            raise

    def _remove_folder(self, folder: Path) -> None:
        # Renamed away first so that a crash mid-delete never leaves a half folder under the document's name.
        trash = self.root / f"{_TRASH_PREFIX}{folder.name}-{uuid.uuid4().hex}"
        os.replace(folder, trash)
        _fsync_file(self.root)
        if trash.is_dir() and not trash.is_symlink():
            shutil.rmtree(trash, ignore_errors=True)
        else:  # a broken entry that is a file or a link: rmtree refuses both, which left it behind
            trash.unlink(missing_ok=True)

    # ---- start

    def _load_all(self) -> None:
        for path in sorted(self.root.iterdir()):
            if path.name.startswith((_TEMP_PREFIX, _TRASH_PREFIX)):
                logger.info("rag store: removing the leftover %s of an interrupted write", path)
                if path.is_dir():
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    path.unlink(missing_ok=True)
                continue
            try:
                document = _read_document(path)
            except (OSError, ValueError, KeyError, TypeError, RuntimeError) as exc:
                logger.warning("rag store: skipping %s: %s", path, exc)
                self.broken.append(BrokenEntry(path, str(exc)))
                continue
            self._documents[document.info.file_id] = document


def _read_document(folder: Path) -> _Document:
    if not folder.is_dir():
        raise ValueError("not a document folder")
    meta = json.loads((folder / META_FILE).read_text(encoding="utf-8"))
    if meta.get("version") != META_VERSION:
        raise ValueError(f"metadata version {meta.get('version')!r}, expected {META_VERSION}")
    info = DocumentInfo(**meta["document"])
    if info.file_id != folder.name:
        raise ValueError(f"metadata names file_id {info.file_id!r}, folder is {folder.name!r}")
    chunks = [Chunk(**chunk) for chunk in meta["chunks"]]
    # faiss raises RuntimeError on a missing or truncated file.
    index = faiss.read_index(str(folder / INDEX_FILE))
    if index.ntotal != len(chunks) or index.d != meta["dimension"]:
        raise ValueError(f"index holds {index.ntotal} vectors of {index.d} dims; metadata {len(chunks)} chunks")
    return _Document(info, chunks, index)


def _fsync_file(path: Path) -> None:
    """fsync a file or a folder (a folder's fsync makes the renames inside it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
