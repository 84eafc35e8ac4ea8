"""The sidecar's settings: one declaration per setting, and its validators.

Each setting is declared once, as a field of :class:`Settings` (or of
``EngineConfig`` for the ``[engine]`` table) made with
``engine_launcher.setting_schema.setting``: name, type (the annotation),
default, bounds, unit, meaning and whether a SIGHUP reload may change it.
Everything else is derived from those declarations (:data:`SETTINGS`): the
loader (``settings/load.py``), the env and flag names, ``serve --help``,
``--print-config``, the example config and docs/configuration.md
(``settings/render.py``). Adding a setting is one edit: a new field.

A default that is also the I/O-free core's default (the buffer limits, the
tombstones, the playback ledger's) is the core's named constant, so it is
written once. Durations are float seconds, sizes int bytes, counts ints.

Apart from the declarations this module holds only what they name (value
checks, secret masks) and the cross-field rules of ``Settings.__post_init__``.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import typing
from dataclasses import dataclass, field
from typing import Final, Literal
from urllib.parse import urlsplit, urlunsplit

from engine_launcher.engine_config import EngineConfig
from engine_launcher.setting_schema import (
    KIB,
    MIB,
    SECONDS,
    SettingSpec,
    setting,
    specs_of,
)
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
from proxy.errors import ConfigError
from proxy.settings.values import check, coerce, parse_listen

__all__ = [
    "CONSTRUCTOR_SOURCE",
    "DEFAULT_ADMIN_LISTEN",
    "DEFAULT_LISTEN",
    "ENGINE_SPECS",
    "LIVE_KEYS",
    "LOG_FORMATS",
    "LOG_LEVELS",
    "OVERFLOW_POLICIES",
    "SETTINGS",
    "SETTING_KEYS",
    "SPECS",
    "TOP_SPECS",
    "TRACING_MODES",
    "LogFormat",
    "LogLevel",
    "OverflowPolicy",
    "PlaybackAck",
    "Settings",
    "TracingMode",
    "UpstreamClient",
    "mask_url",
    "setting_value",
]

DEFAULT_LISTEN: Final = "127.0.0.1:8000"
DEFAULT_ADMIN_LISTEN: Final = "127.0.0.1:9464"

OverflowPolicy = Literal["close_session", "fail_response"]
OVERFLOW_POLICIES: Final[tuple[str, ...]] = typing.get_args(OverflowPolicy)
LogLevel = Literal["debug", "info", "warning", "error", "critical"]
LOG_LEVELS: Final[tuple[str, ...]] = typing.get_args(LogLevel)
LogFormat = Literal["text", "json"]
LOG_FORMATS: Final[tuple[str, ...]] = typing.get_args(LogFormat)
PlaybackAck = Literal["auto", "off", "always"]

UpstreamClient = Literal["picows", "aiohttp"]
TracingMode = Literal["off", "otlp"]
TRACING_MODES: Final[tuple[str, ...]] = typing.get_args(TracingMode)

#: The source named by errors of a directly built ``Settings``.
CONSTRUCTOR_SOURCE: Final = "Settings()"

# Section headings of the example config and docs/configuration.md, in order.
_LISTENERS: Final = "Listeners"
_ADMISSION: Final = "Admission"
_LIMITS: Final = "Per-session limits"
_CANCELLATION: Final = "Cancellation"
_TIMERS: Final = "Timers"
_AUTH: Final = "Auth and upstream request"
_LOGGING: Final = "Logging"
_PLAYBACK: Final = "Playback"


# --------------------------------------------------------------------------
# Value checks and masks named by the declarations below.


def _check_listen(value: str) -> None:
    parse_listen(value)


def _check_ws_url(value: str | None) -> None:
    if value is None:
        return
    try:
        parts = urlsplit(value)
        parts.port  # noqa: B018 - raises ValueError on a bad port
    except ValueError as exc:
        raise ValueError(f"invalid URL {value!r}: {exc}") from None
    if parts.scheme not in ("ws", "wss") or not parts.hostname:
        raise ValueError(f"expected a ws:// or wss:// URL with a host, got {value!r}")


def _check_networks(value: tuple[str, ...]) -> None:
    _check_list_items(value)
    for item in value:
        try:
            ipaddress.ip_network(item, strict=False)
        except ValueError:
            raise ValueError(f"{item!r} is not an IP network (CIDR)") from None


def _check_list_items(value: tuple[str, ...]) -> None:
    for item in value:
        if not item or item != item.strip() or "," in item:
            raise ValueError("entries must be non-empty, without spaces around them or commas")


def _check_optional_path(value: str | None) -> None:
    if value is not None and not value.strip():
        raise ValueError("must be a path or unset")


def _is_token(text: str) -> bool:
    return bool(text) and text.isprintable() and not any(c.isspace() for c in text)


def _check_upstream_authorization(value: str) -> None:
    token = value.removeprefix("key:")
    if value not in ("pass-through", "none") and not (
        value.startswith("key:") and _is_token(token)
    ):
        raise ValueError("expected 'pass-through', 'none' or 'key:<KEY>' (a non-empty token)")


def mask_url(value: str | None) -> str | None:
    if value is None:
        return None
    parts = urlsplit(value)
    if parts.password is None:
        return value
    netloc = parts.netloc.rpartition("@")[2]
    user = parts.username or ""
    return urlunsplit(parts._replace(netloc=f"{user}:***@{netloc}"))


def _mask_all(value: tuple[str, ...]) -> tuple[str, ...]:
    return tuple("***" for _ in value)


def _mask_authorization(value: str) -> str:
    return "key:***" if value.startswith("key:") else value


# --------------------------------------------------------------------------
# The declarations.


@dataclass(frozen=True, slots=True, kw_only=True)
class Settings:
    """Every proxy setting (docs/design.md, Settings). Build with :func:`load` or directly.

    Each field is the one declaration of its setting (see the module
    docstring). Direct construction validates too (handy in tests, with
    ``dataclasses.replace``); errors then name the source ``Settings()``.
    Setting :attr:`upstream` while ``engine.kind`` is ``simulator`` switches
    the engine to ``external`` with ``engine.upstream = upstream``; with
    ``engine.kind = "external"`` the two URLs are kept equal.

    Raises:
        ConfigError: A value has the wrong type or is out of range.
    """

    listen: str = setting(
        DEFAULT_LISTEN,
        help='Main listener (host:port; IPv6 as "[::1]:8000"): /v1/realtime, /v1/duplex, '
        "/healthz, /readyz, and other HTTP paths proxied to the engine.",
        section=_LISTENERS,
        metavar="HOST:PORT",
        check=_check_listen,
    )
    admin_listen: str = setting(
        DEFAULT_ADMIN_LISTEN,
        help="Admin listener (host:port): /metrics, /healthz, the operator console at / and "
        "its /debug/* JSON (docs/console.md).",
        section=_LISTENERS,
        metavar="HOST:PORT",
        check=_check_listen,
    )
    admin_token: str | None = setting(
        None,
        help="When set, every admin listener request needs it: Authorization: Bearer <token>, "
        "or HTTP Basic with the token as password (browsers). Unset = no auth (keep the "
        "admin listener on loopback or a private network).",
        section=_LISTENERS,
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
        section=_LISTENERS,
    )
    request_head_timeout: float = setting(
        10 * SECONDS,
        help="Client listener: seconds to send a complete request head, from the connection's "
        "start or the end of the previous response; then 408 and the connection is closed.",
        unit="seconds",
        positive=True,
        live=True,
        section=_LISTENERS,
    )
    max_pending_handshakes: int = setting(
        256,
        help="Client listener: connections whose request head is not complete yet, plus "
        "those lingering after an error answer; one more is closed at once.",
        unit="count",
        positive=True,
        live=True,
        section=_LISTENERS,
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
        section=_LISTENERS,
    )
    lingering_timeout: float = setting(
        2 * SECONDS,
        help="Client listener: a lingering connection from which nothing arrived for this "
        "many seconds is closed (within lingering_time).",
        unit="seconds",
        positive=True,
        live=True,
        section=_LISTENERS,
    )
    max_lingering_bytes: int = setting(
        1 * MIB,
        help="Client listener: a lingering connection stops being read once it has sent this "
        "many bytes after the answer; TCP flow control then holds the client, and the socket "
        "is closed at lingering_time.",
        unit="bytes",
        positive=True,
        live=True,
        section=_LISTENERS,
    )
    max_http_body_bytes: int = setting(
        16 * MIB,
        help="Largest reverse-proxied request body (counted while streaming, chunked too); "
        "beyond it 413 and the engine request is aborted.",
        unit="bytes",
        positive=True,
        live=True,
        section=_LISTENERS,
    )
    trusted_proxies: tuple[str, ...] = setting(
        (),
        help="CIDR networks of proxies in front of the sidecar. Only from these peers are "
        "X-Forwarded-For (rightmost untrusted hop) and a PROXY protocol v1/v2 header honoured "
        "for the per-IP limit and logs; a PROXY header from any other peer closes the "
        "connection. Empty = off.",
        live=True,
        section=_LISTENERS,
        example='["127.0.0.1/32", "10.0.0.0/8"]',
        metavar="CIDR,...",
        check=_check_networks,
    )
    upstream: str | None = setting(
        None,
        help="ws:// or wss:// URL of an existing engine. Setting it switches engine.kind "
        'from "simulator" to "external" (no child process).',
        section=_LISTENERS,
        example='"ws://127.0.0.1:8091"',
        metavar="URL",
        check=_check_ws_url,
        mask=mask_url,
    )
    max_sessions: int = setting(
        64,
        help="Concurrent sessions admitted; more get 503 + Retry-After. 0 = unlimited.",
        unit="count",
        minimum=0,
        live=True,
        section=_ADMISSION,
    )
    admission_timeout: float = setting(
        0 * SECONDS,
        help="Seconds to wait for a free session slot before answering 503. 0 = answer at once.",
        unit="seconds",
        minimum=0,
        live=True,
        section=_ADMISSION,
    )
    max_sessions_per_ip: int = setting(
        0,
        help="Concurrent sessions per client IP. 0 = off.",
        unit="count",
        minimum=0,
        live=True,
        section=_ADMISSION,
    )
    max_sessions_per_engine: int = setting(
        0,
        help="Concurrent sessions one engine replica takes (docs/design.md, Engine pool); "
        "when every ready replica is full, 503 + Retry-After. 0 = max_sessions.",
        unit="count",
        minimum=0,
        live=True,
        section=_ADMISSION,
    )
    handshake_timeout: float = setting(
        10 * SECONDS,
        help="Seconds allowed for the client's WebSocket handshake.",
        unit="seconds",
        positive=True,
        live=True,
        section=_ADMISSION,
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
        section=_ADMISSION,
    )
    engine_full_backoff: float = setting(
        5 * SECONDS,
        help="Seconds an engine replica that said it is full (resource_exhausted at open) "
        "gets no new session: they go to another replica, or get 503 engine_capacity + "
        "Retry-After without an upstream connect. 0 = off.",
        unit="seconds",
        minimum=0,
        live=True,
        section=_ADMISSION,
    )
    max_client_message_bytes: int = setting(
        15 * MIB,
        help="Largest client frame; a larger one closes the session with 1009.",
        unit="bytes",
        positive=True,
        section=_LIMITS,
    )
    max_pending_output_bytes: int = setting(
        DEFAULT_MAX_PENDING_OUTPUT_BYTES,
        help="Ordinary output budget per session: queued bytes toward the client.",
        unit="bytes",
        positive=True,
        live=True,
        section=_LIMITS,
    )
    max_pending_output_events: int = setting(
        DEFAULT_MAX_PENDING_OUTPUT_EVENTS,
        help="Ordinary output budget per session: queued events toward the client.",
        unit="count",
        positive=True,
        live=True,
        section=_LIMITS,
    )
    output_reserve_bytes: int = setting(
        DEFAULT_OUTPUT_RESERVE_BYTES,
        help="Reserve usable only by `error` and `response.done` once the budget is full "
        "(bytes); at most max_pending_output_bytes.",
        unit="bytes",
        minimum=0,
        live=True,
        section=_LIMITS,
    )
    output_reserve_events: int = setting(
        DEFAULT_OUTPUT_RESERVE_EVENTS,
        help="Reserve usable only by `error` and `response.done` once the budget is full "
        "(events); at most max_pending_output_events.",
        unit="count",
        minimum=0,
        live=True,
        section=_LIMITS,
    )
    max_close_notice_bytes: int = setting(
        DEFAULT_MAX_CLOSE_NOTICE_BYTES,
        help="Largest final `session.closed` notice; a larger one is replaced by a compact "
        "one (reason close_details_exceed_output_limit).",
        unit="bytes",
        positive=True,
        live=True,
        section=_LIMITS,
    )
    max_total_pending_output_bytes: int = setting(
        256 * MIB,
        help="Process-wide output cap; past it the largest session is shed.",
        unit="bytes",
        positive=True,
        section=_LIMITS,
    )
    client_write_buffer_bytes: int = setting(
        64 * KIB,
        help="Transport high-water mark toward the client.",
        unit="bytes",
        positive=True,
        live=True,
        section=_LIMITS,
    )
    overflow_policy: OverflowPolicy = setting(  # noqa: RUF009 - a dataclasses.field
        "close_session",
        help='What to do when a session\'s output budget overflows: "close_session" (close '
        'with 1008) or "fail_response" (fail the active response, keep the session).',
        live=True,
        section=_LIMITS,
        metavar="POLICY",
    )
    max_pending_input_bytes: int = setting(
        16 * MIB,
        help="Unsent bytes toward the engine per session.",
        unit="bytes",
        positive=True,
        live=True,
        section=_LIMITS,
    )
    max_input_audio_rate: float = setting(
        4.0,
        help="Appended input audio, in audio seconds per wall-clock second, averaged over "
        "5 s with a burst allowance of 10 s of audio. 0 = off.",
        unit="ratio",
        minimum=0,
        live=True,
        section=_LIMITS,
    )
    max_client_frame_rate: float = setting(
        200.0,
        help="Client data frames per second per session (pings excluded; audio also has "
        "max_input_audio_rate). Above it frames are dropped with one error "
        "{client_rate_limited}; 2 s of it closes the session with 1008. 0 = off.",
        unit="frames/s",
        minimum=0,
        live=True,
        section=_LIMITS,
    )
    client_frame_burst: float = setting(
        400.0,
        help="Client frames allowed at once above max_client_frame_rate (token bucket size).",
        unit="frames",
        minimum=0,
        live=True,
        section=_LIMITS,
    )
    playback_pacing: bool = setting(
        False,
        help="Release a response's audio no faster than real time plus max_audio_lead, so "
        "after a barge-in at most that much of the old answer is in the client. Held audio "
        "stays in the session's buffer (bounded by max_paced_audio_bytes).",
        live=True,
        section=_PLAYBACK,
    )
    max_audio_lead: float = setting(
        DEFAULT_MAX_AUDIO_LEAD,
        help="With playback_pacing: audio seconds a client may hold ahead of real time.",
        unit="seconds",
        minimum=0,
        live=True,
        section=_PLAYBACK,
    )
    max_paced_audio_bytes: int = setting(
        DEFAULT_MAX_PACED_AUDIO_BYTES,
        help="With playback_pacing: pending output above this is released at once (counted "
        "as omni_sidecar_paced_bound_releases_total) rather than failing the session. "
        "At most max_pending_output_bytes.",
        unit="bytes",
        positive=True,
        live=True,
        section=_PLAYBACK,
    )
    playback_ack: PlaybackAck = setting(  # noqa: RUF009 - a dataclasses.field
        "auto",
        help='Send playback.ack to the engine for clients that do not: "auto" until the '
        'client sends its own, "always" (the client\'s own acks are not forwarded), "off". '
        "On a cancel, partly heard audio is also truncated for the engine.",
        live=True,
        section=_PLAYBACK,
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
        section=_PLAYBACK,
    )
    interrupt_on_speech_started: bool = setting(
        False,
        help="Treat input_audio_buffer.speech_started from the engine as a cancel trigger.",
        live=True,
        section=_CANCELLATION,
    )
    max_tombstones: int = setting(
        DEFAULT_MAX_TOMBSTONES,
        help="Cancelled responses remembered per session, so late audio of them is dropped.",
        unit="count",
        minimum=1,
        live=True,
        section=_CANCELLATION,
    )
    tombstone_ttl: float = setting(
        DEFAULT_TOMBSTONE_TTL,
        help="Seconds a cancelled response is remembered after its response.done passed.",
        unit="seconds",
        minimum=0,
        live=True,
        section=_CANCELLATION,
    )
    heartbeat_interval: float = setting(
        20 * SECONDS,
        help="WebSocket ping period on both sides; a peer silent for twice this is gone. 0 = off.",
        unit="seconds",
        minimum=0,
        live=True,
        section=_TIMERS,
    )
    upstream_connect_timeout: float = setting(
        10 * SECONDS,
        help="Seconds to open the upstream WebSocket before answering 502.",
        unit="seconds",
        positive=True,
        live=True,
        section=_TIMERS,
    )
    upstream_close_timeout: float = setting(
        5 * SECONDS,
        help="Seconds to wait for session.closed after sending session.close upstream.",
        unit="seconds",
        minimum=0,
        live=True,
        section=_TIMERS,
    )
    drain_timeout: float = setting(
        30 * SECONDS,
        help="Seconds sessions may finish after SIGTERM (and to flush after the engine left).",
        unit="seconds",
        minimum=0,
        live=True,
        section=_TIMERS,
    )
    close_timeout: float = setting(
        5 * SECONDS,
        help="Seconds a closing session (overflow, shutdown) gets to deliver its final "
        "events and close frame to the client; then the connection is aborted.",
        unit="seconds",
        positive=True,
        live=True,
        section=_TIMERS,
    )
    client_idle_timeout: float = setting(
        120 * SECONDS,
        help="Seconds without a client event (a data frame; pings do not count) before the "
        "session is closed with session.closed {client_idle_timeout} and 1000. 0 = off.",
        unit="seconds",
        minimum=0,
        live=True,
        section=_TIMERS,
    )
    max_session_duration: float = setting(
        0 * SECONDS,
        help="Longest session in seconds. 0 = off.",
        unit="seconds",
        minimum=0,
        live=True,
        section=_TIMERS,
    )
    api_keys: tuple[str, ...] = setting(
        (),
        help="Accepted API keys. Auth is off when both api_keys and api_keys_file are unset.",
        live=True,
        section=_AUTH,
        example='["change-me"]',
        metavar="KEY,...",
        check=_check_list_items,
        mask=_mask_all,
    )
    api_keys_file: str | None = setting(
        None,
        help="File with one API key per line (# starts a comment); re-read on reload.",
        live=True,
        section=_AUTH,
        example='"/etc/omni-sidecar/api-keys"',
        metavar="PATH",
        check=_check_optional_path,
    )
    allowed_origins: tuple[str, ...] = setting(
        (),
        help="Allowed Origin values; checked only when the client sends Origin. Empty = any "
        "origin.",
        live=True,
        section=_AUTH,
        example='["https://app.example"]',
        metavar="ORIGIN,...",
        check=_check_list_items,
    )
    quota_redis_url: str | None = setting(
        None,
        help="Redis URL (redis://host:port/db) that holds the per-key quota counts, shared by "
        "every sidecar that names it; unset = each process counts its own "
        "(docs/design.md, Quotas). Needs pip install 'omni-sidecar[redis]'. While Redis "
        "does not answer, "
        "this process falls back to its own counts and says so in /readyz and "
        "omni_sidecar_quota_backend_down.",
        section=_AUTH,
        example='"redis://127.0.0.1:6379/0"',
        metavar="URL",
        mask=mask_url,
    )
    quota_redis_timeout: float = setting(
        0.25,
        help="Longest wait for one Redis quota call (seconds); a call that takes longer "
        "counts as Redis down and the local counts decide.",
        unit="seconds",
        minimum=0.01,
        maximum=5.0,
        section=_AUTH,
    )
    quota_redis_max_connections: int = setting(
        16,
        help="Most Redis connections this process opens for quota calls (connections). A "
        "call that finds every one busy waits for one within its quota_redis_timeout; one "
        "still waiting then fails like any late call (counted in "
        "omni_sidecar_quota_backend_errors_total, local counts until Redis answers a check).",
        unit="connections",
        minimum=1,
        maximum=1024,
        section=_AUTH,
    )
    quota_slot_ttl: float = setting(
        30.0,
        help="Seconds a session's concurrent slot lives in Redis without a heartbeat; live "
        "sessions refresh theirs every quota_check_interval, so the slots of a crashed "
        "sidecar free themselves after this long.",
        unit="seconds",
        minimum=2.0,
        section=_AUTH,
    )
    quota_check_interval: float = setting(
        1.0,
        help="How often (seconds) running sessions' audio is charged to their key's day "
        "quota and their Redis slots refreshed; a session whose key ran out of audio "
        "seconds is ended at the next check.",
        unit="seconds",
        minimum=0.05,
        maximum=10.0,
        section=_AUTH,
    )
    upstream_authorization: str = setting(
        "pass-through",
        help='Authorization sent upstream: "pass-through" (the client\'s header), "none", '
        'or "key:<KEY>" (send this key instead).',
        live=True,
        section=_AUTH,
        metavar="pass-through|none|key:KEY",
        check=_check_upstream_authorization,
        mask=_mask_authorization,
    )
    upstream_client: UpstreamClient = setting(  # noqa: RUF009 - a dataclasses.field
        "picows",
        help='WebSocket client for the engine link: "picows" (frames parsed and masked in C, '
        'handed over by callback: the fast one) or "aiohttp" (the pure asyncio reader). '
        "Applies to sessions opened after a change.",
        live=True,
        section=_AUTH,
        metavar="CLIENT",
    )
    forward_query: bool = setting(
        True,
        help="Forward the client's query string upstream.",
        live=True,
        section=_AUTH,
    )
    upstream_autostart_off: bool = setting(
        False,
        help="Add autostart=0 to the upstream query when the client did not set autostart "
        "(avoids the engine opening a default session before the client's "
        "session.update). Off by default: a client that connects with ?model= and waits "
        "for session.created would otherwise wait forever.",
        live=True,
        section=_AUTH,
    )
    log_level: LogLevel = setting(  # noqa: RUF009 - a dataclasses.field
        "info",
        help="Log level.",
        live=True,
        section=_LOGGING,
        metavar="LEVEL",
    )
    log_format: LogFormat = setting(  # noqa: RUF009 - a dataclasses.field
        "text",
        help='Log line format: "text" (human-readable) or "json" (one object per line with '
        "ts, level, logger, message and fields such as session).",
        live=True,
        section=_LOGGING,
        metavar="FORMAT",
    )
    usage_file: str | None = setting(
        None,
        help="JSONL file that gets one usage record per ended session; off when unset. "
        "Written by a thread of its own, never by the event loop (see docs/design.md, Usage).",
        section=_LOGGING,
        example='"/var/log/omni-sidecar/usage.jsonl"',
        metavar="PATH",
        check=_check_optional_path,
    )
    usage_file_max_bytes: int = setting(
        64 * MIB,
        help="Size in bytes at which the usage file is rotated (renamed to .1, .2, ...).",
        unit="bytes",
        minimum=4 * KIB,
        section=_LOGGING,
    )
    usage_file_backups: int = setting(
        3,
        help="Rotated usage files kept; the oldest is deleted beyond it. 0 = truncate on "
        "rotation. Disk use stays below (usage_file_backups + 1) x usage_file_max_bytes.",
        unit="files",
        minimum=0,
        maximum=100,
        section=_LOGGING,
    )
    usage_file_max_pending: int = setting(
        1000,
        help="Usage records waiting for the file writer (records). When the writer falls "
        "this far behind (a slow disk), a new record is dropped and counted in "
        "omni_sidecar_usage_records_dropped_total; the access line still has it.",
        unit="records",
        minimum=1,
        section=_LOGGING,
    )
    tracing: TracingMode = setting(  # noqa: RUF009 - a dataclasses.field
        "off",
        help='OpenTelemetry tracing: "off" (the packages are not even imported) or "otlp" '
        "(a span per session, a child per response, exported over OTLP/HTTP as the standard "
        "OTEL_* variables say; needs pip install 'omni-sidecar[otel]'). OTEL_SDK_DISABLED=true "
        "turns it off as well. Queued spans are bounded by OTEL_BSP_MAX_QUEUE_SIZE (2048 "
        "spans); when full, new spans are dropped.",
        section=_LOGGING,
        metavar="off|otlp",
    )
    engine: EngineConfig = field(default_factory=EngineConfig)

    def __post_init__(self) -> None:
        for spec in TOP_SPECS.values():
            value = coerce(spec, getattr(self, spec.name), CONSTRUCTOR_SOURCE)
            check(spec, value, CONSTRUCTOR_SOURCE)
            object.__setattr__(self, spec.name, value)
        if not isinstance(self.engine, EngineConfig):
            raise ConfigError(
                "engine", f"expected an EngineConfig, got {self.engine!r}", CONSTRUCTOR_SOURCE
            )
        # Cross-field bounds: a reserve larger than its budget makes no sense.
        for reserve, budget in (
            ("output_reserve_bytes", "max_pending_output_bytes"),
            ("output_reserve_events", "max_pending_output_events"),
        ):
            if getattr(self, reserve) > getattr(self, budget):
                raise ConfigError(
                    reserve,
                    f"must be <= {budget} ({getattr(self, budget)}), got {getattr(self, reserve)}",
                    CONSTRUCTOR_SOURCE,
                )
        # "upstream implies external" (docs/design.md, Settings), kept consistent both ways.
        engine = self.engine
        if self.upstream is not None:
            if engine.kind == "simulator":
                # Cannot fail: `upstream` passed the same ws:// check above.
                engine = dataclasses.replace(engine, kind="external", upstream=self.upstream)
            elif engine.kind != "external":
                raise ConfigError(
                    "upstream",
                    f"cannot be combined with engine.kind {engine.kind!r}",
                    CONSTRUCTOR_SOURCE,
                )
            elif engine.upstream != self.upstream:
                raise ConfigError(
                    "upstream",
                    f"{self.upstream!r} differs from engine.upstream {engine.upstream!r}",
                    CONSTRUCTOR_SOURCE,
                )
            object.__setattr__(self, "engine", engine)
        elif engine.kind == "external":
            object.__setattr__(self, "upstream", engine.upstream)


# --------------------------------------------------------------------------
# Specs derived from the declarations.

TOP_SPECS: Final[dict[str, SettingSpec]] = specs_of(Settings, "")
ENGINE_SPECS: Final[dict[str, SettingSpec]] = specs_of(EngineConfig, "engine.")
SPECS: Final[dict[str, SettingSpec]] = {**TOP_SPECS, **ENGINE_SPECS}
"""Every setting by key; engine keys are written ``engine.<field>``."""

SETTINGS: Final[tuple[SettingSpec, ...]] = tuple(SPECS.values())
"""Every setting, in display order (top-level first, then ``[engine]``)."""

SETTING_KEYS: Final[tuple[str, ...]] = tuple(SPECS)
"""Every key, in display order; engine keys are written ``engine.<field>``."""

LIVE_KEYS: Final[frozenset[str]] = frozenset(s.key for s in SETTINGS if s.doc.live)
"""Keys a SIGHUP reload applies; a change to any other key needs a restart."""


def setting_value(settings: Settings, key: str) -> object:
    """Return the value of ``key`` (``engine.<field>`` for engine fields) in ``settings``."""
    if key.startswith("engine."):
        return getattr(settings.engine, key[len("engine.") :])
    return getattr(settings, key)
