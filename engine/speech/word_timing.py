"""Word times for a decoded window, as OpenAI's Whisper finds them: one decoder pass over the window's text (no
timestamps) gives the cross-attention of the alignment heads; their normalised, median-filtered weights, aligned to
the audio frames by dynamic time warping, say when each token was heard, and a word spans its tokens."""

from __future__ import annotations

import string

import mlx.core as mx
import numpy as np
from mlx_audio.stt.models.whisper.timing import WordTiming, dtw, median_filter, merge_punctuations

from engine.speech.requests import WordTime

TOKENS_PER_SECOND = 50  # the encoder's positions: 1,500 per 30 s
MEDIAN_FILTER_WIDTH = 7
NO_SPACE_LANGUAGES = {"zh", "ja", "th", "lo", "my", "yue"}
PREPEND_PUNCTUATIONS = "\"'\u201c\u00bf([{-"
APPEND_PUNCTUATIONS = "\"'.\u3002,\uff0c!\uff01?\uff1f:\uff1a\u201d)]}\u3001"


def window_words(whisper, features: mx.array, sot_sequence: list[int], text_tokens: list[int], language: str,
                 audio_s: float) -> list[WordTime]:
    """The words of one window's text tokens with their times from the window's start."""
    if not text_tokens:
        return []
    t = whisper.tokens
    tokens = [*sot_sequence, t.no_timestamps, *text_tokens, t.eot]
    logits, _, cross_qk = whisper.model.decoder(mx.array([tokens]), features[None])
    probabilities = mx.softmax(logits[0, len(sot_sequence):-2, :t.eot].astype(mx.float32), axis=-1)
    token_probs = np.array(mx.take_along_axis(probabilities, mx.array(text_tokens)[:, None], axis=1)[:, 0])
    heads = whisper.model.alignment_heads.tolist()
    weights = mx.stack([cross_qk[layer][0, head] for layer, head in heads])
    weights = mx.softmax(weights[:, :, :max(int(audio_s * TOKENS_PER_SECOND), 1)].astype(mx.float32), axis=-1)
    mean = mx.mean(weights, axis=-2, keepdims=True)
    std = mx.sqrt(mx.var(weights, axis=-2, keepdims=True))
    weights = median_filter((weights - mean) / (std + 1e-9), MEDIAN_FILTER_WIDTH)
    matrix = np.array(mx.mean(weights, axis=0))[len(sot_sequence):-1]  # the no-timestamps row, then the text's
    text_indices, time_indices = dtw(-matrix)
    jumps = np.pad(np.diff(text_indices), (1, 0), constant_values=1).astype(bool)
    jump_times = time_indices[jumps] / TOKENS_PER_SECOND
    words, word_tokens = split_words(whisper.decode_text, text_tokens, language)
    bounds = np.pad(np.cumsum([len(w) for w in word_tokens]), (1, 0))
    timings = [WordTiming(word, tokens_of, float(jump_times[a]), float(jump_times[b]),
                          float(np.mean(token_probs[a:b])))
               for word, tokens_of, a, b in zip(words, word_tokens, bounds[:-1], bounds[1:])]
    merge_punctuations(timings, PREPEND_PUNCTUATIONS, APPEND_PUNCTUATIONS)
    return [WordTime(w.word, round(w.start, 2), round(max(w.end, w.start), 2), round(w.probability, 4))
            for w in timings if w.word]


def split_words(decode, tokens: list[int], language: str) -> tuple[list[str], list[list[int]]]:
    """Words and their tokens: whole characters first (a character may take several tokens), then a new word at a
    leading space or a punctuation mark (per character in languages written without spaces)."""
    pieces: list[str] = []
    piece_tokens: list[list[int]] = []
    pending: list[int] = []
    for token in tokens:
        pending.append(token)
        text = decode(pending)
        if "\ufffd" not in text:
            pieces.append(text)
            piece_tokens.append(pending)
            pending = []
    if pending:
        pieces.append(decode(pending))
        piece_tokens.append(pending)
    if language in NO_SPACE_LANGUAGES:
        return pieces, piece_tokens
    words: list[str] = []
    word_tokens: list[list[int]] = []
    for text, owned in zip(pieces, piece_tokens):
        if not words or text.startswith(" ") or text.strip() in string.punctuation:
            words.append(text)
            word_tokens.append(list(owned))
        else:
            words[-1] += text
            word_tokens[-1].extend(owned)
    return words, word_tokens
