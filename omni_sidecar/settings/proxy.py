"""Settings: one flat namespace, loaded from defaults < TOML file < env < flags.

Each setting is declared once, as a field of :class:`Settings` (or of
``EngineConfig`` for the ``[engine]`` table) made with
``omni_sidecar.settings.engine.setting``: name, type (the annotation), default,
bounds, unit, meaning and whether a SIGHUP reload may change it. Everything
else is derived from those declarations (:data:`SETTINGS`): the loader, the
env and flag names, ``serve --help``, ``--print-config`` and the example
config (``python -m omni_sidecar.settings.proxy --example``). Adding a setting is one edit:
a new field.

Every key has the same name in each source (docs/design.md, Settings): TOML key
``max_sessions`` = env ``OMNI_SIDECAR_MAX_SESSIONS`` = flag ``--max-sessions``.
The ``[engine]`` table maps to ``OMNI_SIDECAR_ENGINE_<KEY>`` and
``--engine-<key>``. Durations are float seconds, sizes int bytes, counts ints.

:func:`load` is pure: the caller passes the flag values, the environment and
the file path, so tests need no monkeypatching. It returns the frozen
:class:`Settings` and, for each key, where its value came from, which
:func:`format_settings` prints for ``--print-config``.

Text values (env and flags) are parsed by the field's type: booleans accept
``1/0/true/false/yes/no/on/off``; integers may contain underscores; lists are
comma-separated (``OMNI_SIDECAR_API_KEYS=k1,k2``); ``engine.env`` is
``K=V,K2=V2``; argv fields (``engine.extra_args``, ``engine.command``,
``engine.simulator_args``) are split like a shell (``shlex``). An empty value
unsets an optional key.

Env vars that start with ``OMNI_SIDECAR_TESTS_`` belong to the test suite and
``OMNI_SIDECAR_CONFIG`` names the config file for the CLI; :func:`load`
ignores both. Any other unknown ``OMNI_SIDECAR_*`` variable is an error, as is
an unknown key in the file, so a typo never goes unnoticed.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import enum
import ipaddress
import json
import math
import shlex
import sys
import textwrap
import tomllib
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Final, Literal
from urllib.parse import urlsplit, urlunsplit

from omni_sidecar.errors import ConfigError
from omni_sidecar.settings.engine import (
    SETTING_METADATA,
    EngineConfig,
    EngineConfigError,
    SettingDoc,
    setting,
)

__all__ = [
    "CONFIG_PATH_ENV",
    "DEFAULT_ADMIN_LISTEN",
    "DEFAULT_LISTEN",
    "ENV_PREFIX",
    "KIB",
    "LIVE_KEYS",
    "LOG_FORMATS",
    "LOG_LEVELS",
    "MIB",
    "OVERFLOW_POLICIES",
    "SETTINGS",
    "SETTING_KEYS",
    "TESTS_ENV_PREFIX",
    "TRACING_MODES",
    "LoadedSettings",
    "LogFormat",
    "LogLevel",
    "OverflowPolicy",
    "SettingSpec",
    "Settings",
    "TracingMode",
    "add_cli_arguments",
    "env_name",
    "example_config",
    "flag_name",
    "flag_values",
    "format_settings",
    "load",
    "parse_listen",
    "setting_value",
]

BYTES: Final = 1
KIB: Final = 1024 * BYTES
MIB: Final = 1024 * KIB
SECONDS: Final = 1.0

ENV_PREFIX: Final = "OMNI_SIDECAR_"
TESTS_ENV_PREFIX: Final = "OMNI_SIDECAR_TESTS_"
CONFIG_PATH_ENV: Final = "OMNI_SIDECAR_CONFIG"
"""Env var the CLI may read for the config file path; :func:`load` ignores it."""

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

_CONSTRUCTOR_SOURCE: Final = "Settings()"

# Section headings of the example config, in order.
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


def _mask_url(value: str | None) -> str | None:
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
        mask=_mask_url,
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
        2 * MIB,
        help="Ordinary output budget per session: queued bytes toward the client.",
        unit="bytes",
        positive=True,
        live=True,
        section=_LIMITS,
    )
    max_pending_output_events: int = setting(
        512,
        help="Ordinary output budget per session: queued events toward the client.",
        unit="count",
        positive=True,
        live=True,
        section=_LIMITS,
    )
    output_reserve_bytes: int = setting(
        64 * KIB,
        help="Reserve usable only by `error` and `response.done` once the budget is full "
        "(bytes); at most max_pending_output_bytes.",
        unit="bytes",
        minimum=0,
        live=True,
        section=_LIMITS,
    )
    output_reserve_events: int = setting(
        8,
        help="Reserve usable only by `error` and `response.done` once the budget is full "
        "(events); at most max_pending_output_events.",
        unit="count",
        minimum=0,
        live=True,
        section=_LIMITS,
    )
    max_close_notice_bytes: int = setting(
        4096 * BYTES,
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
        0.5 * SECONDS,
        help="With playback_pacing: audio seconds a client may hold ahead of real time.",
        unit="seconds",
        minimum=0,
        live=True,
        section=_PLAYBACK,
    )
    max_paced_audio_bytes: int = setting(
        1 * MIB,
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
        0.25 * SECONDS,
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
        256,
        help="Cancelled responses remembered per session, so late audio of them is dropped.",
        unit="count",
        minimum=1,
        live=True,
        section=_CANCELLATION,
    )
    tombstone_ttl: float = setting(
        60 * SECONDS,
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
        mask=_mask_url,
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
        for spec in _TOP_SPECS.values():
            value = _coerce(spec, getattr(self, spec.name), _CONSTRUCTOR_SOURCE)
            _check(spec, value, _CONSTRUCTOR_SOURCE)
            object.__setattr__(self, spec.name, value)
        if not isinstance(self.engine, EngineConfig):
            raise ConfigError(
                "engine", f"expected an EngineConfig, got {self.engine!r}", _CONSTRUCTOR_SOURCE
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
                    _CONSTRUCTOR_SOURCE,
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
                    _CONSTRUCTOR_SOURCE,
                )
            elif engine.upstream != self.upstream:
                raise ConfigError(
                    "upstream",
                    f"{self.upstream!r} differs from engine.upstream {engine.upstream!r}",
                    _CONSTRUCTOR_SOURCE,
                )
            object.__setattr__(self, "engine", engine)
        elif engine.kind == "external":
            object.__setattr__(self, "upstream", engine.upstream)


@dataclass(frozen=True, slots=True)
class LoadedSettings:
    """What :func:`load` returns.

    Attributes:
        settings: The validated settings.
        sources: For every key in :data:`SETTING_KEYS` (engine keys as
            ``engine.<field>``): ``"default"``, ``"file <path>"``,
            ``"env OMNI_SIDECAR_<KEY>"`` or ``"flag --<key>"``.
    """

    settings: Settings
    sources: dict[str, str]


# --------------------------------------------------------------------------
# Specs derived from the declarations.


class _Type(enum.Enum):
    BOOL = "boolean"
    INT = "integer"
    OPT_INT = "integer or nothing"
    FLOAT = "number"
    STR = "string"
    OPT_STR = "string or nothing"
    STR_LIST = "list of strings"
    ARGV = "argument list"
    ENV = "table of strings"


_UNIT_METAVARS: Final = {"seconds": "SECONDS", "bytes": "BYTES", "count": "N", "ratio": "RATIO"}


@dataclass(frozen=True, slots=True)
class SettingSpec:
    """One setting as derived from its declaration (see :data:`SETTINGS`).

    Attributes:
        key: ``max_sessions``; engine fields as ``engine.<field>``.
        name: The dataclass field's name (the key without ``engine.``).
        type: How text is parsed and which TOML type is expected.
        default: The declared default.
        doc: The declaration's :class:`SettingDoc`.
        choices: Allowed values of a ``Literal`` type, else empty.
    """

    key: str
    name: str
    type: _Type
    default: object
    doc: SettingDoc
    choices: tuple[str, ...]

    @property
    def env(self) -> str:
        return env_name(self.key)

    @property
    def flag(self) -> str:
        return flag_name(self.key)

    @property
    def metavar(self) -> str:
        return self.doc.metavar or _UNIT_METAVARS.get(self.doc.unit, "VALUE")


def _type_of(hint: object, doc: SettingDoc) -> tuple[_Type, tuple[str, ...]]:
    """Map a field's annotation to the loader's value type (and Literal choices)."""
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin is Literal:
        return _Type.STR, tuple(str(a) for a in args)
    if origin in (typing.Union, types.UnionType) and type(None) in args:
        inner = [a for a in args if a is not type(None)]
        if inner == [int]:
            return _Type.OPT_INT, ()
        if inner == [str]:
            return _Type.OPT_STR, ()
    if origin is tuple:
        if args == (str, Ellipsis):
            return (_Type.ARGV if doc.argv else _Type.STR_LIST), ()
        if args and typing.get_origin(args[0]) is tuple:
            return _Type.ENV, ()
    simple = {bool: _Type.BOOL, int: _Type.INT, float: _Type.FLOAT, str: _Type.STR}
    if isinstance(hint, type) and hint in simple:
        return simple[hint], ()
    raise TypeError(f"no loader for a setting of type {hint!r}")  # pragma: no cover


def _specs_of(cls: type, prefix: str) -> dict[str, SettingSpec]:
    hints = typing.get_type_hints(cls)
    specs: dict[str, SettingSpec] = {}
    for f in dataclasses.fields(cls):
        doc = f.metadata.get(SETTING_METADATA)
        if doc is None:
            continue
        kind, choices = _type_of(hints[f.name], doc)
        key = prefix + f.name
        specs[key] = SettingSpec(key, f.name, kind, f.default, doc, choices)
    return specs


_TOP_SPECS: Final[dict[str, SettingSpec]] = _specs_of(Settings, "")
_ENGINE_SPECS: Final[dict[str, SettingSpec]] = _specs_of(EngineConfig, "engine.")
_SPECS: Final[dict[str, SettingSpec]] = {**_TOP_SPECS, **_ENGINE_SPECS}

SETTINGS: Final[tuple[SettingSpec, ...]] = tuple(_SPECS.values())
"""Every setting, in display order (top-level first, then ``[engine]``)."""

SETTING_KEYS: Final[tuple[str, ...]] = tuple(_SPECS)
"""Every key, in display order; engine keys are written ``engine.<field>``."""

LIVE_KEYS: Final[frozenset[str]] = frozenset(s.key for s in SETTINGS if s.doc.live)
"""Keys a SIGHUP reload applies; a change to any other key needs a restart."""

_TRUE: Final = frozenset({"1", "true", "yes", "on"})
_FALSE: Final = frozenset({"0", "false", "no", "off"})


def env_name(key: str) -> str:
    """Return the env var for a key: ``engine.port`` → ``OMNI_SIDECAR_ENGINE_PORT``."""
    return ENV_PREFIX + key.replace(".", "_").upper()


def flag_name(key: str) -> str:
    """Return the flag for a key: ``engine.deploy_config`` → ``--engine-deploy-config``."""
    return "--" + key.replace(".", "-").replace("_", "-")


_ENV_TO_KEY: Final[dict[str, str]] = {env_name(key): key for key in SETTING_KEYS}
_DEST_TO_KEY: Final[dict[str, str]] = {key.replace(".", "_"): key for key in SETTING_KEYS}


# --------------------------------------------------------------------------
# Parsing and checking single values.


def _describe(value: object) -> str:
    return f"{value!r} ({type(value).__name__})"


def _coerce(spec: SettingSpec, value: object, source: str) -> object:
    """Check a typed value (TOML, flags, constructor) and normalise it."""
    key, kind = spec.key, spec.type
    if kind is _Type.BOOL:
        if isinstance(value, bool):
            return value
    elif kind in (_Type.INT, _Type.OPT_INT):
        if value is None and kind is _Type.OPT_INT:
            return None
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif kind is _Type.FLOAT:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            try:
                result = float(value)
            except OverflowError:
                result = math.inf
            if not math.isfinite(result):
                raise ConfigError(key, f"must be a finite number, got {value!r}", source)
            return result
    elif kind in (_Type.STR, _Type.OPT_STR):
        if value is None and kind is _Type.OPT_STR:
            return None
        if isinstance(value, str):
            # Choices are lower case; accept "INFO" for "info".
            return value.lower() if value.lower() in spec.choices else value
    elif kind in (_Type.STR_LIST, _Type.ARGV):
        if isinstance(value, str) and kind is _Type.ARGV:
            return _parse_text(spec, value, source)
        if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
            return tuple(value)
    elif kind is _Type.ENV:
        if isinstance(value, Mapping):
            value = list(value.items())
        if isinstance(value, (list, tuple)) and all(
            isinstance(p, (list, tuple))
            and len(p) == 2
            and isinstance(p[0], str)
            and isinstance(p[1], str)
            for p in value
        ):
            return tuple((str(p[0]), str(p[1])) for p in value)
    raise ConfigError(key, f"expected a {kind.value}, got {_describe(value)}", source)


def _parse_text(spec: SettingSpec, text: str, source: str) -> object:
    """Parse a value given as text (env var or flag) by the key's type."""
    key, kind = spec.key, spec.type
    stripped = text.strip()
    if kind is _Type.BOOL:
        lowered = stripped.lower()
        if lowered in _TRUE:
            return True
        if lowered in _FALSE:
            return False
        raise ConfigError(
            key, f"invalid boolean {text!r} (use 1/0, true/false, yes/no, on/off)", source
        )
    if kind in (_Type.OPT_INT, _Type.OPT_STR) and not stripped:
        return None
    if kind in (_Type.INT, _Type.OPT_INT):
        try:
            return int(stripped, 10)
        except ValueError:
            raise ConfigError(key, f"invalid integer {text!r}", source) from None
    if kind is _Type.FLOAT:
        try:
            number = float(stripped)
        except ValueError:
            raise ConfigError(key, f"invalid number {text!r}", source) from None
        return _coerce(spec, number, source)
    if kind in (_Type.STR, _Type.OPT_STR):
        return _coerce(spec, stripped, source)
    if kind is _Type.STR_LIST:
        return tuple(item.strip() for item in text.split(",") if item.strip())
    if kind is _Type.ARGV:
        try:
            return tuple(shlex.split(text))
        except ValueError as exc:
            raise ConfigError(key, f"cannot split {text!r} like a shell: {exc}", source) from None
    pairs: list[tuple[str, str]] = []  # _Type.ENV: "K=V,K2=V2"
    for item in text.split(","):
        if not item.strip():
            continue
        name, sep, val = item.partition("=")
        if not sep or not name.strip():
            raise ConfigError(key, f"expected NAME=VALUE items, got {item.strip()!r}", source)
        pairs.append((name.strip(), val))
    return tuple(pairs)


def _check(spec: SettingSpec, value: object, source: str) -> None:
    """The declared bounds, choices and check of one normalised value."""
    key, doc = spec.key, spec.doc
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if doc.positive and value <= 0:
            raise ConfigError(key, f"must be > 0, got {value!r}", source)
        if doc.minimum is not None and value < doc.minimum:
            raise ConfigError(key, f"must be >= {doc.minimum:g}, got {value!r}", source)
        if doc.maximum is not None and value > doc.maximum:
            raise ConfigError(key, f"must be <= {doc.maximum:g}, got {value!r}", source)
    if spec.choices and value not in spec.choices:
        choices = ", ".join(repr(c) for c in spec.choices)
        raise ConfigError(key, f"unknown value {value!r}; expected one of {choices}", source)
    if doc.check is not None:
        try:
            doc.check(value)
        except ValueError as exc:
            raise ConfigError(key, str(exc), source) from None


def parse_listen(value: str) -> tuple[str, int]:
    """Split a listen address into host and port.

    Args:
        value: ``"host:port"``; an IPv6 host goes in brackets (``"[::1]:8000"``).
            Port 0 asks the OS for a free port.

    Returns:
        ``(host, port)``, the host without brackets.

    Raises:
        ValueError: The address is malformed.
    """
    host, sep, port_text = value.rpartition(":")
    if not sep or not host:
        raise ValueError(f"invalid listen address {value!r}; expected HOST:PORT")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        if not host or ":" not in host:
            raise ValueError(f"invalid IPv6 address in {value!r}")
    elif ":" in host or "[" in host or "]" in host:
        raise ValueError(f"invalid listen address {value!r}; write IPv6 as [ADDR]:PORT")
    if any(c.isspace() for c in host):
        raise ValueError(f"invalid listen address {value!r}")
    if not port_text.isdigit() or not port_text.isascii() or int(port_text) > 65535:
        raise ValueError(f"invalid port {port_text!r} in {value!r}; expected 0..65535")
    return host, int(port_text)


# --------------------------------------------------------------------------
# Loading.


def _unknown(key: str, source: str) -> ConfigError:
    close = difflib.get_close_matches(key, SETTING_KEYS, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return ConfigError(key, f"unknown setting{hint}", source)


def _read_file(path: str) -> dict[str, object]:
    source = f"file {path}"
    try:
        with open(path, "rb") as fh:
            data = tomllib.load(fh)
    except OSError as exc:
        raise ConfigError("config", f"cannot read: {exc.strerror or exc}", source) from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError("config", f"invalid TOML: {exc}", source) from None
    values: dict[str, object] = {}
    for name, value in data.items():
        if name == "engine":
            if not isinstance(value, dict):
                raise ConfigError("engine", "expected a table ([engine])", source)
            for sub, sub_value in value.items():
                key = f"engine.{sub}"
                if key not in _SPECS:
                    raise _unknown(key, source)
                values[key] = _coerce(_SPECS[key], sub_value, source)
        elif name in _TOP_SPECS:
            values[name] = _coerce(_SPECS[name], value, source)
        else:
            raise _unknown(name, source)
    return values


def load(
    argv_values: Mapping[str, object] | None,
    environ: Mapping[str, str],
    path: str | None,
) -> LoadedSettings:
    """Load and validate settings: defaults < TOML file < env < flags.

    Args:
        argv_values: Flag values keyed by setting key (``"max_sessions"``,
            ``"engine.kind"``), as :func:`flag_values` returns them. A ``str``
            is parsed like an env value; other values must already have the
            key's type. ``None`` means no flags.
        environ: The environment (pass ``os.environ``); only
            ``OMNI_SIDECAR_*`` variables are read.
        path: A TOML file to read, or ``None``.

    Returns:
        The settings and the source of each key.

    Raises:
        ConfigError: A key is unknown or a value is invalid; the error names
            the key and the source it came from.
    """
    values: dict[str, object] = {}
    sources: dict[str, str] = dict.fromkeys(SETTING_KEYS, "default")

    if path is not None:
        file_values = _read_file(path)
        values.update(file_values)
        sources.update(dict.fromkeys(file_values, f"file {path}"))

    for name in sorted(environ):
        if not name.startswith(ENV_PREFIX):
            continue
        if name.startswith(TESTS_ENV_PREFIX) or name == CONFIG_PATH_ENV:
            continue
        source = f"env {name}"
        key = _ENV_TO_KEY.get(name)
        if key is None:
            guess = name[len(ENV_PREFIX) :].lower()
            if guess.startswith("engine_"):
                guess = "engine." + guess[len("engine_") :]
            raise _unknown(guess, source)
        values[key] = _parse_text(_SPECS[key], environ[name], source)
        sources[key] = source

    for key, value in (argv_values or {}).items():
        source = f"flag {flag_name(key)}"
        if key not in _SPECS:
            raise _unknown(key, source)
        spec = _SPECS[key]
        if isinstance(value, str) and spec.type not in (_Type.STR, _Type.OPT_STR):
            values[key] = _parse_text(spec, value, source)
        else:
            values[key] = _coerce(spec, value, source)
        sources[key] = source

    # Check top-level values first, so that a bad `upstream` is reported as
    # itself and not as the engine.upstream it is copied to.
    for key, value in values.items():
        _check(_SPECS[key], value, sources[key])
    _resolve_upstream(values, sources)

    engine_values = {k[len("engine.") :]: v for k, v in values.items() if k.startswith("engine.")}
    try:
        engine = EngineConfig(**engine_values)  # type: ignore[arg-type]
    except EngineConfigError as exc:
        raise _engine_error(exc, sources) from None
    top_values = {k: v for k, v in values.items() if k in _TOP_SPECS}
    try:
        settings = Settings(**top_values, engine=engine)  # type: ignore[arg-type]
    except ConfigError as exc:
        raise exc.with_source(sources.get(exc.key, "default")) from None
    return LoadedSettings(settings=settings, sources=sources)


def _resolve_upstream(values: dict[str, object], sources: dict[str, str]) -> None:
    """Apply "upstream implies engine kind external", naming sources on conflict."""
    upstream = values.get("upstream")
    kind = values.get("engine.kind", "simulator")
    if upstream is None:
        if kind == "external" and values.get("engine.upstream") is not None:
            values["upstream"] = values["engine.upstream"]
            sources["upstream"] = sources["engine.upstream"]
        return
    if sources["engine.kind"] == "default":
        values["engine.kind"] = "external"
        sources["engine.kind"] = sources["upstream"]
    elif kind != "external":
        raise ConfigError(
            "upstream",
            f"cannot be combined with engine.kind {kind!r} (from {sources['engine.kind']}); "
            "upstream means engine kind 'external'",
            sources["upstream"],
        )
    engine_upstream = values.get("engine.upstream")
    if engine_upstream is None:
        values["engine.upstream"] = upstream
        sources["engine.upstream"] = sources["upstream"]
    elif engine_upstream != upstream:
        raise ConfigError(
            "upstream",
            f"{upstream!r} differs from engine.upstream {engine_upstream!r} "
            f"(from {sources['engine.upstream']})",
            sources["upstream"],
        )


def _engine_error(exc: EngineConfigError, sources: Mapping[str, str]) -> ConfigError:
    key = f"engine.{exc.field}"
    message = exc.message
    if exc.depends_on is not None:
        other = f"engine.{exc.depends_on}"
        message += f" (set by {other} from {sources.get(other, 'default')})"
    return ConfigError(key, message, sources.get(key, _CONSTRUCTOR_SOURCE))


def setting_value(settings: Settings, key: str) -> object:
    """Return the value of ``key`` (``engine.<field>`` for engine fields) in ``settings``."""
    if key.startswith("engine."):
        return getattr(settings.engine, key[len("engine.") :])
    return getattr(settings, key)


# --------------------------------------------------------------------------
# Command line, --print-config and the example config.


def add_cli_arguments(parser: argparse.ArgumentParser) -> None:
    """Add a ``--key-with-dashes`` flag for every setting to ``parser``.

    Flags default to ``argparse.SUPPRESS``, so only the flags given appear in
    the namespace; pass it through :func:`flag_values` to :func:`load`.
    Booleans get ``--x/--no-x``; other values are taken as text and parsed by
    :func:`load` like env values, so a bad value raises ``ConfigError`` naming
    the flag. Engine fields get ``--engine-<field>`` (``--engine-kind``,
    ``--engine-model``, ...). Each flag's help is the setting's meaning, its
    env var and its default.

    Args:
        parser: The parser to extend; the flags go in a "settings" group.
    """
    group = parser.add_argument_group(
        "settings",
        "override the config file and OMNI_SIDECAR_* env vars (docs/design.md, Settings); "
        "[live] = a SIGHUP reload applies a change at once",
    )
    for spec in SETTINGS:
        dest = spec.key.replace(".", "_")
        default = _format_value(spec.default, table=spec.type is _Type.ENV)
        live = "; live" if spec.doc.live else ""
        choices = f" ({'|'.join(spec.choices)})" if spec.choices else ""
        help_text = f"{spec.doc.help}{choices} [env {spec.env}; default {default}{live}]"
        help_text = help_text.replace("%", "%%")
        if spec.type is _Type.BOOL:
            group.add_argument(
                spec.flag,
                dest=dest,
                action=argparse.BooleanOptionalAction,
                default=argparse.SUPPRESS,
                help=help_text,
            )
        else:
            group.add_argument(
                spec.flag,
                dest=dest,
                metavar=spec.metavar,
                default=argparse.SUPPRESS,
                help=help_text,
            )


def flag_values(namespace: argparse.Namespace) -> dict[str, object]:
    """Return the setting flags present in ``namespace``, keyed by setting key.

    Args:
        namespace: The result of ``parser.parse_args()`` after
            :func:`add_cli_arguments`; other attributes are ignored.

    Returns:
        ``{key: value}`` for each flag given, ready for :func:`load`.
    """
    found = vars(namespace)
    return {key: found[dest] for dest, key in _DEST_TO_KEY.items() if dest in found}


def _is_unset(value: object) -> bool:
    return value is None


def format_settings(loaded: LoadedSettings) -> str:
    """Render settings for ``--print-config``: TOML that ``--config`` accepts back.

    One ``key = value  # source`` per line (engine keys as dotted
    ``engine.<field>`` keys, which TOML reads as the ``[engine]`` table).
    Unset keys are comments: ``# upstream = "ws://..."  # (unset) default``,
    showing the declared example. Secrets stay valid TOML but are masked, and
    their line says so: each API key is shown as ``"***"``, as are the key of
    ``upstream_authorization = "key:..."``, URL passwords and ``engine.env``
    values whose name looks secret (``*TOKEN*``, ``*KEY*``, ``*SECRET*``,
    ``*PASS*``).

    Args:
        loaded: What :func:`load` returned.

    Returns:
        The lines, joined with newlines, ending with a newline.
    """
    settings = loaded.settings
    lines = [
        "# omni-sidecar settings (serve --print-config): valid TOML for --config;",
        '# values marked "masked" had secrets replaced by "***".',
    ]
    for spec in SETTINGS:
        value = setting_value(settings, spec.key)
        source = loaded.sources.get(spec.key, "default")
        if _is_unset(value):
            example = spec.doc.example or '""'
            lines.append(f"# {spec.key} = {example}  # (unset) {source}")
            continue
        shown = _mask(spec, value)
        note = " (masked)" if shown != value else ""
        text = _format_value(shown, table=spec.type is _Type.ENV)
        lines.append(f"{spec.key} = {text}  # {source}{note}")
    return "\n".join(lines) + "\n"


_SECRET_WORDS: Final = ("TOKEN", "KEY", "SECRET", "PASS", "CREDENTIAL", "AUTH")


def _mask(spec: SettingSpec, value: object) -> object:
    if spec.doc.mask is not None:
        return spec.doc.mask(value)
    if spec.key in ("engine.upstream", "engine.health_url"):
        return _mask_url(value)  # type: ignore[arg-type]
    if spec.type is _Type.ENV:
        assert isinstance(value, tuple)
        return tuple(
            (name, "***" if any(w in name.upper() for w in _SECRET_WORDS) else val)
            for name, val in value
        )
    return value


def _format_value(value: object, *, underscores: bool = False, table: bool = False) -> str:
    """TOML text of a value (``(unset)`` for ``None``, which TOML cannot express).

    ``table`` renders ``(name, value)`` pairs (``engine.env``) as an inline table.
    """
    if value is None:
        return "(unset)"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return f"{value:_}" if underscores and abs(value) >= 10_000 else repr(value)
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    assert isinstance(value, tuple)
    if table:
        items = [f"{name} = {json.dumps(val, ensure_ascii=False)}" for name, val in value]
        return "{" + ", ".join(items) + "}"
    return "[" + ", ".join(json.dumps(v, ensure_ascii=False) for v in value) + "]"


def _size_note(spec: SettingSpec) -> str:
    value = spec.default
    if spec.doc.unit != "bytes" or not isinstance(value, int) or value < KIB:
        return ""
    if value % MIB == 0:
        return f" ({value // MIB} MiB)"
    if value % KIB == 0:
        return f" ({value // KIB} KiB)"
    return ""


_EXAMPLE_HEADER: Final = """\
# omni-sidecar example configuration (docs/design.md, Settings).
#
# Generated from the settings' declarations in omni_sidecar/settings/proxy.py by
#   .venv/bin/python -m omni_sidecar.settings.proxy --example > configs/omni-sidecar.example.toml
# (a test checks that this file matches); edit the declarations, not this file.
#
# Every value below is the built-in default, so this file changes nothing as
# it stands; edit what you need. Keys that are unset by default are commented
# out. Each key may also be set by env OMNI_SIDECAR_<KEY> (the [engine] table:
# OMNI_SIDECAR_ENGINE_<KEY>) or by the flag --key-with-dashes; precedence is
# defaults < this file < env < flags. `omni-sidecar serve --print-config` shows
# every value and where it came from. SIGHUP reloads this file: settings
# marked "reload: live" apply to new sessions at once, the others need a
# restart.
#
# Units: durations are float seconds, sizes are int bytes, counts are ints.
# 1 KiB = 1024 bytes, 1 MiB = 1_048_576 bytes.
"""

_EXAMPLE_TRAILER: Final = """\

# --- Example: a real vLLM-Omni engine ---------------------------------------
# Replace the [engine] table above with:
#
# [engine]
# kind = "vllm-omni"
# model = "openbmb/MiniCPM-o-4_5"
# port = 8091
# # A bare file name is looked up in the vllm_omni/deploy/ package folder.
# deploy_config = "minicpmo_4_5.yaml"
# extra_args = ["--trust-remote-code"]
# startup_timeout = 1200.0
#
# [engine.env]
# CUDA_VISIBLE_DEVICES = "0"
"""


def _heading(title: str) -> str:
    return f"# --- {title} ".ljust(78, "-")


def _example_entry(spec: SettingSpec) -> list[str]:
    lines = [f"# {line}" for line in textwrap.wrap(spec.doc.help, 76, break_on_hyphens=False)]
    unit = f"Unit: {spec.doc.unit}{_size_note(spec)}. " if spec.doc.unit else ""
    reload = "live" if spec.doc.live else "restart"
    lines.append(f"# {unit}Reload: {reload}.")
    if _is_unset(spec.default):
        lines.append(f"# {spec.name} = {spec.doc.example or '...'}")
    else:
        lines.append(f"{spec.name} = {_format_value(spec.default, underscores=True)}")
    return lines


def example_config() -> str:
    """Return the example config file: every setting, its meaning and default.

    ``configs/omni-sidecar.example.toml`` is this text (a test checks it);
    ``python -m omni_sidecar.settings.proxy --example`` prints it.
    """
    out = [_EXAMPLE_HEADER]
    section = None
    for spec in _TOP_SPECS.values():
        if spec.doc.section != section:
            section = spec.doc.section
            out.append(_heading(section or "Other"))
            out.append("")
        out.extend(_example_entry(spec))
        out.append("")
    out.append(_heading("Engine"))
    out.append("")
    out.append("[engine]")
    tables = [s for s in _ENGINE_SPECS.values() if s.type is _Type.ENV]
    for spec in _ENGINE_SPECS.values():
        if spec.type is _Type.ENV:
            continue
        out.extend(_example_entry(spec))
        out.append("")
    for spec in tables:  # sub-tables must come after the table's plain keys
        out.extend(f"# {line}" for line in textwrap.wrap(spec.doc.help, 76, break_on_hyphens=False))
        out.append(f"# Reload: {'live' if spec.doc.live else 'restart'}.")
        out.append(f"[engine.{spec.name}]")
        example = tomllib.loads(f"x = {spec.doc.example or '{}'}")["x"]
        out.extend(f"# {name} = {json.dumps(val)}" for name, val in example.items())
        out.append("")
    return "\n".join(out).rstrip("\n") + "\n" + _EXAMPLE_TRAILER


def _main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m omni_sidecar.settings.proxy",
        description="Print the generated example config.",
    )
    parser.add_argument("--example", action="store_true", help="print the example config")
    ns = parser.parse_args(argv)
    if not ns.example:
        parser.print_help()
        return 2
    sys.stdout.write(example_config())
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(_main(sys.argv[1:]))
