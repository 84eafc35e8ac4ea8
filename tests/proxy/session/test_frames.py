"""Masked frames toward the engine (``proxy.session.frames.masked_frame_header``), socket-free.

Each frame is built the way the picows engine link builds it (header, then the
payload masked in place with ``proxy.compat.websocket_mask``) and read back
with the ``websockets`` package's own parser in server mode (``mask=True``: an
unmasked frame is refused), which must return the original payload. The
lengths straddle the three length forms of RFC 6455 §5.2.
"""

from __future__ import annotations

import itertools
import os

import pytest
from hypothesis import given
from hypothesis import strategies as st
from websockets.frames import Frame, Opcode
from websockets.streams import StreamReader

from proxy.compat import websocket_mask
from proxy.session.frames import OP_PING, OP_TEXT, FrameHeaders, masked_frame_header

#: Payload length -> how the length is written (second byte's low 7 bits).
LENGTHS = {0: 0, 1: 1, 125: 125, 126: 126, 65535: 126, 65536: 127, 70_000: 127}


def parse_masked(data: bytes) -> Frame:
    reader = StreamReader()
    reader.feed_data(data)
    reader.feed_eof()
    parser = Frame.parse(reader.read_exact, mask=True)
    try:
        next(parser)
    except StopIteration as done:
        frame: Frame = done.value
    else:
        raise AssertionError("websockets' parser wanted more bytes than the frame has")
    assert not reader.buffer, "bytes left after the frame: the header's length is wrong"
    return frame


def masked_frame(opcode: int, payload: bytes, mask: bytes) -> bytes:
    masked = bytearray(payload)
    websocket_mask(mask, masked)
    return masked_frame_header(opcode, len(payload), mask) + bytes(masked)


@pytest.mark.parametrize("length", list(LENGTHS))
def test_a_masked_text_frame_parses_back_to_its_payload(length: int) -> None:
    payload = bytes((i * 7 + 3) % 256 for i in range(length))
    mask = os.urandom(4)
    data = masked_frame(OP_TEXT, payload, mask)
    header_bytes = {0: 2, 126: 4, 127: 10}.get(LENGTHS[length], 2)
    assert data[0] == 0x80 | OP_TEXT, "FIN and the opcode"
    assert data[1] == 0x80 | LENGTHS[length], "the mask bit and the length form"
    assert data[header_bytes : header_bytes + 4] == mask
    frame = parse_masked(data)
    assert frame.opcode is Opcode.TEXT and frame.fin
    assert frame.data == payload


def test_masking_changes_the_bytes_on_the_wire() -> None:
    payload = b'{"type":"input_audio_buffer.append","audio":"AAAA"}'
    mask = b"\x12\x34\x56\x78"
    data = masked_frame(OP_TEXT, payload, mask)
    assert payload not in data
    assert parse_masked(data).data == payload


def test_another_opcode_is_written_as_given() -> None:
    frame = parse_masked(masked_frame(OP_PING, b"keepalive", b"\x01\x02\x03\x04"))
    assert frame.opcode is Opcode.PING and frame.data == b"keepalive"


def test_websocket_mask_is_an_involution_at_every_alignment() -> None:
    mask = b"\xa5\x5a\xff\x00"
    for size in range(40):
        original = os.urandom(size)
        data = bytearray(original)
        websocket_mask(mask, data)
        expected = bytes(b ^ mask[i % 4] for i, b in enumerate(original))
        assert bytes(data) == expected
        websocket_mask(mask, data)
        assert bytes(data) == original


# -- the mask check's header walk (RFC 6455 §5.1) ---------------------------------------


def _frame(length: int, masked: bool) -> bytes:
    """One text frame of ``length`` payload bytes, in the shortest length form."""
    head = bytearray([0x81])
    flag = 0x80 if masked else 0
    if length < 126:
        head.append(flag | length)
    elif length < 1 << 16:
        head += bytes([flag | 126]) + length.to_bytes(2, "big")
    else:
        head += bytes([flag | 127]) + length.to_bytes(8, "big")
    if masked:
        head += b"\x01\x02\x03\x04"
    return bytes(head) + b"\x81" * length  # payload bytes that look like headers


@given(
    frames=st.lists(
        st.tuples(st.sampled_from([0, 1, 125, 126, 200, 65535, 65536, 70_000]), st.booleans()),
        min_size=1,
        max_size=6,
    ),
    cuts=st.lists(st.integers(min_value=0, max_value=1 << 20), max_size=8),
)
def test_the_header_walk_finds_the_first_unmasked_frame_however_the_bytes_arrive(
    frames: list[tuple[int, bool]], cuts: list[int]
) -> None:
    stream = b"".join(_frame(length, masked) for length, masked in frames)
    expected, at = -1, 0
    for length, masked in frames:
        if not masked:
            expected = at
            break
        at += len(_frame(length, masked))
    points = sorted({c % (len(stream) + 1) for c in cuts} | {0, len(stream)})
    walk = FrameHeaders()
    for start, end in itertools.pairwise(points):
        hit = walk.unmasked_at(stream[start:end])
        if hit >= 0:
            # Its header began in this read, or (at 0) in an earlier one.
            assert 0 <= expected < end, (hit, expected, start, end)
            assert hit == max(0, expected - start), (hit, expected, start)
            return
    assert expected == -1, f"no unmasked frame found; the one at {expected} was missed"
