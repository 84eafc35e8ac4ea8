"""The probe's inputs, outputs and errors: what it is asked to do and what it measured.

:class:`ProbeOptions` is what :func:`proxy.probe.run_probe` does,
:class:`ProbeResult` what it measured, and :class:`ProbeError` and its two
subclasses how it fails (the tree: docs/design.md, Code rules (4)).
Declarations only: nothing here does I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from proxy.errors import ConfigError, ProxyError

__all__ = [
    "DEFAULT_URL",
    "SECONDS",
    "ProbeConnectError",
    "ProbeError",
    "ProbeOptions",
    "ProbeResult",
    "ProbeTimeout",
]

SECONDS: Final = 1.0
DEFAULT_URL: Final = "ws://127.0.0.1:8000/v1/realtime"


class ProbeError(ProxyError):
    """The probe could not do its job (unreadable input, broken connection)."""


class ProbeConnectError(ProbeError, ConnectionError):
    """The WebSocket could not be opened.

    Args:
        url: The URL the probe tried.
        detail: What went wrong, on one line.
        status: The HTTP status when the server refused the upgrade, else None.
    """

    url: str
    status: int | None

    def __init__(self, url: str, detail: str, *, status: int | None = None) -> None:
        self.url = url
        self.status = status
        super().__init__(f"cannot connect to {url}: {detail}")


class ProbeTimeout(ProbeError, TimeoutError):
    """The overall deadline passed before the session completed.

    Args:
        timeout: The deadline in seconds.
        stage: What the probe was waiting for, e.g. ``response.done 1/2``.
        result: Everything measured until then.
    """

    timeout: float
    stage: str
    result: ProbeResult

    def __init__(self, timeout: float, stage: str, result: ProbeResult) -> None:
        self.timeout = timeout
        self.stage = stage
        self.result = result
        super().__init__(f"timed out after {timeout:g} s waiting for {stage}")


@dataclass(frozen=True, slots=True, kw_only=True)
class ProbeOptions:
    """What the probe does.

    Args:
        url: The realtime WebSocket URL.
        wav: A PCM16 mono WAV file to stream; None streams a generated
            voice-like signal at 16 kHz.
        input_seconds: Seconds of audio streamed before each commit (a shorter
            WAV is sent whole).
        append_ms: Audio length of each ``input_audio_buffer.append``.
        realtime: Pace the appends in real time; False sends them at once.
        cancel_after_ms: After this much received audio of a response, send
            ``response.cancel`` with its ``response_id``; None never cancels.
        timeout: Overall deadline in seconds, connect included.
        headers: Extra HTTP headers for the upgrade request.
        event_ack: Answer each event carrying ``server_event_seq`` with
            ``session.event_ack`` (as DuplexClient does, docs/engine-protocol.md, Conventions).
        responses: How many responses to request, one after the other.

    Raises:
        ConfigError: A value is out of range.
    """

    url: str = DEFAULT_URL
    wav: Path | None = None
    input_seconds: float = 1.0
    append_ms: float = 200.0
    realtime: bool = True
    cancel_after_ms: float | None = None
    timeout: float = 30 * SECONDS
    headers: tuple[tuple[str, str], ...] = ()
    event_ack: bool = False
    responses: int = 1

    def __post_init__(self) -> None:
        for key in ("input_seconds", "append_ms", "timeout"):
            if not getattr(self, key) > 0:
                raise ConfigError(key, "must be positive", "ProbeOptions")
        if self.cancel_after_ms is not None and not self.cancel_after_ms >= 0:
            raise ConfigError("cancel_after_ms", "must not be negative", "ProbeOptions")
        if self.responses < 1:
            raise ConfigError("responses", "must be at least 1", "ProbeOptions")


@dataclass(slots=True, kw_only=True)
class ProbeResult:
    """What the probe measured. Durations are seconds, None when not reached.

    Attributes:
        session_created_seconds: From the start of the connect to ``session.created``.
        first_audio_seconds: From sending the first ``response.create`` to its
            first audio delta.
        response_first_audio_seconds: The same for every response that had audio.
        audio_seconds: All audio received, from the base64 length of the deltas.
        audio_frames: Number of audio deltas received.
        cancels_sent: ``response.cancel`` events sent.
        stale_audio_frames: Audio deltas of a cancelled response received after
            its cancel was sent, over all cancelled responses.
        stale_audio_seconds: The audio length of those deltas (decoded size in
            the delta's or the session's format), not a wall-clock time.
        old_answer_heard_after_barge_in_ms: Milliseconds of cancelled-response
            audio a 1x playout client that does not clear its buffer plays
            after the cancel (:class:`PlayoutBuffer`), over all cancelled
            responses; None when no cancel was sent. In ms, as printed.
        response_statuses: ``response.done`` statuses in order.
        event_types: Types of all received events in order.
        errors: Codes of all ``error`` events in order.
        close_code: The WebSocket close code, None if never closed.
        session_closed_reason: ``reason`` of ``session.closed``.
        completed: ``session.created`` arrived and every requested response
            ended with ``response.done``.
    """

    session_created_seconds: float | None = None
    first_audio_seconds: float | None = None
    response_first_audio_seconds: list[float] = field(default_factory=list)
    audio_seconds: float = 0.0
    audio_frames: int = 0
    cancels_sent: int = 0
    stale_audio_frames: int = 0
    stale_audio_seconds: float = 0.0
    old_answer_heard_after_barge_in_ms: float | None = None
    response_statuses: list[str] = field(default_factory=list)
    event_types: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    close_code: int | None = None
    session_closed_reason: str | None = None
    completed: bool = False
