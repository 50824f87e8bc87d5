"""Text to IPA phonemes with the system's libespeak-ng (ctypes; no Python package), as Piper voices were trained on.

espeak-ng's `espeak_TextToPhonemes` drops punctuation, which Piper voices use for pauses and intonation, so the text
is cut at punctuation here and each clause's mark is put back after its phonemes. The library keeps one global
state (the voice), so every call holds one lock.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import re
import threading
import unicodedata

from engine.errors import ModelLoadError

_CHARS_UTF8 = 1  # espeakCHARS_UTF8
_PHONEMES_IPA = 0x02  # espeakPHONEMES_IPA: UTF-8 IPA
_OUTPUT_SYNCHRONOUS = 2  # AUDIO_OUTPUT_SYNCHRONOUS: no sound device is opened
_CLAUSE = re.compile(r"([^.,;:!?]+)([.,;:!?]*)")
_LOCK = threading.Lock()
_library: ctypes.CDLL | None = None
INSTALL_HINT = "espeak-ng's library is not installed (apt-get install libespeak-ng1; brew install espeak-ng)"
# Where the library lies when find_library misses it: Debian's soname, Homebrew on Apple silicon and on Intel.
_CANDIDATES = ["libespeak-ng.so.1", "/opt/homebrew/lib/libespeak-ng.dylib", "/usr/local/lib/libespeak-ng.dylib"]


def _opened(names: list[str | None]) -> ctypes.CDLL:
    errors = []
    for name in filter(None, names):
        try:
            return ctypes.CDLL(name)
        except OSError as exc:
            errors.append(str(exc))
    raise ModelLoadError(f"{INSTALL_HINT}: {'; '.join(errors)[:300]}")


def _espeak() -> ctypes.CDLL:
    global _library
    if _library is None:
        library = _opened([ctypes.util.find_library("espeak-ng"), *_CANDIDATES])
        library.espeak_Initialize.restype = ctypes.c_int
        library.espeak_TextToPhonemes.restype = ctypes.c_char_p
        library.espeak_TextToPhonemes.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, ctypes.c_int]
        if library.espeak_Initialize(_OUTPUT_SYNCHRONOUS, 0, None, 0) < 0:
            raise ModelLoadError("espeak-ng failed to initialise (is espeak-ng-data installed?)")
        _library = library
    return _library


class EspeakPhonemizer:
    """IPA phonemes of one espeak-ng voice ("en-us", "de", ...)."""

    def __init__(self, voice: str) -> None:
        self.voice = voice
        with _LOCK:
            if _espeak().espeak_SetVoiceByName(voice.encode()) != 0:
                raise ModelLoadError(f"espeak-ng has no voice '{voice}'")

    def phonemes(self, text: str) -> str:
        """The text's phonemes (NFD-normalised, as Piper's phoneme maps are), clauses joined by spaces."""
        clauses = []
        with _LOCK:
            library = _espeak()
            library.espeak_SetVoiceByName(self.voice.encode())
            for words, marks in _CLAUSE.findall(text):
                spoken = _clause_phonemes(library, words)
                if spoken or marks:
                    clauses.append(spoken + marks[:1])
        return unicodedata.normalize("NFD", " ".join(clauses))


def _clause_phonemes(library: ctypes.CDLL, words: str) -> str:
    buffer = ctypes.create_string_buffer(words.encode())
    cursor = ctypes.c_void_p(ctypes.addressof(buffer))
    parts = []
    while cursor.value:  # espeak-ng moves the cursor past each piece it phonemised; NULL at the end
        piece = library.espeak_TextToPhonemes(ctypes.byref(cursor), _CHARS_UTF8, _PHONEMES_IPA)
        if piece:
            parts.append(piece.decode("utf-8", "replace").strip())
    return " ".join(p for p in parts if p)
