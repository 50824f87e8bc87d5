"""A draft model: a smaller model of the target's tokenizer drafts greedily for the rows that speculate, batched.

Its KV lives in one plain batch (kv/plain_batch.py) over the drafting rows. Before each proposal every row's
draft KV is cut back to all but its last two known tokens (rejected drafts and the draft of the last position
go), then one forward over those two tokens and k - 1 single-token forwards draft k tokens for all rows at
once. The drafts stay on the device: the target's verifying forward takes them as they are, and the step reads
them back with its own samples (one sync per step).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from engine.errors import ModelLoadError
from engine.kv.batch_cache import LayerCaches, new_request_cache
from engine.kv.plain_batch import RowBlock, append_rows, drop_row_tails, filter_rows, is_plain_request_cache, row_cache
from engine.kv.whole_buffer import forward_caches

CATCH_UP_CHUNK = 512


class DraftModel:
    def __init__(self, model: Any, target_vocab_size: int) -> None:
        if not is_plain_request_cache(new_request_cache(model)):
            raise ModelLoadError("The draft model must keep plain KV caches (no sliding-window or recurrent layers)")
        self.model = model
        self.target_vocab_size = target_vocab_size
        self.request_ids: list[str] = []
        self.caches: LayerCaches = []
        self.padding: list[int] = []
        self._lengths: dict[str, int] = {}  # KV positions each row's draft cache holds
        # Of those, how many hold the row's known text (the rest: drafts not yet verified, or rejected).
        self._valid: dict[str, int] = {}

    def propose(self, wanted: dict[str, int], histories: dict[str, list[int]]) -> tuple[list[str], mx.array | None]:
        """Drafts (lazy, [rows, max length]) for the rows that want any; returns the rows in the drafts' order."""
        rows = [rid for rid, length in wanted.items() if length > 0 and len(histories[rid]) >= 3]
        if not rows:
            return [], None
        width = max(wanted[rid] for rid in rows)
        self._update_rows(rows, histories)
        last_two = mx.array([histories[rid][-2:] for rid in self.request_ids], mx.uint32)
        token = self._greedy(self.model(last_two, cache=forward_caches(self.caches, 2)))
        drafts = [token]
        for _ in range(width - 1):
            token = self._greedy(self.model(token[:, None], cache=self.caches))
            drafts.append(token)
        for rid in self.request_ids:
            self._lengths[rid] = len(histories[rid]) + width - 1
            self._valid[rid] = len(histories[rid])
        return list(self.request_ids), mx.stack(drafts, axis=1)

    def accepted(self, request_id: str, count: int) -> None:
        """The target accepted the row's first `count` drafts: their KV holds the row's text too."""
        if request_id in self._valid:  # the last draft was never fed: accepted, it is still not in the KV
            self._valid[request_id] = min(self._valid[request_id] + count, self._lengths[request_id])

    def _greedy(self, logits: mx.array) -> mx.array:
        return mx.argmax(logits[:, -1, : self.target_vocab_size], axis=-1).astype(mx.uint32)

    def _update_rows(self, rows: list[str], histories: dict[str, list[int]]) -> None:
        """Keep the drafting rows whose KV is not behind their text and cut theirs to all but the last two known
        tokens; rows that sat out steps leave and catch up on their own KV (the tokens they missed only), new rows
        prefill theirs; both join again."""
        wanted = set(rows)
        behind = {
            rid: self._valid_part(i, rid) for i, rid in enumerate(self.request_ids)
            if rid in wanted and self._valid[rid] < len(histories[rid]) - 2
        }
        keep = [i for i, rid in enumerate(self.request_ids) if rid in wanted and rid not in behind]
        if len(keep) != len(self.request_ids):
            for i, rid in enumerate(self.request_ids):
                if i not in keep:
                    self._lengths.pop(rid, None)
                    self._valid.pop(rid, None)
            self.caches, self.padding = filter_rows(self.caches, self.padding, keep)
            self.request_ids = [self.request_ids[i] for i in keep]
        drops = [self._lengths[rid] - (len(histories[rid]) - 2) for rid in self.request_ids]
        if any(drops):
            self.padding = drop_row_tails(self.caches, self.padding, drops)
        joiners = [rid for rid in rows if rid not in self._lengths]
        if joiners:
            caches = [self._feed(behind.get(rid), histories[rid][:-2]) for rid in joiners]
            blocks = [RowBlock.of_request(cache) for cache in caches]
            self.caches, self.padding = append_rows(self.caches, self.padding, blocks)
            self.request_ids += joiners

    def _valid_part(self, row: int, request_id: str) -> LayerCaches:
        """The row's KV as its own cache, cut to the positions that hold its known text."""
        cache = row_cache(self.caches, self.padding, row)
        for layer in cache:
            layer.trim(self._lengths[request_id] - self._valid[request_id])
        return cache

    def _feed(self, cache: LayerCaches | None, token_ids: list[int]) -> LayerCaches:
        """`cache` (None: a new one) made to hold all of token_ids, by feeding the ones it does not hold yet."""
        if cache is None:
            cache = new_request_cache(self.model)
        for start in range(cache[0].offset, len(token_ids), CATCH_UP_CHUNK):
            self.model(mx.array([token_ids[start : start + CATCH_UP_CHUNK]], mx.uint32), cache=cache)
            mx.eval([layer.state for layer in cache])
        return cache

    def forget(self, request_id: str) -> None:
        """A finished row leaves at the next proposal (filtered with the others)."""
        if request_id in self._lengths:
            self._lengths[request_id] = self._valid[request_id] = -1

    def close(self) -> None:
        self.request_ids, self.caches, self.padding = [], [], []
        self._lengths.clear()
        self._valid.clear()


def check_same_tokenizer(target_tokenizer: Any, draft_tokenizer: Any) -> None:
    """A draft speaks the target's token ids only if both tokenizers map the same strings to the same ids."""
    if target_tokenizer.get_vocab() != draft_tokenizer.get_vocab():
        raise ModelLoadError(
            "The draft model's tokenizer differs from the target's (their vocabularies map tokens to different ids): "
            "a draft model must share the target's tokenizer"
        )
