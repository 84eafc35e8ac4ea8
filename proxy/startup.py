"""What ``serve`` does before and around the :class:`~proxy.server.Sidecar`.

- :func:`validate_runtime` builds, and throws away, every object a session
  will need from the settings, so a value the loader accepts but the core
  rejects fails the start (exit 2) instead of a client's upgrade; a reload
  runs it too (docs/design.md, Reload).
- :func:`start_tracing` starts OpenTelemetry only when ``tracing = "otlp"``
  (docs/design.md, Tracing): with tracing off, neither
  ``proxy.session.tracing`` nor ``opentelemetry`` is imported.
- :func:`tune_gc` sets the cyclic collector up for a relay, once everything
  long-lived is built.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Callable, Mapping
from typing import Final

from engine_launcher.pool import plan_replicas
from proxy.core.session_core import check_session_settings
from proxy.edge.auth import load_api_keys
from proxy.edge.state import session_settings
from proxy.errors import ConfigError
from proxy.session.observer import Tracing
from proxy.settings import SETTING_KEYS, EngineConfigError, LoadedSettings, Settings

__all__ = [
    "GC_YOUNG_THRESHOLD",
    "start_tracing",
    "tracing_wanted",
    "tune_gc",
    "validate_runtime",
]

#: Allocations between young-generation collections (CPython's default: 700).
GC_YOUNG_THRESHOLD: Final = 10_000


def validate_runtime(loaded: LoadedSettings) -> None:
    """Build, and throw away, every object a session needs from the settings.

    Called before the listeners open (and on reload), so a value that the
    loader accepts but the core rejects stops the start with exit 2 instead
    of failing a client's upgrade later.

    Raises:
        ConfigError: naming the key and the source of its value.
    """
    settings = loaded.settings
    try:
        check_session_settings(session_settings(settings))
    except ConfigError:
        raise
    except (ValueError, TypeError) as exc:
        # The core's messages start with the field's name ("max_tombstones must be >= 1").
        word = str(exc).split(" ", 1)[0]
        key = word if word in SETTING_KEYS else "settings"
        raise ConfigError(key, str(exc), loaded.sources.get(key, "default")) from None
    try:
        # The pool's per-replica settings (fixed ports counting up must stay below 65536).
        plan_replicas(settings.engine, {}, smi=lambda: None)
    except EngineConfigError as exc:
        key = f"engine.{exc.field}"
        raise ConfigError(key, exc.message, loaded.sources.get(key, "default")) from None
    try:
        load_api_keys(settings.api_keys, settings.api_keys_file)
    except ConfigError as exc:
        raise ConfigError(
            exc.key, exc.message, loaded.sources.get(exc.key, "default") + f" ({exc.source})"
        ) from None
    if tracing_wanted(settings, os.environ):
        problem = _tracing_problem(os.environ)
        if problem is not None:
            raise ConfigError("tracing", problem, loaded.sources.get("tracing", "default"))
    if settings.quota_slot_ttl < 2 * settings.quota_check_interval:
        raise ConfigError(
            "quota_slot_ttl",
            "must be at least twice quota_check_interval (slots are refreshed at every check)",
            loaded.sources.get("quota_slot_ttl", "default"),
        )
    if settings.quota_redis_url:
        try:
            import redis.asyncio  # noqa: F401 - only checks that the extra is installed
        except ImportError:
            raise ConfigError(
                "quota_redis_url",
                "needs the redis package: pip install 'omni-sidecar[redis]'",
                loaded.sources.get("quota_redis_url", "default"),
            ) from None


def tracing_wanted(settings: Settings, environ: Mapping[str, str]) -> bool:
    """``tracing = "otlp"`` and not ``OTEL_SDK_DISABLED=true`` (the SDK's own switch)."""
    disabled = environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true"
    return settings.tracing == "otlp" and not disabled


def start_tracing(settings: Settings, environ: Mapping[str, str]) -> Tracing | None:
    """The process's tracer, or None when tracing is off (nothing of OpenTelemetry imported).

    Raises:
        ConfigError: tracing is on and the ``otel`` extra is not installed.
    """
    if not tracing_wanted(settings, environ):
        return None
    problem = _tracing_problem(environ)
    if problem is not None:
        raise ConfigError("tracing", problem, "settings")
    return _import_tracing()(environ)


def _tracing_problem(environ: Mapping[str, str]) -> str | None:
    """Why ``tracing = "otlp"`` cannot start here (None: it can)."""
    for name in ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"):
        value = environ.get(name, "").strip()
        if value:
            if value != "http/protobuf":
                return f'"otlp" exports over http/protobuf only, not {name}={value}'
            break
    try:
        _import_tracing()
    except ImportError as exc:
        return _missing_otel(exc)
    return None


def _import_tracing() -> Callable[[Mapping[str, str]], Tracing]:
    # Only here: with tracing off, neither proxy.session.tracing nor opentelemetry is imported.
    from proxy.session.tracing import OtlpTracing

    return OtlpTracing


def _missing_otel(exc: ImportError) -> str:
    return (
        "\"otlp\" needs the OpenTelemetry packages: pip install 'omni-sidecar[otel]' "
        f"({exc.name or exc})"
    )


def tune_gc() -> None:
    """Set the cyclic garbage collector up for a relay (once everything long-lived is built)."""
    # Everything built so far (modules, settings, metrics) lives as long as the
    # process: keep it out of the cyclic collector's full passes, which a flood
    # of short-lived frames otherwise triggers with 25-70 ms pauses.
    gc.freeze()
    # Relayed events allocate a few container objects each (parsed metadata,
    # entries) that reference counting frees; the young generation was
    # collected every 700 of them (3 % of the CPU at 12,500 events/s). Cycles
    # are rare here, so it is collected every GC_YOUNG_THRESHOLD instead.
    gc.set_threshold(GC_YOUNG_THRESHOLD, *gc.get_threshold()[1:])
