"""Tiny models whose next token is scripted, for tests that send bodies without max_tokens (Bodega's documented
examples): a random model would write until its context ends, these stop within a few tokens.

The weights are real mlx-lm / mlx-vlm checkpoints, rewritten so that the last hidden state depends only on the
current token: every layer's output projections are zero (the residual stream is the token's embedding), and each
embedding is e_0 + e_class. The untied head then reads logits = base + bump[class]: a base preference every token
shares, plus a chain "after token a, write token b". Sampling at any temperature follows the script, because the
gaps between the scripted logits are ~10 or more.

`write_scripted_lm` writes a 1-layer llama over a byte-level vocabulary (so guided JSON can spell anything) with
`<think>`/`</think>` tokens and a Qwen3-style ChatML template (mlx-lm passes enable_thinking true to a vocabulary
with `<think>`, as Qwen3's own default is). Its script: after the generation prompt it writes "<think>Hm</think>OK"
(reasoning "Hm", content "OK"); with enable_thinking false the prompt holds an empty `<think></think>` and the
answer is "OK"; under a JSON grammar (which masks `<think>`) it writes the shortest document with empty strings
(`{"a":""}`), because the base prefers '"' then '}' ',' ':' '{'. `prompt_opens_think` gives the template of the
Qwen3-2507 thinking models instead: the prompt itself ends with `<think>`, and the model writes "Hm</think>OK".
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import mlx.core as mx
import numpy as np

from tests.support.random_model import write_byte_level_tokenizer
from tests.support.tiny_models import LLAMA, write_model

BUMP = 40.0  # a chain's logit over the base's best (EOS 24): the scripted token always wins where allowed
# Byte-level vocabulary: 256 bytes + 25 JSON fragments, then the three ChatML specials, then the think markers.
BYTE_VOCAB = 284
THINK_TOKENS = ("<think>", "</think>")
LM_VOCAB = BYTE_VOCAB + len(THINK_TOKENS)
CHATML_TURNS = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
)
NO_THINKING = "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think></think>' }}"
# Qwen3: the model opens <think> itself; Qwen3-2507 thinking models: the prompt opens it.
QWEN3_CHATML = CHATML_TURNS + "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}" + NO_THINKING + \
    "{% endif %}{% endif %}"
QWEN3_2507_CHATML = CHATML_TURNS + "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}" + NO_THINKING + \
    "{% else %}{{ '<think>' }}{% endif %}{% endif %}"
# What every token prefers, best first where allowed: stop; then, under a JSON grammar, close strings at once,
# close objects, separate, and open the top-level object.
LM_BASE_TEXT = {'"': 18.0, "}": 12.0, ",": 10.0, ":": 10.0, "{": 8.0}
EOS_LOGIT = 24.0


def script_weights(folder: Path, prefix: str, base: dict[int, float], chain: dict[int, int]) -> None:
    """Rewrite `folder`'s model.safetensors (an untied model; `prefix`: "" for mlx-lm, "language_model." for
    mlx-vlm) so the next token's logits are `base` (others 0) plus BUMP on chain[current token]."""
    path = folder / "model.safetensors"
    weights = mx.load(str(path))
    embed_key, head_key = f"{prefix}model.embed_tokens.weight", f"{prefix}lm_head.weight"
    vocab, hidden = weights[embed_key].shape
    if len(chain) + 2 > hidden:
        raise ValueError(f"a chain of {len(chain)} steps needs a hidden size above {len(chain) + 1}")
    for key in weights:
        if key.startswith(f"{prefix}model.layers.") and key.endswith(("o_proj.weight", "down_proj.weight")):
            weights[key] = mx.zeros_like(weights[key])  # no layer writes to the residual stream
    embed = np.zeros((vocab, hidden), np.float32)
    head = np.zeros((vocab, hidden), np.float32)
    scale = math.sqrt(hidden / 2)  # RMSNorm of e_0 + e_class is (e_0 + e_class) * scale
    embed[:, :2] = 1.0  # class 1: no chain step
    for token, logit in base.items():
        head[token, 0] = logit / scale
    for step, (after, then) in enumerate(chain.items(), start=2):
        embed[after, 1], embed[after, step] = 0.0, 1.0
        head[then, step] = BUMP / scale
    weights[embed_key] = mx.array(embed)
    weights[head_key] = mx.array(head)
    mx.save_safetensors(str(path), weights, metadata={"format": "mlx"})


def write_scripted_lm(out_dir: Path, prompt_opens_think: bool = False) -> Path:
    """A 1-layer llama answering by the module docstring's script; every id decodes."""
    from tokenizers import AddedToken, Tokenizer

    tokenizer_dir = write_byte_level_tokenizer(out_dir.parent / f"{out_dir.name}-tokenizer", BYTE_VOCAB)
    tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in THINK_TOKENS])
    tokenizer.save(str(tokenizer_dir / "tokenizer.json"))
    config_path = tokenizer_dir / "tokenizer_config.json"
    template = QWEN3_2507_CHATML if prompt_opens_think else QWEN3_CHATML
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), "chat_template": template}))
    model_config = dict(LLAMA, vocab_size=LM_VOCAB, num_hidden_layers=1, tie_word_embeddings=False,
                        bos_token_id=BYTE_VOCAB - 3, eos_token_id=BYTE_VOCAB - 1)
    folder = write_model(out_dir, model_config, tokenizer_dir)

    def token(text: str) -> int:
        [token_id] = tokenizer.encode(text, add_special_tokens=False).ids
        return token_id

    base = {token(text): logit for text, logit in LM_BASE_TEXT.items()}
    base[BYTE_VOCAB - 1] = EOS_LOGIT  # <|im_end|>
    think, end_think = token("<think>"), token("</think>")
    # "\n" ends the generation prompt; "</think>" ends it with thinking off.
    chain = {token("\n"): think, think: token("H"), token("H"): token("m"), token("m"): end_think,
             end_think: token("O"), token("O"): token("K")}
    script_weights(folder, "", base, chain)
    return folder


def write_scripted_vlm(out_dir: Path) -> Path:
    """The tiny Qwen2.5-VL (tests/support/tiny_vlms.py) untied and scripted: after the prompt it writes "OK" and
    stops (its image still goes through the processor and the vision tower)."""
    from tokenizers import Tokenizer

    from tests.support.tiny_vlms import write_qwen25_vl

    folder = write_qwen25_vl(out_dir)
    config = json.loads((folder / "config.json").read_text())
    config["tie_word_embeddings"] = False
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    weights = mx.load(str(folder / "model.safetensors"))
    embed = weights["language_model.model.embed_tokens.weight"]
    weights["language_model.lm_head.weight"] = mx.zeros_like(embed)  # filled by script_weights
    mx.save_safetensors(str(folder / "model.safetensors"), weights, metadata={"format": "mlx"})
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    newline, *answer = tokenizer.encode("\nOK", add_special_tokens=False).ids
    steps = [newline, *answer]
    chain = dict(zip(steps, steps[1:]))
    script_weights(folder, "language_model.", {config["eos_token_id"]: EOS_LOGIT}, chain)
    return folder
