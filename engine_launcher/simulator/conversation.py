"""Input buffer and conversation history of a simulated session (no I/O).

The simulator does not run a model, so history is only ids and small item
objects; what matters to clients is the event fan-out of docs/engine-protocol.md, Response sequence
(commit) and the T1 ``conversation.item.*`` answers.
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass
from typing import Final

from engine_launcher.simulator.audio import input_bytes_per_sample, pcm16_rms, pcm_f32_rms
from engine_launcher.simulator.wire import Payload

__all__ = [
    "VAD_RMS_THRESHOLD",
    "AppendedAudio",
    "Conversation",
    "InputAudioError",
    "InputBuffer",
]

# Server-VAD stand-in for Silero: an appended chunk whose RMS level exceeds
# this fraction of full scale (about -34 dBFS) counts as speech.
VAD_RMS_THRESHOLD: Final = 0.02


class InputAudioError(ValueError):
    """An ``input_audio_buffer.append`` the engine rejects.

    Attributes:
        code: the wire error code.
    """

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True, slots=True)
class AppendedAudio:
    """One decoded append: its bytes, format and duration."""

    raw: bytes
    fmt: str
    duration_ms: float


class InputBuffer:
    """Uncommitted input audio: only its size and duration are kept."""

    __slots__ = ("bytes", "item_id", "ms", "total_ms")

    def __init__(self) -> None:
        self.bytes = 0
        self.ms = 0.0
        self.total_ms = 0.0  # since session start, for speech_started.audio_start_ms
        self.item_id: str | None = None

    @staticmethod
    def decode(event: Payload, default_format: str, default_rate: int) -> AppendedAudio:
        """Decode and measure an append event.

        Raises:
            InputAudioError: missing/invalid base64 or an unsupported format.
        """
        audio = event.get("audio")
        if not isinstance(audio, str):
            raise InputAudioError("bad_event", "audio must be a base64 string")
        try:
            raw = base64.b64decode(audio, validate=True)
        except (binascii.Error, ValueError):
            raise InputAudioError("bad_event", "audio is not valid base64") from None
        fmt = event.get("format") or event.get("input_audio_format") or default_format
        width = input_bytes_per_sample(fmt) if isinstance(fmt, str) else None
        if width is None or not isinstance(fmt, str):
            raise InputAudioError("unsupported_audio_format", f"input audio format {fmt!r}")
        rate = event.get("sample_rate_hz")
        rate = (
            rate
            if isinstance(rate, int) and not isinstance(rate, bool) and rate > 0
            else default_rate
        )
        duration = event.get("duration_ms")
        if not isinstance(duration, int | float) or isinstance(duration, bool) or duration < 0:
            duration = len(raw) / width / rate * 1000
        return AppendedAudio(raw=raw, fmt=fmt, duration_ms=float(duration))

    @staticmethod
    def is_speech(event: Payload, audio: AppendedAudio) -> bool:
        """Speech/silence decision: the client's ``is_speech`` hint, else RMS energy."""
        hint = event.get("is_speech")
        if isinstance(hint, bool):
            return hint
        if audio.fmt == "pcm_f32le":
            return pcm_f32_rms(audio.raw) > VAD_RMS_THRESHOLD
        if audio.fmt in ("pcm16", "pcm_s16le", "s16le"):
            return pcm16_rms(audio.raw) > VAD_RMS_THRESHOLD
        return False  # G.711: no level estimate; rely on the is_speech hint

    def add(self, audio: AppendedAudio) -> None:
        """Account one appended chunk."""
        self.bytes += len(audio.raw)
        self.ms += audio.duration_ms
        self.total_ms += audio.duration_ms

    def clear(self) -> None:
        """Drop uncommitted input (clear, cancel, commit)."""
        self.bytes = 0
        self.ms = 0.0
        self.item_id = None


class Conversation:
    """Item history plus whether committed input still awaits a response."""

    __slots__ = ("_items", "last_item_id", "pending_input")

    def __init__(self) -> None:
        self._items: dict[str, Payload] = {}
        self.last_item_id: str | None = None
        self.pending_input = False

    def __len__(self) -> int:
        return len(self._items)

    def add(self, item: Payload) -> str | None:
        """Append ``item`` (which has an ``id``); return the previous item id."""
        previous = self.last_item_id
        self._items[item["id"]] = item
        self.last_item_id = item["id"]
        role = item.get("role")
        if role == "user" or item.get("type") == "function_call_output":
            self.pending_input = True
        return previous

    def items(self) -> list[Payload]:
        """All items, oldest first."""
        return list(self._items.values())

    def get(self, item_id: str) -> Payload | None:
        """Return the item, or ``None``."""
        return self._items.get(item_id)

    def delete(self, item_id: str) -> bool:
        """Remove the item; ``False`` when unknown."""
        return self._items.pop(item_id, None) is not None

    @staticmethod
    def user_audio_item(item_id: str, audio_ms: int) -> Payload:
        """The user item created by a commit, with a placeholder transcript."""
        return {
            "id": item_id,
            "object": "realtime.item",
            "type": "message",
            "role": "user",
            "status": "completed",
            "content": [{"type": "input_audio", "transcript": f"[{audio_ms} ms of user audio]"}],
        }

    @staticmethod
    def added_events(item: Payload, previous: str | None) -> list[Payload]:
        """0.30 emits both spellings: ``conversation.item.added`` and ``.created``."""
        return [
            {"type": "conversation.item.added", "previous_item_id": previous, "item": item},
            {"type": "conversation.item.created", "previous_item_id": previous, "item": item},
        ]
