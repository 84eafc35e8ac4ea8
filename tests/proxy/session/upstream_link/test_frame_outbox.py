"""``Outbox`` (proxy/session/upstream_link/frame_outbox.py): frames toward the engine.

Masked (RFC 6455 §5.3) with a fresh key each, written once per loop tick in one
``writelines`` in the order sent, at once past ``FLUSH_NOW_BYTES``; dropped
without a transport.
"""

from __future__ import annotations

import asyncio

from proxy.session.frames import OP_TEXT
from proxy.session.upstream_link.frame_outbox import FLUSH_NOW_BYTES, Outbox
from tests.proxy.session.fakes import FakeTransport
from tests.proxy.session.test_frames import parse_masked


def _outbox() -> tuple[Outbox, FakeTransport]:
    outbox = Outbox(asyncio.get_running_loop())
    transport = FakeTransport()
    outbox.transport = transport  # type: ignore[assignment]
    return outbox, transport


def _frames(data: bytes) -> list[bytes]:
    """Split masked client frames (short payloads: 7-bit length) and unmask each."""
    out = []
    while data:
        length = data[1] & 0x7F
        assert length < 126, "this helper reads short frames only"
        out.append(bytes(parse_masked(data[: 6 + length]).data))
        data = data[6 + length :]
    return out


async def test_frames_of_one_tick_are_written_once_in_order_and_masked() -> None:
    outbox, transport = _outbox()
    outbox.frame(OP_TEXT, bytearray(b'{"a":1}'))
    outbox.frame(OP_TEXT, bytearray(b'{"b":2}'))
    assert transport.calls == [] and outbox.pending_bytes == 14
    await asyncio.sleep(0)
    assert len(transport.calls) == 1, "one write for the tick"
    assert _frames(transport.data) == [b'{"a":1}', b'{"b":2}']
    assert outbox.pending_bytes == 0


async def test_every_frame_has_its_own_mask_key() -> None:
    outbox, transport = _outbox()
    for _ in range(8):
        outbox.frame(OP_TEXT, bytearray(b"same"))
    outbox.flush()
    keys = {transport.data[i * 10 + 2 : i * 10 + 6] for i in range(8)}
    assert len(keys) == 8
    assert b"same" not in transport.data, "the payload goes masked"


async def test_a_large_batch_is_written_at_once() -> None:
    outbox, transport = _outbox()
    outbox.frame(OP_TEXT, bytearray(FLUSH_NOW_BYTES))
    assert len(transport.calls) == 1, "not held until the end of the tick"
    assert outbox.pending_bytes == 0


async def test_without_a_transport_frames_are_dropped() -> None:
    outbox = Outbox(asyncio.get_running_loop())
    outbox.frame(OP_TEXT, bytearray(b"x"))
    await asyncio.sleep(0)
    assert outbox.pending_bytes == 0


async def test_a_closing_transport_is_not_written() -> None:
    outbox, transport = _outbox()
    outbox.frame(OP_TEXT, bytearray(b"x"))
    transport.close()
    await asyncio.sleep(0)
    assert transport.data == b"" and outbox.pending_bytes == 0
