"""One value of one setting: typed values normalised, text parsed, bounds checked.

Used by ``Settings()`` itself and by the loader, hence apart from both
(docs/design.md, Settings). How text from the environment and flags is parsed
is the user's reference: docs/configuration.md.
"""

from __future__ import annotations

import math
import shlex
from collections.abc import Mapping
from typing import Final

from engine_launcher.setting_schema import SettingSpec, ValueType
from proxy.errors import ConfigError

__all__ = ["check", "coerce", "parse_listen", "parse_text"]

_TRUE: Final = frozenset({"1", "true", "yes", "on"})
_FALSE: Final = frozenset({"0", "false", "no", "off"})


def _describe(value: object) -> str:
    return f"{value!r} ({type(value).__name__})"


def coerce(spec: SettingSpec, value: object, source: str) -> object:
    """Check a typed value (TOML, flags, constructor) and normalise it.

    Raises:
        ConfigError: The value is not of the key's type (naming key and source).
    """
    key, kind = spec.key, spec.type
    if kind is ValueType.BOOL:
        if isinstance(value, bool):
            return value
    elif kind in (ValueType.INT, ValueType.OPT_INT):
        if value is None and kind is ValueType.OPT_INT:
            return None
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif kind is ValueType.FLOAT:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            try:
                result = float(value)
            except OverflowError:
                result = math.inf
            if not math.isfinite(result):
                raise ConfigError(key, f"must be a finite number, got {value!r}", source)
            return result
    elif kind in (ValueType.STR, ValueType.OPT_STR):
        if value is None and kind is ValueType.OPT_STR:
            return None
        if isinstance(value, str):
            # Choices are lower case; accept "INFO" for "info".
            return value.lower() if value.lower() in spec.choices else value
    elif kind in (ValueType.STR_LIST, ValueType.ARGV):
        if isinstance(value, str) and kind is ValueType.ARGV:
            return parse_text(spec, value, source)
        if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
            return tuple(value)
    elif kind is ValueType.ENV:
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


def parse_text(spec: SettingSpec, text: str, source: str) -> object:
    """Parse a value given as text (env var or flag) by the key's type.

    Raises:
        ConfigError: The text does not parse as the key's type.
    """
    key, kind = spec.key, spec.type
    stripped = text.strip()
    if kind is ValueType.BOOL:
        lowered = stripped.lower()
        if lowered in _TRUE:
            return True
        if lowered in _FALSE:
            return False
        raise ConfigError(
            key, f"invalid boolean {text!r} (use 1/0, true/false, yes/no, on/off)", source
        )
    if kind in (ValueType.OPT_INT, ValueType.OPT_STR) and not stripped:
        return None
    if kind in (ValueType.INT, ValueType.OPT_INT):
        try:
            return int(stripped, 10)
        except ValueError:
            raise ConfigError(key, f"invalid integer {text!r}", source) from None
    if kind is ValueType.FLOAT:
        try:
            number = float(stripped)
        except ValueError:
            raise ConfigError(key, f"invalid number {text!r}", source) from None
        return coerce(spec, number, source)
    if kind in (ValueType.STR, ValueType.OPT_STR):
        return coerce(spec, stripped, source)
    if kind is ValueType.STR_LIST:
        return tuple(item.strip() for item in text.split(",") if item.strip())
    if kind is ValueType.ARGV:
        try:
            return tuple(shlex.split(text))
        except ValueError as exc:
            raise ConfigError(key, f"cannot split {text!r} like a shell: {exc}", source) from None
    pairs: list[tuple[str, str]] = []  # ValueType.ENV: "K=V,K2=V2"
    for item in text.split(","):
        if not item.strip():
            continue
        name, sep, val = item.partition("=")
        if not sep or not name.strip():
            raise ConfigError(key, f"expected NAME=VALUE items, got {item.strip()!r}", source)
        pairs.append((name.strip(), val))
    return tuple(pairs)


def check(spec: SettingSpec, value: object, source: str) -> None:
    """The declared bounds, choices and check of one normalised value.

    Raises:
        ConfigError: The value is out of bounds, not a choice, or fails the check.
    """
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
