"""Loading: defaults < TOML file < env < flags, validated into ``Settings``.

:func:`load` is pure: the caller passes the flag values, the environment and
the file path. It returns the frozen ``Settings`` and where each value came
from (:class:`LoadedSettings`, which ``--print-config`` prints); one value is
parsed by ``proxy.settings.values``. Which variables and keys it refuses or
ignores: docs/design.md, Settings.
"""

from __future__ import annotations

import difflib
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from engine_launcher.engine_config import EngineConfig, EngineConfigError
from engine_launcher.setting_schema import (
    CONFIG_PATH_ENV,
    ENV_PREFIX,
    TESTS_ENV_PREFIX,
    ValueType,
    env_name,
    flag_name,
)
from proxy.errors import ConfigError
from proxy.settings.proxy_settings import (
    CONSTRUCTOR_SOURCE,
    SETTING_KEYS,
    SPECS,
    TOP_SPECS,
    Settings,
)
from proxy.settings.values import check, coerce, parse_text

__all__ = ["LoadedSettings", "load"]

_ENV_TO_KEY: Final[dict[str, str]] = {env_name(key): key for key in SETTING_KEYS}


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
                if key not in SPECS:
                    raise _unknown(key, source)
                values[key] = coerce(SPECS[key], sub_value, source)
        elif name in TOP_SPECS:
            values[name] = coerce(SPECS[name], value, source)
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
        values[key] = parse_text(SPECS[key], environ[name], source)
        sources[key] = source

    for key, value in (argv_values or {}).items():
        source = f"flag {flag_name(key)}"
        if key not in SPECS:
            raise _unknown(key, source)
        spec = SPECS[key]
        if isinstance(value, str) and spec.type not in (ValueType.STR, ValueType.OPT_STR):
            values[key] = parse_text(spec, value, source)
        else:
            values[key] = coerce(spec, value, source)
        sources[key] = source

    # Check top-level values first, so that a bad `upstream` is reported as
    # itself and not as the engine.upstream it is copied to.
    for key, value in values.items():
        check(SPECS[key], value, sources[key])
    _resolve_upstream(values, sources)

    engine_values = {k[len("engine.") :]: v for k, v in values.items() if k.startswith("engine.")}
    try:
        engine = EngineConfig(**engine_values)  # type: ignore[arg-type]
    except EngineConfigError as exc:
        raise _engine_error(exc, sources) from None
    top_values = {k: v for k, v in values.items() if k in TOP_SPECS}
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
    return ConfigError(key, message, sources.get(key, CONSTRUCTOR_SOURCE))
