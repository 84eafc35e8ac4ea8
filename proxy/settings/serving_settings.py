"""How the sidecar serves sessions: listeners, admission, limits, playback, timers.

``ServingSettings`` is the first half of the declarations of ``Settings``
(proxy/settings/proxy_settings.py), which adds auth, logging and the engine
and validates the whole; build that, not this (docs/design.md, Settings).
"""

from __future__ import annotations

import typing
from dataclasses import dataclass
from typing import Final, Literal

from engine_launcher.setting_schema import KIB, MIB, SECONDS, setting
from proxy.core.buffer import (
    DEFAULT_MAX_CLOSE_NOTICE_BYTES,
    DEFAULT_MAX_PENDING_OUTPUT_BYTES,
    DEFAULT_MAX_PENDING_OUTPUT_EVENTS,
    DEFAULT_OUTPUT_RESERVE_BYTES,
    DEFAULT_OUTPUT_RESERVE_EVENTS,
)
from proxy.core.ledger import DEFAULT_MAX_TOMBSTONES, DEFAULT_TOMBSTONE_TTL
from proxy.core.playback import (
    DEFAULT_ACK_INTERVAL,
    DEFAULT_MAX_AUDIO_LEAD,
    DEFAULT_MAX_PACED_AUDIO_BYTES,
)
from proxy.core.session_settings import (
    DEFAULT_CLIENT_FRAME_BURST,
    DEFAULT_CLIENT_RESUME_GRACE,
    DEFAULT_MAX_CLIENT_FRAME_RATE,
    DEFAULT_MAX_INPUT_AUDIO_RATE,
    DEFAULT_MAX_PENDING_INPUT_BYTES,
    DEFAULT_RESUME_JOURNAL_BYTES,
    DEFAULT_RESUME_JOURNAL_TTL,
)
from proxy.settings.value_checks import (
    check_listen,
    check_networks,
    check_ws_url,
    mask_url,
)

__all__ = [
    "DEFAULT_ADMIN_LISTEN",
    "DEFAULT_LISTEN",
    "OVERFLOW_POLICY_NAMES",
    "OverflowPolicyName",
    "PlaybackAck",
    "ServingSettings",
]

DEFAULT_LISTEN: Final = "127.0.0.1:8000"
DEFAULT_ADMIN_LISTEN: Final = "127.0.0.1:9464"

OverflowPolicyName = Literal["close_session", "fail_response"]
OVERFLOW_POLICY_NAMES: Final[tuple[str, ...]] = typing.get_args(OverflowPolicyName)
PlaybackAck = Literal["auto", "off", "always"]

# Section headings of the example config and docs/configuration.md, in order
# (``Settings`` adds its own after these).
SECTION_LISTENERS: Final = "Listeners"
SECTION_ADMISSION: Final = "Admission"
SECTION_LIMITS: Final = "Per-session limits"
SECTION_PLAYBACK: Final = "Playback"
SECTION_CANCELLATION: Final = "Cancellation"
SECTION_TIMERS: Final = "Timers"


@dataclass(frozen=True, slots=True, kw_only=True)
class ServingSettings:
    """Listeners, admission, per-session limits, playback, cancellation, timers.

    Each field is the one declaration of its setting.
    """

    listen: str = setting(
        DEFAULT_LISTEN,
        help='Main listener (host:port; IPv6 as "[::1]:8000"): /v1/realtime, /v1/duplex, '
        "/healthz, /readyz, and other HTTP paths proxied to the engine.",
        section=SECTION_LISTENERS,
        metavar="HOST:PORT",
        check=check_listen,
    )
    admin_listen: str = setting(
        DEFAULT_ADMIN_LISTEN,
        help="Admin listener (host:port): /metrics, /healthz, the operator console at / and "
        "its /debug/* JSON (docs/console.md).",
        section=SECTION_LISTENERS,
        metavar="HOST:PORT",
        check=check_listen,
    )
    admin_token: str | None = setting(
        None,
        help="When set, every admin listener request needs it: Authorization: Bearer <token>, "
        "or HTTP Basic with the token as password (browsers). Unset = no auth (keep the "
        "admin listener on loopback or a private network).",
        section=SECTION_LISTENERS,
        example='"change-me"',
        metavar="TOKEN",
        mask=lambda value: None if value is None else "***",
    )
    max_request_head_bytes: int = setting(
        32 * KIB,
        help="Client listener: largest request line plus headers; beyond it 431 and the "
        "connection is closed (docs/security.md).",
        unit="bytes",
        positive=True,
        live=True,
        section=SECTION_LISTENERS,
    )
    request_head_timeout: float = setting(
        10 * SECONDS,
        help="Client listener: seconds to send a complete request head, from the connection's "
        "start or the end of the previous response; then 408 and the connection is closed.",
        unit="seconds",
        positive=True,
        live=True,
        section=SECTION_LISTENERS,
    )
    max_pending_handshakes: int = setting(
        256,
        help="Client listener: connections whose request head is not complete yet, plus "
        "those lingering after an error answer; one more is closed at once.",
        unit="count",
        positive=True,
        live=True,
        section=SECTION_LISTENERS,
    )
    lingering_time: float = setting(
        5 * SECONDS,
        help="Client listener: after an error answer that ends the connection before the "
        "upgrade (400, 408, 413, 426, 431, ...), the most seconds the sidecar goes on reading "
        "and discarding what the client still sends, so that closing does not reset the "
        "connection and destroy the answer unread (lingering close; docs/security.md).",
        unit="seconds",
        positive=True,
        live=True,
        section=SECTION_LISTENERS,
    )
    lingering_timeout: float = setting(
        2 * SECONDS,
        help="Client listener: a lingering connection from which nothing arrived for this "
        "many seconds is closed (within lingering_time).",
        unit="seconds",
        positive=True,
        live=True,
        section=SECTION_LISTENERS,
    )
    max_lingering_bytes: int = setting(
        1 * MIB,
        help="Client listener: a lingering connection stops being read once it has sent this "
        "many bytes after the answer; TCP flow control then holds the client, and the socket "
        "is closed at lingering_time.",
        unit="bytes",
        positive=True,
        live=True,
        section=SECTION_LISTENERS,
    )
    max_http_body_bytes: int = setting(
        16 * MIB,
        help="Largest reverse-proxied request body (counted while streaming, chunked too); "
        "beyond it 413 and the engine request is aborted.",
        unit="bytes",
        positive=True,
        live=True,
        section=SECTION_LISTENERS,
    )
    trusted_proxies: tuple[str, ...] = setting(
        (),
        help="CIDR networks of proxies in front of the sidecar. Only from these peers are "
        "X-Forwarded-For (rightmost untrusted hop) and a PROXY protocol v1/v2 header honoured "
        "for the per-IP limit and logs; a PROXY header from any other peer closes the "
        "connection. Empty = off.",
        live=True,
        section=SECTION_LISTENERS,
        example='["127.0.0.1/32", "10.0.0.0/8"]',
        metavar="CIDR,...",
        check=check_networks,
    )
    upstream: str | None = setting(
        None,
        help="ws:// or wss:// URL of an existing engine. Setting it switches engine.kind "
        'from "simulator" to "external" (no child process).',
        section=SECTION_LISTENERS,
        example='"ws://127.0.0.1:8091"',
        metavar="URL",
        check=check_ws_url,
        mask=mask_url,
    )
    max_sessions: int = setting(
        64,
        help="Concurrent sessions admitted; more get 503 + Retry-After. 0 = unlimited.",
        unit="count",
        minimum=0,
        live=True,
        section=SECTION_ADMISSION,
    )
    admission_timeout: float = setting(
        0 * SECONDS,
        help="Seconds to wait for a free session slot before answering 503. 0 = answer at once.",
        unit="seconds",
        minimum=0,
        live=True,
        section=SECTION_ADMISSION,
    )
    max_sessions_per_ip: int = setting(
        0,
        help="Concurrent sessions per client IP. 0 = off.",
        unit="count",
        minimum=0,
        live=True,
        section=SECTION_ADMISSION,
    )
    max_resume_waits: int = setting(
        256,
        help="Connections reading their first message before taking a session slot, in all "
        "(a connection whose URL opens with its first message, autostart=0, while its API "
        "key has a session a resume could take over; docs/design.md, Resume). At the bound "
        "the oldest wait of the key with the most waits is ended and refused (error "
        "capacity, close 1013): a newcomer, a session owner's resume included, always waits.",
        unit="count",
        minimum=1,
        live=True,
        section=SECTION_ADMISSION,
    )
    max_resume_waits_per_key: int = setting(
        16,
        help="Connections of one API key reading their first message before taking a "
        "session slot (see max_resume_waits); a key with more sessions a resume could take "
        "over may have as many. At the bound the key's oldest wait is ended "
        "and refused (error capacity, close 1013), so silent connections push out each "
        "other, never the owner's resume that comes after them.",
        unit="count",
        minimum=1,
        live=True,
        section=SECTION_ADMISSION,
    )
    max_sessions_per_engine: int = setting(
        0,
        help="Concurrent sessions one engine replica takes (docs/design.md, Engine pool); "
        "when every ready replica is full, 503 + Retry-After. 0 = max_sessions.",
        unit="count",
        minimum=0,
        live=True,
        section=SECTION_ADMISSION,
    )
    handshake_timeout: float = setting(
        10 * SECONDS,
        help="Seconds allowed for the client's WebSocket handshake.",
        unit="seconds",
        positive=True,
        live=True,
        section=SECTION_ADMISSION,
    )
    engine_open_wait: float = setting(
        2 * SECONDS,
        help="Seconds the handshake waits for the engine's first frame when the engine opens "
        "the session at connect (?model= without autostart=0): a full engine's error "
        "{resource_exhausted} is then answered 503 engine_capacity + Retry-After before the "
        "client's upgrade. Within handshake_timeout; 0 = upgrade at once, pass the error on.",
        unit="seconds",
        minimum=0,
        live=True,
        section=SECTION_ADMISSION,
    )
    engine_full_backoff: float = setting(
        5 * SECONDS,
        help="Seconds an engine replica that said it is full (resource_exhausted at open) "
        "gets no new session: they go to another replica, or get 503 engine_capacity + "
        "Retry-After without an upstream connect. 0 = off.",
        unit="seconds",
        minimum=0,
        live=True,
        section=SECTION_ADMISSION,
    )
    max_client_message_bytes: int = setting(
        15 * MIB,
        help="Largest client frame; a larger one closes the session with 1009.",
        unit="bytes",
        positive=True,
        section=SECTION_LIMITS,
    )
    max_pending_output_bytes: int = setting(
        DEFAULT_MAX_PENDING_OUTPUT_BYTES,
        help="Ordinary output budget per session: queued bytes toward the client.",
        unit="bytes",
        positive=True,
        live=True,
        section=SECTION_LIMITS,
    )
    max_pending_output_events: int = setting(
        DEFAULT_MAX_PENDING_OUTPUT_EVENTS,
        help="Ordinary output budget per session: queued events toward the client.",
        unit="count",
        positive=True,
        live=True,
        section=SECTION_LIMITS,
    )
    output_reserve_bytes: int = setting(
        DEFAULT_OUTPUT_RESERVE_BYTES,
        help="Reserve usable only by `error` and `response.done` once the budget is full "
        "(bytes); at most max_pending_output_bytes.",
        unit="bytes",
        minimum=0,
        live=True,
        section=SECTION_LIMITS,
    )
    output_reserve_events: int = setting(
        DEFAULT_OUTPUT_RESERVE_EVENTS,
        help="Reserve usable only by `error` and `response.done` once the budget is full "
        "(events); at most max_pending_output_events.",
        unit="count",
        minimum=0,
        live=True,
        section=SECTION_LIMITS,
    )
    max_close_notice_bytes: int = setting(
        DEFAULT_MAX_CLOSE_NOTICE_BYTES,
        help="Largest final `session.closed` notice; a larger one is replaced by a compact "
        "one (reason close_details_exceed_output_limit).",
        unit="bytes",
        positive=True,
        live=True,
        section=SECTION_LIMITS,
    )
    max_total_pending_output_bytes: int = setting(
        256 * MIB,
        help="Process-wide output cap; past it the largest session is shed.",
        unit="bytes",
        positive=True,
        section=SECTION_LIMITS,
    )
    client_write_buffer_bytes: int = setting(
        64 * KIB,
        help="Transport high-water mark toward the client.",
        unit="bytes",
        positive=True,
        live=True,
        section=SECTION_LIMITS,
    )
    overflow_policy: OverflowPolicyName = setting(  # noqa: RUF009 - a dataclasses.field
        "close_session",
        help='What to do when a session\'s output budget overflows: "close_session" (close '
        'with 1008) or "fail_response" (fail the active response, keep the session).',
        live=True,
        section=SECTION_LIMITS,
        metavar="POLICY",
    )
    max_pending_input_bytes: int = setting(
        DEFAULT_MAX_PENDING_INPUT_BYTES,
        help="Unsent bytes toward the engine per session.",
        unit="bytes",
        positive=True,
        live=True,
        section=SECTION_LIMITS,
    )
    max_input_audio_rate: float = setting(
        DEFAULT_MAX_INPUT_AUDIO_RATE,
        help="Appended input audio, in audio seconds per wall-clock second, averaged over "
        "5 s with a burst allowance of 10 s of audio. 0 = off.",
        unit="ratio",
        minimum=0,
        live=True,
        section=SECTION_LIMITS,
    )
    max_client_frame_rate: float = setting(
        DEFAULT_MAX_CLIENT_FRAME_RATE,
        help="Client data frames per second per session (pings excluded; audio also has "
        "max_input_audio_rate). Above it frames are dropped with one error "
        "{client_rate_limited}; 2 s of it closes the session with 1008. 0 = off.",
        unit="frames/s",
        minimum=0,
        live=True,
        section=SECTION_LIMITS,
    )
    client_frame_burst: float = setting(
        DEFAULT_CLIENT_FRAME_BURST,
        help="Client frames allowed at once above max_client_frame_rate (token bucket size).",
        unit="frames",
        minimum=0,
        live=True,
        section=SECTION_LIMITS,
    )
    playback_pacing: bool = setting(
        False,
        help="Release a response's audio no faster than real time plus max_audio_lead, so "
        "after a barge-in at most that much of the old answer is in the client. Held audio "
        "stays in the session's buffer (bounded by max_paced_audio_bytes).",
        live=True,
        section=SECTION_PLAYBACK,
    )
    max_audio_lead: float = setting(
        DEFAULT_MAX_AUDIO_LEAD,
        help="With playback_pacing: audio seconds a client may hold ahead of real time.",
        unit="seconds",
        minimum=0,
        live=True,
        section=SECTION_PLAYBACK,
    )
    max_paced_audio_bytes: int = setting(
        DEFAULT_MAX_PACED_AUDIO_BYTES,
        help="With playback_pacing: pending output above this is released at once (counted "
        "as omni_sidecar_paced_bound_releases_total) rather than failing the session. "
        "At most max_pending_output_bytes.",
        unit="bytes",
        positive=True,
        live=True,
        section=SECTION_PLAYBACK,
    )
    playback_ack: PlaybackAck = setting(  # noqa: RUF009 - a dataclasses.field
        "auto",
        help='Send playback.ack to the engine for clients that do not: "auto" until the '
        'client sends its own, "always" (the client\'s own acks are not forwarded), "off". '
        "On a cancel, partly heard audio is also truncated for the engine.",
        live=True,
        section=SECTION_PLAYBACK,
        metavar="MODE",
    )
    playback_ack_interval: float = setting(
        DEFAULT_ACK_INTERVAL,
        help="Seconds between the sidecar's playback.ack frames for one playing item "
        "(plus one when its audio is done, and one at a cancel). Longer costs the "
        "engine link fewer frames; shorter keeps the engine's ledger closer to what "
        "was heard if the engine cancels on its own.",
        unit="seconds",
        positive=True,
        live=True,
        section=SECTION_PLAYBACK,
    )
    interrupt_on_speech_started: bool = setting(
        False,
        help="Treat input_audio_buffer.speech_started from the engine as a cancel trigger.",
        live=True,
        section=SECTION_CANCELLATION,
    )
    max_tombstones: int = setting(
        DEFAULT_MAX_TOMBSTONES,
        help="Cancelled responses remembered per session, so late audio of them is dropped.",
        unit="count",
        minimum=1,
        live=True,
        section=SECTION_CANCELLATION,
    )
    tombstone_ttl: float = setting(
        DEFAULT_TOMBSTONE_TTL,
        help="Seconds a cancelled response is remembered after its response.done passed.",
        unit="seconds",
        minimum=0,
        live=True,
        section=SECTION_CANCELLATION,
    )
    heartbeat_interval: float = setting(
        20 * SECONDS,
        help="WebSocket ping period on both sides; a peer silent for twice this is gone. 0 = off.",
        unit="seconds",
        minimum=0,
        live=True,
        section=SECTION_TIMERS,
    )
    upstream_connect_timeout: float = setting(
        10 * SECONDS,
        help="Seconds to open the upstream WebSocket before answering 502.",
        unit="seconds",
        positive=True,
        live=True,
        section=SECTION_TIMERS,
    )
    client_resume_grace: float = setting(
        DEFAULT_CLIENT_RESUME_GRACE,
        help="Seconds a resumable session is held after its client drops without "
        "session.close: the engine keeps streaming into the session's output budget, and "
        "a session.resume on a new connection (same key, the session's token) gets what it "
        "missed. 0 = off: a dropped client ends its session at once (docs/design.md, Resume).",
        unit="seconds",
        minimum=0,
        live=True,
        section=SECTION_TIMERS,
    )
    resume_journal_bytes: int = setting(
        DEFAULT_RESUME_JOURNAL_BYTES,
        help="What a resumable session keeps of the events it wrote to its client, for a "
        "replay after a drop, counted as the memory it holds; the oldest go first, the "
        "client's session.event_ack trims it, and it counts with the session's and the "
        "process's pending output (max_pending_output_bytes, max_total_pending_output_bytes), "
        "giving way to them. A resume whose cursor is older than what is kept gets "
        "session.resync_required.",
        unit="bytes",
        positive=True,
        live=True,
        section=SECTION_LIMITS,
    )
    resume_journal_ttl: float = setting(
        DEFAULT_RESUME_JOURNAL_TTL,
        help="Seconds a written event stays in the resume journal.",
        unit="seconds",
        positive=True,
        live=True,
        section=SECTION_TIMERS,
    )
    upstream_close_timeout: float = setting(
        5 * SECONDS,
        help="Seconds to wait for session.closed after sending session.close upstream.",
        unit="seconds",
        minimum=0,
        live=True,
        section=SECTION_TIMERS,
    )
    drain_timeout: float = setting(
        30 * SECONDS,
        help="Seconds sessions may finish after SIGTERM (and to flush after the engine left).",
        unit="seconds",
        minimum=0,
        live=True,
        section=SECTION_TIMERS,
    )
    close_timeout: float = setting(
        5 * SECONDS,
        help="Seconds a closing session (overflow, shutdown) gets to deliver its final "
        "events and close frame to the client; then the connection is aborted.",
        unit="seconds",
        positive=True,
        live=True,
        section=SECTION_TIMERS,
    )
    client_idle_timeout: float = setting(
        120 * SECONDS,
        help="Seconds without a client event (a data frame; pings do not count) before the "
        "session is closed with session.closed {client_idle_timeout} and 1000. 0 = off.",
        unit="seconds",
        minimum=0,
        live=True,
        section=SECTION_TIMERS,
    )
    max_session_duration: float = setting(
        0 * SECONDS,
        help="Longest session in seconds. 0 = off.",
        unit="seconds",
        minimum=0,
        live=True,
        section=SECTION_TIMERS,
    )
