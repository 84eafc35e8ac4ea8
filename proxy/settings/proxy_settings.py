"""The sidecar's settings: one declaration per setting (docs/design.md, Settings).

Each setting is a field of :class:`Settings` (or of its base
``ServingSettings``) made with ``engine_launcher.setting_schema.setting``;
everything else (:data:`SETTINGS`, the loader, env and flag names, ``--help``,
``--print-config``, the example config, docs/configuration.md) is derived from
it, so adding a setting is one edit. Here too: the cross-field rules of
``Settings.__post_init__``.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Final, Literal

from engine_launcher.engine_config import EngineConfig
from engine_launcher.setting_schema import KIB, MIB, SettingSpec, setting, specs_of
from proxy.errors import ConfigError
from proxy.settings.serving_settings import (
    DEFAULT_ADMIN_LISTEN,
    DEFAULT_LISTEN,
    OVERFLOW_POLICY_NAMES,
    OverflowPolicyName,
    PlaybackAck,
    ServingSettings,
)
from proxy.settings.value_checks import (
    check_list_items,
    check_optional_path,
    check_upstream_authorization,
    mask_all,
    mask_authorization,
    mask_secret,
    mask_url,
)
from proxy.settings.values import check, coerce

__all__ = [
    "CONSTRUCTOR_SOURCE",
    "DEFAULT_ADMIN_LISTEN",
    "DEFAULT_LISTEN",
    "ENGINE_SPECS",
    "LIVE_KEYS",
    "LOG_FORMATS",
    "LOG_LEVELS",
    "OVERFLOW_POLICY_NAMES",
    "SETTINGS",
    "SETTING_KEYS",
    "SPECS",
    "TOP_SPECS",
    "TRACING_MODES",
    "ClientDialect",
    "LogFormat",
    "LogLevel",
    "OverflowPolicyName",
    "PlaybackAck",
    "Settings",
    "TracingMode",
    "UpstreamClient",
    "mask_url",
    "setting_value",
]

LogLevel = Literal["debug", "info", "warning", "error", "critical"]
LOG_LEVELS: Final[tuple[str, ...]] = typing.get_args(LogLevel)
LogFormat = Literal["text", "json"]
LOG_FORMATS: Final[tuple[str, ...]] = typing.get_args(LogFormat)
UpstreamClient = Literal["picows", "aiohttp"]
ClientDialect = Literal["auto", "engine"]
TracingMode = Literal["off", "otlp"]
TwilioInputFormat = Literal["pcm16", "pcm_f32le"]
TwilioTurnDetection = Literal["engine", "sidecar"]
TRACING_MODES: Final[tuple[str, ...]] = typing.get_args(TracingMode)

#: The source named by errors of a directly built ``Settings``.
CONSTRUCTOR_SOURCE: Final = "Settings()"

# Section headings after ServingSettings's, in order.
_AUTH: Final = "Auth and upstream request"
_LOGGING: Final = "Logging"
_PHONE: Final = "Phone calls (Twilio Media Streams)"


# --------------------------------------------------------------------------
# The declarations.


@dataclass(frozen=True, slots=True, kw_only=True)
class Settings(ServingSettings):
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

    api_keys: tuple[str, ...] = setting(
        (),
        help="Accepted API keys. Auth is off when both api_keys and api_keys_file are unset.",
        live=True,
        section=_AUTH,
        example='["change-me"]',
        metavar="KEY,...",
        check=check_list_items,
        mask=mask_all,
    )
    api_keys_file: str | None = setting(
        None,
        help="File with one API key per line (# starts a comment); re-read on reload.",
        live=True,
        section=_AUTH,
        example='"/etc/omni-sidecar/api-keys"',
        metavar="PATH",
        check=check_optional_path,
    )
    resume_secret_file: str | None = setting(
        None,
        help="File with the secret that binds a client's resume token to its session and API "
        "key (at least 16 bytes; created with a random one, mode 0600, when missing). Every "
        "sidecar in front of the same engines must read the same secret, and a restarted "
        "sidecar must keep it, for a call to resume there; unset = a random secret per "
        "process: a resume reaches only the process that issued the token "
        "(docs/design.md, Resume).",
        section=_AUTH,
        example='"/var/lib/omni-sidecar/resume-secret"',
        metavar="PATH",
        check=check_optional_path,
    )
    allowed_origins: tuple[str, ...] = setting(
        (),
        help="Allowed Origin values; checked only when the client sends Origin. Empty = any "
        "origin.",
        live=True,
        section=_AUTH,
        example='["https://app.example"]',
        metavar="ORIGIN,...",
        check=check_list_items,
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
        check=check_upstream_authorization,
        mask=mask_authorization,
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
    client_dialect: ClientDialect = setting(  # noqa: RUF009 - a dataclasses.field
        "auto",
        help='Which protocol a /v1/realtime client gets: "auto" gives the OpenAI Realtime '
        "protocol (GA; beta with OpenAI-Beta: realtime=v1) to a connection with ?model=, "
        "an Authorization header (or the browser's openai-insecure-api-key subprotocol) "
        "and no duplex, autostart or resume parameter, translated to and from the "
        "engine's, and the engine's own protocol, untouched, to every other (/v1/duplex "
        'always); "engine" gives every client the engine\'s own protocol. Applies to '
        "sessions opened after a change.",
        live=True,
        section=_AUTH,
        metavar="DIALECT",
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
        check=check_optional_path,
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
    twilio_auth_token: str = setting(
        "",
        help="The Twilio account's auth token: /v1/twilio then accepts only upgrades whose "
        "X-Twilio-Signature it validates (403 before anything else is spent); empty = an API "
        "key in the stream's customParameters (api_key), as api_keys say. Needs the twilio "
        "package (pip install 'omni-sidecar[twilio]').",
        live=True,
        section=_PHONE,
        metavar="TOKEN",
        mask=mask_secret,
    )
    twilio_stream_url: str = setting(
        "",
        help="The wss:// URL Twilio was given in <Stream url=...>, which its signature "
        "covers (behind a TLS proxy the sidecar sees another); empty = wss:// and the "
        "request's Host and path.",
        live=True,
        section=_PHONE,
        example='"wss://voice.example.com/v1/twilio"',
        metavar="URL",
    )
    twilio_engine_input_format: TwilioInputFormat = setting(  # noqa: RUF009 - a dataclasses.field
        "pcm16",
        help='The engine input a call\'s mu-law 8 kHz is converted to: "pcm16" (MiniCPM-o) '
        'or "pcm_f32le" (Nemotron), at twilio_engine_input_rate.',
        live=True,
        section=_PHONE,
        metavar="FORMAT",
    )
    twilio_engine_input_rate: int = setting(
        16000,
        help="Sample rate of the engine input a call's audio is converted to (Hz).",
        unit="hz",
        minimum=8000,
        maximum=192000,
        live=True,
        section=_PHONE,
        metavar="HZ",
    )
    twilio_turn_detection: TwilioTurnDetection = setting(  # noqa: RUF009 - a dataclasses.field
        "engine",
        help='Who hears a caller speak over an answer: "engine" (the session asks for '
        'server_vad and the sidecar clears Twilio on its speech_started) or "sidecar" (the '
        "sidecar's own detector, for engines without voice detection). A turn's end is "
        "committed by the sidecar either way.",
        live=True,
        section=_PHONE,
        metavar="engine|sidecar",
    )
    twilio_model: str = setting(
        "",
        help="Model of a call's engine session (customParameters model overrides); empty = "
        "the engine's default.",
        live=True,
        section=_PHONE,
        metavar="MODEL",
    )
    twilio_voice: str = setting(
        "",
        help="Voice of a call's engine session (customParameters voice overrides); empty = "
        "the engine's default.",
        live=True,
        section=_PHONE,
        metavar="VOICE",
    )
    twilio_instructions: str = setting(
        "",
        help="Instructions of a call's engine session (customParameters instructions "
        "overrides); empty = none.",
        live=True,
        section=_PHONE,
        metavar="TEXT",
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
