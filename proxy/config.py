"""Settings: one flat namespace, loaded from defaults < TOML file < env < flags.

Every key has the same name in each source (DESIGN.md §11): TOML key
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
import json
import math
import shlex
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Final, Literal
from urllib.parse import urlsplit, urlunsplit

from engine_launcher.config import ENGINE_KINDS, EngineConfig, EngineConfigError
from proxy.errors import ConfigError

__all__ = [
    "CONFIG_PATH_ENV",
    "DEFAULT_ADMIN_LISTEN",
    "DEFAULT_LISTEN",
    "ENV_PREFIX",
    "KIB",
    "LOG_LEVELS",
    "MIB",
    "OVERFLOW_POLICIES",
    "SETTING_KEYS",
    "TESTS_ENV_PREFIX",
    "LoadedSettings",
    "LogLevel",
    "OverflowPolicy",
    "Settings",
    "add_cli_arguments",
    "env_name",
    "flag_name",
    "flag_values",
    "format_settings",
    "load",
    "parse_listen",
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
OVERFLOW_POLICIES: Final[tuple[str, ...]] = ("close_session", "fail_response")
LogLevel = Literal["debug", "info", "warning", "error", "critical"]
LOG_LEVELS: Final[tuple[str, ...]] = ("debug", "info", "warning", "error", "critical")

_CONSTRUCTOR_SOURCE: Final = "Settings()"


@dataclass(frozen=True, slots=True, kw_only=True)
class Settings:
    """Every proxy setting (DESIGN.md §11). Build with :func:`load` or directly.

    Direct construction validates too (handy in tests, with
    ``dataclasses.replace``); errors then name the source ``Settings()``.
    Setting :attr:`upstream` while ``engine.kind`` is ``simulator`` switches
    the engine to ``external`` with ``engine.upstream = upstream``; with
    ``engine.kind = "external"`` the two URLs are kept equal.

    Raises:
        ConfigError: A value has the wrong type or is out of range.
    """

    # Listeners (DESIGN.md §7), "host:port"; IPv6 as "[::1]:8000".
    listen: str = DEFAULT_LISTEN
    admin_listen: str = DEFAULT_ADMIN_LISTEN
    # ws:// or wss:// URL of an existing engine (engine kind "external").
    upstream: str | None = None
    # Admission (DESIGN.md §6). 0 sessions = unlimited.
    max_sessions: int = 64
    admission_timeout: float = 0 * SECONDS
    max_sessions_per_ip: int = 0  # 0 = off
    # A larger client frame closes the session with 1009.
    max_client_message_bytes: int = 15 * MIB
    # OutputBuffer (DESIGN.md §3): ordinary budget, reserve, closure slot.
    max_pending_output_bytes: int = 2 * MIB
    max_pending_output_events: int = 512
    output_reserve_bytes: int = 64 * KIB
    output_reserve_events: int = 8
    max_close_notice_bytes: int = 4096 * BYTES
    max_total_pending_output_bytes: int = 256 * MIB
    client_write_buffer_bytes: int = 64 * KIB
    overflow_policy: OverflowPolicy = "close_session"
    # Cancellation (DESIGN.md §4).
    interrupt_on_speech_started: bool = False
    max_tombstones: int = 256
    tombstone_ttl: float = 60 * SECONDS
    # Input toward the engine.
    max_pending_input_bytes: int = 16 * MIB
    max_input_audio_rate: float = 4.0  # audio seconds per wall second; 0 = off
    # Timers. 0 turns heartbeat, idle timeout and max duration off.
    heartbeat_interval: float = 20 * SECONDS
    upstream_connect_timeout: float = 10 * SECONDS
    upstream_close_timeout: float = 5 * SECONDS
    drain_timeout: float = 30 * SECONDS
    # Once a session is closing: time to deliver its final events and close frame.
    close_timeout: float = 5 * SECONDS
    handshake_timeout: float = 10 * SECONDS
    client_idle_timeout: float = 0 * SECONDS
    max_session_duration: float = 0 * SECONDS
    # Auth: off when both api_keys and api_keys_file are unset.
    api_keys: tuple[str, ...] = ()
    api_keys_file: str | None = None
    allowed_origins: tuple[str, ...] = ()  # checked only when the client sends Origin
    # Upstream request: "pass-through" (client's Authorization), "none", "key:<KEY>".
    upstream_authorization: str = "pass-through"
    forward_query: bool = True
    # Add autostart=0 upstream unless the client set autostart. Off by default:
    # clients that wait for session.created after connecting with ?model= would hang.
    upstream_autostart_off: bool = False
    log_level: LogLevel = "info"
    engine: EngineConfig = field(default_factory=EngineConfig)

    def __post_init__(self) -> None:
        for key, spec in _TOP_SPECS.items():
            value = _coerce(key, spec, getattr(self, key), _CONSTRUCTOR_SOURCE)
            _check(key, spec, value, _CONSTRUCTOR_SOURCE)
            object.__setattr__(self, key, value)
        if not isinstance(self.engine, EngineConfig):
            raise ConfigError(
                "engine", f"expected an EngineConfig, got {self.engine!r}", _CONSTRUCTOR_SOURCE
            )
        # "upstream implies external" (DESIGN.md §11), kept consistent both ways.
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
# Field specs: how each key is parsed from text and checked.


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


@dataclass(frozen=True, slots=True)
class _Spec:
    type: _Type
    minimum: float | None = None
    positive: bool = False
    choices: tuple[str, ...] = ()
    metavar: str = "VALUE"


def _size(*, positive: bool = True) -> _Spec:
    return _Spec(_Type.INT, minimum=0, positive=positive, metavar="BYTES")


def _count(*, positive: bool = False) -> _Spec:
    return _Spec(_Type.INT, minimum=0, positive=positive, metavar="N")


def _seconds(*, positive: bool = False) -> _Spec:
    return _Spec(_Type.FLOAT, minimum=0, positive=positive, metavar="SECONDS")


_TOP_SPECS: Final[dict[str, _Spec]] = {
    "listen": _Spec(_Type.STR, metavar="HOST:PORT"),
    "admin_listen": _Spec(_Type.STR, metavar="HOST:PORT"),
    "upstream": _Spec(_Type.OPT_STR, metavar="URL"),
    "max_sessions": _count(),
    "admission_timeout": _seconds(),
    "max_sessions_per_ip": _count(),
    "max_client_message_bytes": _size(),
    "max_pending_output_bytes": _size(),
    "max_pending_output_events": _count(positive=True),
    "output_reserve_bytes": _size(positive=False),
    "output_reserve_events": _count(),
    "max_close_notice_bytes": _size(),
    "max_total_pending_output_bytes": _size(),
    "client_write_buffer_bytes": _size(),
    "overflow_policy": _Spec(_Type.STR, choices=OVERFLOW_POLICIES, metavar="POLICY"),
    "interrupt_on_speech_started": _Spec(_Type.BOOL),
    "max_tombstones": _count(),
    "tombstone_ttl": _seconds(),
    "max_pending_input_bytes": _size(),
    "max_input_audio_rate": _Spec(_Type.FLOAT, minimum=0, metavar="RATIO"),
    "heartbeat_interval": _seconds(),
    "upstream_connect_timeout": _seconds(positive=True),
    "upstream_close_timeout": _seconds(),
    "drain_timeout": _seconds(),
    "close_timeout": _seconds(positive=True),
    "handshake_timeout": _seconds(positive=True),
    "client_idle_timeout": _seconds(),
    "max_session_duration": _seconds(),
    "api_keys": _Spec(_Type.STR_LIST, metavar="KEY,..."),
    "api_keys_file": _Spec(_Type.OPT_STR, metavar="PATH"),
    "allowed_origins": _Spec(_Type.STR_LIST, metavar="ORIGIN,..."),
    "upstream_authorization": _Spec(_Type.STR, metavar="pass-through|none|key:KEY"),
    "forward_query": _Spec(_Type.BOOL),
    "upstream_autostart_off": _Spec(_Type.BOOL),
    "log_level": _Spec(_Type.STR, choices=LOG_LEVELS, metavar="LEVEL"),
}

# Engine fields: only parsed here; EngineConfig checks ranges and cross-field rules.
_ENGINE_SPECS: Final[dict[str, _Spec]] = {
    "kind": _Spec(_Type.STR, metavar="KIND"),
    "model": _Spec(_Type.OPT_STR, metavar="MODEL"),
    "deploy_config": _Spec(_Type.OPT_STR, metavar="PATH"),
    "host": _Spec(_Type.STR, metavar="HOST"),
    "port": _Spec(_Type.OPT_INT, metavar="PORT"),
    "extra_args": _Spec(_Type.ARGV, metavar="ARGS"),
    "env": _Spec(_Type.ENV, metavar="K=V,..."),
    "python": _Spec(_Type.OPT_STR, metavar="PATH"),
    "command": _Spec(_Type.ARGV, metavar="ARGV"),
    "upstream": _Spec(_Type.OPT_STR, metavar="URL"),
    "health_url": _Spec(_Type.OPT_STR, metavar="URL"),
    "simulator_args": _Spec(_Type.ARGV, metavar="ARGS"),
    "startup_timeout": _Spec(_Type.FLOAT, metavar="SECONDS"),
    "health_interval": _Spec(_Type.FLOAT, metavar="SECONDS"),
    "health_failures": _Spec(_Type.INT, metavar="N"),
    "max_restarts": _Spec(_Type.INT, metavar="N"),
    "restart_window": _Spec(_Type.FLOAT, metavar="SECONDS"),
    "stop_grace": _Spec(_Type.FLOAT, metavar="SECONDS"),
}

_SPECS: Final[dict[str, _Spec]] = {
    **_TOP_SPECS,
    **{f"engine.{name}": spec for name, spec in _ENGINE_SPECS.items()},
}

SETTING_KEYS: Final[tuple[str, ...]] = tuple(_SPECS)
"""Every key, in display order; engine keys are written ``engine.<field>``."""

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


def _coerce(key: str, spec: _Spec, value: object, source: str) -> object:
    """Check a typed value (TOML, flags, constructor) and normalise it."""
    kind = spec.type
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
            return value.lower() if key == "log_level" else value
    elif kind in (_Type.STR_LIST, _Type.ARGV):
        if isinstance(value, str) and kind is _Type.ARGV:
            return _parse_text(key, spec, value, source)
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


def _parse_text(key: str, spec: _Spec, text: str, source: str) -> object:
    """Parse a value given as text (env var or flag) by the key's type."""
    kind = spec.type
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
        return _coerce(key, spec, number, source)
    if kind in (_Type.STR, _Type.OPT_STR):
        return _coerce(key, spec, stripped, source)
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


def _check(key: str, spec: _Spec, value: object, source: str) -> None:
    """Range and format checks on a normalised top-level value."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if spec.positive and value <= 0:
            raise ConfigError(key, f"must be > 0, got {value!r}", source)
        if spec.minimum is not None and value < spec.minimum:
            raise ConfigError(key, f"must be >= {spec.minimum:g}, got {value!r}", source)
    if spec.choices and value not in spec.choices:
        choices = ", ".join(repr(c) for c in spec.choices)
        raise ConfigError(key, f"unknown value {value!r}; expected one of {choices}", source)
    if key in ("listen", "admin_listen"):
        try:
            parse_listen(str(value))
        except ValueError as exc:
            raise ConfigError(key, str(exc), source) from None
    elif key == "upstream" and value is not None:
        _check_ws_url(key, str(value), source)
    elif key in ("api_keys", "allowed_origins"):
        assert isinstance(value, tuple)
        for item in value:
            if not item or item != item.strip() or "," in item:
                raise ConfigError(
                    key, "entries must be non-empty, without spaces around them or commas", source
                )
    elif key == "api_keys_file" and value is not None and not str(value).strip():
        raise ConfigError(key, "must be a path or unset", source)
    elif key == "upstream_authorization":
        token = str(value).removeprefix("key:")
        valid_key = str(value).startswith("key:") and _is_token(token)
        if value not in ("pass-through", "none") and not valid_key:
            raise ConfigError(
                key, "expected 'pass-through', 'none' or 'key:<KEY>' (a non-empty token)", source
            )


def _is_token(text: str) -> bool:
    return bool(text) and text.isprintable() and not any(c.isspace() for c in text)


def _check_ws_url(key: str, value: str, source: str) -> None:
    try:
        parts = urlsplit(value)
        parts.port  # noqa: B018 - raises ValueError on a bad port
    except ValueError as exc:
        raise ConfigError(key, f"invalid URL {value!r}: {exc}", source) from None
    if parts.scheme not in ("ws", "wss") or not parts.hostname:
        raise ConfigError(key, f"expected a ws:// or wss:// URL with a host, got {value!r}", source)


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
                values[key] = _coerce(key, _SPECS[key], sub_value, source)
        elif name in _TOP_SPECS:
            values[name] = _coerce(name, _SPECS[name], value, source)
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
        values[key] = _parse_text(key, _SPECS[key], environ[name], source)
        sources[key] = source

    for key, value in (argv_values or {}).items():
        source = f"flag {flag_name(key)}"
        if key not in _SPECS:
            raise _unknown(key, source)
        spec = _SPECS[key]
        if isinstance(value, str) and spec.type not in (_Type.STR, _Type.OPT_STR):
            values[key] = _parse_text(key, spec, value, source)
        else:
            values[key] = _coerce(key, spec, value, source)
        sources[key] = source

    # Check top-level values first, so that a bad `upstream` is reported as
    # itself and not as the engine.upstream it is copied to.
    for key, value in values.items():
        if key in _TOP_SPECS:
            _check(key, _TOP_SPECS[key], value, sources[key])
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


# --------------------------------------------------------------------------
# Command line and --print-config.


def add_cli_arguments(parser: argparse.ArgumentParser) -> None:
    """Add a ``--key-with-dashes`` flag for every setting to ``parser``.

    Flags default to ``argparse.SUPPRESS``, so only the flags given appear in
    the namespace; pass it through :func:`flag_values` to :func:`load`.
    Booleans get ``--x/--no-x``; other values are taken as text and parsed by
    :func:`load` like env values, so a bad value raises ``ConfigError`` naming
    the flag. Engine fields get ``--engine-<field>`` (``--engine-kind``,
    ``--engine-model``, ...).

    Args:
        parser: The parser to extend; the flags go in a "settings" group.
    """
    group = parser.add_argument_group(
        "settings", "override the config file and OMNI_SIDECAR_* env vars (DESIGN.md §11)"
    )
    defaults = _default_values()
    for key, spec in _SPECS.items():
        dest = key.replace(".", "_")
        env = env_name(key)
        default = _format_value(key, defaults[key])
        if spec.type is _Type.BOOL:
            group.add_argument(
                flag_name(key),
                dest=dest,
                action=argparse.BooleanOptionalAction,
                default=argparse.SUPPRESS,
                help=f"env {env}; default {default}",
            )
        else:
            choices = spec.choices or (ENGINE_KINDS if key == "engine.kind" else ())
            extra = f" ({'|'.join(choices)})" if choices else ""
            group.add_argument(
                flag_name(key),
                dest=dest,
                metavar=spec.metavar,
                default=argparse.SUPPRESS,
                help=f"env {env}; default {default}{extra}".replace("%", "%%"),
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


def _default_values() -> dict[str, object]:
    settings = Settings()
    values: dict[str, object] = {key: getattr(settings, key) for key in _TOP_SPECS}
    values.update({f"engine.{n}": getattr(settings.engine, n) for n in _ENGINE_SPECS})
    return values


def format_settings(loaded: LoadedSettings) -> str:
    """Render settings for ``--print-config``: one ``key = value  # source`` per line.

    Secrets are masked: each API key is shown as ``***``, as are the key of
    ``upstream_authorization = "key:..."``, URL passwords and ``engine.env``
    values whose name looks secret (``*TOKEN*``, ``*KEY*``, ``*SECRET*``,
    ``*PASS*``). Unset values print as ``(unset)``.

    Args:
        loaded: What :func:`load` returned.

    Returns:
        The lines, joined with newlines, ending with a newline.
    """
    settings = loaded.settings
    lines = []
    for key in SETTING_KEYS:
        if key.startswith("engine."):
            value = getattr(settings.engine, key[len("engine.") :])
        else:
            value = getattr(settings, key)
        source = loaded.sources.get(key, "default")
        lines.append(f"{key} = {_format_value(key, value, mask=True)}  # {source}")
    return "\n".join(lines) + "\n"


_SECRET_WORDS: Final = ("TOKEN", "KEY", "SECRET", "PASS", "CREDENTIAL", "AUTH")


def _format_value(key: str, value: object, *, mask: bool = False) -> str:
    if value is None:
        return "(unset)"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        if mask and key == "upstream_authorization" and value.startswith("key:"):
            value = "key:***"
        elif mask and key in ("upstream", "engine.upstream", "engine.health_url"):
            value = _mask_url(value)
        return json.dumps(value, ensure_ascii=False)
    if key == "engine.env":
        assert isinstance(value, tuple)
        items = []
        for name, val in value:
            if mask and any(word in name.upper() for word in _SECRET_WORDS):
                val = "***"
            items.append(f"{name} = {json.dumps(val, ensure_ascii=False)}")
        return "{" + ", ".join(items) + "}" if items else "{}"
    assert isinstance(value, tuple)
    if mask and key == "api_keys":
        value = tuple("***" for _ in value)
    return "[" + ", ".join(json.dumps(v, ensure_ascii=False) for v in value) + "]"


def _mask_url(value: str) -> str:
    parts = urlsplit(value)
    if parts.password is None:
        return value
    netloc = parts.netloc.rpartition("@")[2]
    user = parts.username or ""
    return urlunsplit(parts._replace(netloc=f"{user}:***@{netloc}"))
