"""A sender flooding a receiver that reads nothing, for the tests of a link's "full" state."""

from __future__ import annotations

import asyncio
import time

from transports.base import Sender
from transports.testing import KitPayload

#: how long a flood may take to fill a link (the receiver's queue, the transport's buffers)
FILL_TIMEOUT = 30.0


class Flood:
    """A task sending ``KitPayload(seq, bytes(payload_bytes))`` for seq = 0, 1, ... until it
    fails or is cancelled; ``sent`` counts the sends that went through."""

    def __init__(self, sender: Sender, payload_bytes: int) -> None:
        self.sent = 0
        self.task = asyncio.create_task(self._run(sender, bytes(payload_bytes)))

    async def _run(self, sender: Sender, payload: bytes) -> None:
        while True:
            await sender.send(KitPayload(self.sent, payload))
            self.sent += 1


async def flood_until_held(sender: Sender, payload_bytes: int) -> Flood:
    """Start a :class:`Flood` and return once one of its sends waits for room (asserted)."""
    flood = Flood(sender, payload_bytes)
    deadline = time.monotonic() + FILL_TIMEOUT
    while not sender.statistics().waiting_senders and time.monotonic() < deadline:
        if flood.task.done():
            flood.task.result()  # a send failed: raise why
        await asyncio.sleep(0.01)
    assert sender.statistics().waiting_senders == 1
    return flood
