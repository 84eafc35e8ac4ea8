"""Value checks and secret masks that setting declarations name.

A declaration (``setting(..., check=..., mask=...)``) points at one of these;
the loader runs the check on every source and the renderers mask what is
secret (docs/design.md, Settings).
"""

from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit, urlunsplit

from proxy.settings.values import parse_listen

__all__ = [
    "check_list_items",
    "check_listen",
    "check_networks",
    "check_optional_path",
    "check_upstream_authorization",
    "check_ws_url",
    "mask_all",
    "mask_authorization",
    "mask_secret",
    "mask_url",
]


def check_listen(value: str) -> None:
    parse_listen(value)


def check_ws_url(value: str | None) -> None:
    if value is None:
        return
    try:
        parts = urlsplit(value)
        parts.port  # noqa: B018 - raises ValueError on a bad port
    except ValueError as exc:
        raise ValueError(f"invalid URL {value!r}: {exc}") from None
    if parts.scheme not in ("ws", "wss") or not parts.hostname:
        raise ValueError(f"expected a ws:// or wss:// URL with a host, got {value!r}")


def check_networks(value: tuple[str, ...]) -> None:
    check_list_items(value)
    for item in value:
        try:
            ipaddress.ip_network(item, strict=False)
        except ValueError:
            raise ValueError(f"{item!r} is not an IP network (CIDR)") from None


def check_list_items(value: tuple[str, ...]) -> None:
    for item in value:
        if not item or item != item.strip() or "," in item:
            raise ValueError("entries must be non-empty, without spaces around them or commas")


def check_optional_path(value: str | None) -> None:
    if value is not None and not value.strip():
        raise ValueError("must be a path or unset")


def _is_token(text: str) -> bool:
    return bool(text) and text.isprintable() and not any(c.isspace() for c in text)


def check_upstream_authorization(value: str) -> None:
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


def mask_all(value: tuple[str, ...]) -> tuple[str, ...]:
    return tuple("***" for _ in value)


def mask_secret(value: str) -> str:
    return "***" if value else value


def mask_authorization(value: str) -> str:
    return "key:***" if value.startswith("key:") else value
