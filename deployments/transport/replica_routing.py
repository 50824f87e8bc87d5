"""Streams of a model with several replicas, spread over the replicas' stream channels by the ingress itself.

A Ray handle stream per request costs the ingress and the replica most of their CPU under load (channel.py), and
Serve's router only routes handle calls; so when every live replica of the model (replica_board.py) has a channel
on this node, the ingress picks the replica: the one with the fewest streams open from here, unless the request's
conversation (its prefix_key) last went to a replica that is not much busier, whose prefix cache holds the earlier
turns. Otherwise (a replica on another node, one without a channel, the board unreadable) streams take the handle
and Serve's router.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import random
from collections import OrderedDict
from typing import Awaitable, Callable

from deployments.model_calls import ChatPrompt, GenerateJob, TextPrompt
from deployments.transport.channel import ChannelAddress, ChannelClient
from deployments.transport.replica_board import ReplicaReport

logger = logging.getLogger("ray.serve.orchard")
BOARD_REFRESH_S = 1.0  # the replicas' rows are read at most this often (they report every second)
AFFINITY_KEYS = 4096  # conversations remembered, least recently used dropped first
PREFIX_CHARS = 2048  # of the conversation's opening that names it


def prefix_key(job: GenerateJob) -> str | None:
    """What names the request's conversation: the system prompt and first user message (a later turn repeats
    them), or a completion prompt's opening; None when there is nothing to go by."""
    prompt = job.prompt
    if isinstance(prompt, ChatPrompt):
        opening = [m for m in prompt.messages if m.get("role") in ("system", "developer")][:1]
        opening += [m for m in prompt.messages if m.get("role") == "user"][:1]
        text = json.dumps([m.get("content") for m in opening], default=str)[:PREFIX_CHARS] if opening else ""
    elif isinstance(prompt, TextPrompt):
        if prompt.text:
            text = prompt.text[:PREFIX_CHARS]
        else:
            text = json.dumps(prompt.token_ids[:PREFIX_CHARS // 4]) if prompt.token_ids else ""
    else:
        return None
    adapter = job.adapter.name if job.adapter is not None else ""
    return hashlib.blake2b(f"{adapter}\0{text}".encode(), digest_size=12).hexdigest() if text else None


def affinity_slack(least: int) -> int:
    """How many more open streams than the least busy replica a conversation's replica may have and still get it."""
    return 4 + least // 4


class ReplicaChannels:
    """The channels to a model's replicas from this ingress, and the choice of one per stream."""

    def __init__(self, model_id: str, read_rows: Callable[[], Awaitable[list[ReplicaReport]]],
                 node_id: Callable[[], str],
                 connect: Callable[[str, ChannelAddress], Awaitable[ChannelClient]] = ChannelClient.connect) -> None:
        self._model_id = model_id
        self._read_rows = read_rows
        self._node_id = node_id
        self._connect = connect
        self._clients: dict[str, ChannelClient] = {}  # replica id -> its channel
        self._affinity: OrderedDict[str, str] = OrderedDict()  # prefix key -> replica id
        self._read_at = float("-inf")
        self._usable = False
        self._lock = asyncio.Lock()
        self.rows: list[ReplicaReport] = []  # the last read

    @property
    def usable(self) -> bool:
        """Whether streams go over the channels (every live replica has one on this node, connected)."""
        return self._usable

    async def refresh(self) -> None:
        """Read the board again, at most once a second; connect to new replicas, drop gone ones."""
        loop = asyncio.get_running_loop()
        if loop.time() - self._read_at < BOARD_REFRESH_S:
            return
        if self._lock.locked() and self._read_at > float("-inf"):
            return  # a read is under way: this stream goes by the last one rather than wait for a slow board
        async with self._lock:
            if loop.time() - self._read_at >= BOARD_REFRESH_S:
                self.rows = await self._read_rows()
                self._read_at = loop.time()
                self._usable = await self._sync(self.rows)

    async def _sync(self, rows: list[ReplicaReport]) -> bool:
        live = {row.replica_id: row for row in rows}
        for replica_id in [r for r, c in self._clients.items() if r not in live or c.closed]:
            await self._clients.pop(replica_id).close()
        node = self._node_id()
        if not rows or any(row.channel is None or row.channel.node_id != node for row in rows):
            return False
        for replica_id, row in live.items():
            if replica_id not in self._clients:
                try:
                    self._clients[replica_id] = await self._connect(self._model_id, row.channel)
                except OSError as exc:  # a replica that died and still has a row: tried again at the next read
                    logger.info("stream channel of model '%s' replica %s unreachable: %s", self._model_id, replica_id,
                                exc)
        return bool(self._clients)

    def pick(self, job: GenerateJob) -> ChannelClient | None:
        """The replica for this stream: its conversation's, unless that one is much busier; else the least busy."""
        open_ = {r: c for r, c in self._clients.items() if not c.closed}
        if not open_:
            return None
        least = min(c.open_streams for c in open_.values())
        key = prefix_key(job)
        chosen = self._affinity.get(key) if key is not None else None
        if chosen not in open_ or open_[chosen].open_streams > least + affinity_slack(least):
            chosen = random.choice([r for r, c in open_.items() if c.open_streams == least])
        if key is not None:
            self._affinity[key] = chosen
            self._affinity.move_to_end(key)
            while len(self._affinity) > AFFINITY_KEYS:
                self._affinity.popitem(last=False)
        return open_[chosen]

    async def close(self) -> None:
        for client in self._clients.values():
            await client.close()
        self._clients.clear()


__all__ = ["ReplicaChannels", "affinity_slack", "prefix_key"]
