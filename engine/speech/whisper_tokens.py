"""Whisper's vocabulary as the decoder uses it: the special tokens' ids, the language tokens, what to suppress.

Read from a Hugging Face tokenizer.json with the `tokenizers` library (no transformers, no Hub). The timestamp tokens
<|0.00|> .. <|30.00|> follow <|notimestamps|>: a tokenizer.json without them (CTranslate2's) has them added.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from mlx_audio.stt.models.whisper.tokenizer import LANGUAGES, TO_LANGUAGE_CODE

TIMESTAMP_COUNT = 1501  # <|0.00|> .. <|30.00|>, every 20 ms
SECONDS_PER_TIMESTAMP = 0.02
# Whisper's non-speech annotations (OpenAI's tokenizer.non_speech_tokens), suppressed by default.
_SYMBOLS = list('"#()*+/:;<=>@[\\]^_`{|}~「」『』') + \
    "<< >> <<< >>> -- --- -( -[ (' (\" (( )) ((( ))) [[ ]] {{ }} ♪♪ ♪♪♪".split()
_MUSIC = list("♩♪♫♬♭♮♯")


@dataclass(frozen=True)
class WhisperTokens:
    eot: int
    sot: int
    sot_prev: int
    sot_lm: int
    no_timestamps: int
    no_speech: int | None
    transcribe: int
    translate: int
    timestamp_begin: int
    languages: dict[str, int]  # language code -> its token
    blank: tuple[int, ...]  # " ": never the first token sampled
    suppressed: tuple[int, ...] = field(repr=False)  # non-speech annotations and the control tokens

    def language_token(self, language: str) -> int:
        code = TO_LANGUAGE_CODE.get(language.lower(), language.lower())
        if code not in self.languages:
            raise KeyError(language)
        return self.languages[code]

    def language_of(self, token: int) -> str | None:
        return next((code for code, t in self.languages.items() if t == token), None)


def timestamp_tokens() -> list[str]:
    return [f"<|{i * SECONDS_PER_TIMESTAMP:.2f}|>" for i in range(TIMESTAMP_COUNT)]


def with_timestamp_tokens(tokenizer) -> None:
    """Add the timestamp tokens to a `tokenizers.Tokenizer` that lacks them, right after its last token."""
    from tokenizers import AddedToken

    if tokenizer.token_to_id("<|0.00|>") is None:
        tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in timestamp_tokens()])


def load_tokenizer(folder: Path):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(folder / "tokenizer.json"))


def whisper_tokens(tokenizer, n_vocab: int) -> WhisperTokens:
    def special(name: str) -> int:
        token = tokenizer.token_to_id(name)
        if token is None:
            raise ValueError(f"the tokenizer has no {name}: not a Whisper vocabulary")
        return token

    timestamp_begin = special("<|0.00|>")
    if timestamp_begin + TIMESTAMP_COUNT != n_vocab:
        raise ValueError(f"the timestamp tokens end at {timestamp_begin + TIMESTAMP_COUNT}, the model's vocabulary "
                         f"at {n_vocab}")
    languages = {code: tokenizer.token_to_id(f"<|{code}|>") for code in LANGUAGES}
    control = [special(n) for n in ("<|transcribe|>", "<|translate|>", "<|startoftranscript|>",
                                    "<|startofprev|>", "<|startoflm|>")]
    no_speech = tokenizer.token_to_id("<|nospeech|>") or tokenizer.token_to_id("<|nocaptions|>")
    suppressed = set(_non_speech(tokenizer)) | set(control) | ({no_speech} if no_speech is not None else set())
    return WhisperTokens(
        eot=special("<|endoftext|>"), sot=control[2], sot_prev=control[3], sot_lm=control[4],
        no_timestamps=special("<|notimestamps|>"), no_speech=no_speech, transcribe=control[0], translate=control[1],
        timestamp_begin=timestamp_begin, languages={c: t for c, t in languages.items() if t is not None},
        blank=tuple(_encode(tokenizer, " ")[:1]), suppressed=tuple(sorted(suppressed)),
    )


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False).ids


def _non_speech(tokenizer) -> set[int]:
    result = {tokens[0] for tokens in (_encode(tokenizer, " -"), _encode(tokenizer, " '")) if tokens}
    for symbol in _SYMBOLS + _MUSIC:
        for tokens in (_encode(tokenizer, symbol), _encode(tokenizer, " " + symbol)):
            if tokens and (len(tokens) == 1 or symbol in _MUSIC):
                result.add(tokens[0])
    return result
