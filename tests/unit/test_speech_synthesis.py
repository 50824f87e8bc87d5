"""Text to speech's plain parts: the text cut into sentences, espeak-ng's phonemes with the punctuation put back,
Piper's id layout, and the encoder: audio encoded a piece at a time is the same file as encoded whole."""

from __future__ import annotations

import numpy as np
import pytest

from deployments.speech.audio_io import decode_audio
from deployments.speech.audio_out import OUTPUT_FORMATS, PCM_RATE, SpeechEncoder, encode_audio
from engine.speech.espeak_phonemes import EspeakPhonemizer
from engine.speech.piper_voice import PiperVoice, piper_voice_file
from engine.speech.synthesis import text_pieces
from engine.speech.voices import default_voice_path


def test_text_is_cut_into_sentences_none_longer_than_the_limit():
    text = "First one. Second one!  Third?\nFourth; " + "word, " * 50 + "end."
    pieces = text_pieces(text, max_chars=60)
    assert pieces[:4] == ["First one.", "Second one!", "Third?", "Fourth;"]
    assert all(0 < len(p) <= 60 for p in pieces)
    assert " ".join(pieces).split() == text.split()  # every word, once, in order


def test_phonemes_keep_the_clauses_punctuation():
    phonemes = EspeakPhonemizer("en-us").phonemes("Hello, world. Is it? Yes!")
    assert [c for c in phonemes if c in ",.?!"] == [",", ".", "?", "!"]
    assert "h" in phonemes and "w" in phonemes


def test_piper_ids_are_bos_then_each_phoneme_and_a_pad_then_eos():
    voice = PiperVoice(piper_voice_file(default_voice_path()))
    table = voice.settings.phoneme_ids
    ids = voice.phoneme_ids("Hello there.")
    assert ids[:2] == table["^"] + table["_"] and ids[-1:] == table["$"]
    assert ids[3:-1:2] == [table["_"][0]] * len(ids[3:-1:2])  # a pad after every phoneme


@pytest.mark.parametrize("response_format", OUTPUT_FORMATS)
def test_audio_encoded_in_pieces_is_the_file_encoded_whole(response_format):
    rate = 22_050
    samples = (0.3 * np.random.default_rng(0).standard_normal(rate * 2)).astype(np.float32)
    encoder = SpeechEncoder(response_format, rate)
    pieces = b"".join(encoder.add(part) for part in np.split(samples, [10_000, 30_001])) + encoder.finish()
    whole = encode_audio(samples, rate, response_format)
    if response_format == "pcm":
        assert pieces == whole and len(whole) == 2 * 2 * PCM_RATE  # 2 s at OpenAI's 24 kHz, 16-bit
    elif response_format == "opus":  # an Ogg stream's serial number is random: the audio is what must match
        assert abs(decode_audio(pieces, 60).seconds - decode_audio(whole, 60).seconds) < 0.01
    else:
        assert pieces == whole
    if response_format != "pcm":
        assert abs(decode_audio(whole, 60).seconds - 2.0) < 0.1
