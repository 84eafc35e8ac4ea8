"""The WebSocket handshake check (proxy/edge/handshake.py), socket-free.

Each malformed handshake of issue 12 item 2 is refused with the status and
reason a client reads; a valid one passes; a request that does not ask for a
WebSocket is not a handshake at all (it is reverse-proxied).
"""

from __future__ import annotations

import base64

import pytest
from multidict import CIMultiDict

from proxy.edge.handshake import tokens, validate_upgrade, wants_websocket

KEY = base64.b64encode(b"0123456789abcdef").decode()


def headers(**overrides: str | None) -> CIMultiDict[str]:
    values: dict[str, str | None] = {
        "Host": "example",
        "Upgrade": "websocket",
        "Connection": "Upgrade",
        "Sec-WebSocket-Key": KEY,
        "Sec-WebSocket-Version": "13",
    }
    values.update({k.replace("_", "-"): v for k, v in overrides.items()})
    return CIMultiDict({k: v for k, v in values.items() if v is not None})


def test_a_valid_handshake_passes() -> None:
    assert validate_upgrade("GET", (1, 1), headers()) is None


@pytest.mark.parametrize("connection", ["keep-alive, Upgrade", "UPGRADE", "upgrade ,keep-alive"])
def test_connection_may_list_other_tokens_in_any_case(connection: str) -> None:
    assert validate_upgrade("GET", (1, 1), headers(Connection=connection)) is None


def test_a_newer_http_version_passes() -> None:
    assert validate_upgrade("GET", (2, 0), headers()) is None


@pytest.mark.parametrize(
    ("method", "version", "overrides", "status", "reason"),
    [
        ("POST", (1, 1), {}, 400, "bad_method"),
        ("HEAD", (1, 1), {}, 400, "bad_method"),
        ("GET", (1, 0), {}, 400, "bad_http_version"),
        ("GET", (0, 9), {}, 400, "bad_http_version"),
        ("GET", (1, 1), {"Upgrade": "h2c"}, 400, "bad_upgrade"),
        ("GET", (1, 1), {"Connection": None}, 400, "bad_connection"),
        ("GET", (1, 1), {"Connection": "keep-alive"}, 400, "bad_connection"),
        ("GET", (1, 1), {"Connection": "upgraded"}, 400, "bad_connection"),
        ("GET", (1, 1), {"Sec-WebSocket-Key": None}, 400, "bad_key"),
        ("GET", (1, 1), {"Sec-WebSocket-Key": "not base64!"}, 400, "bad_key"),
        ("GET", (1, 1), {"Sec-WebSocket-Key": base64.b64encode(b"x" * 15).decode()}, 400, "bad_key"),
        ("GET", (1, 1), {"Sec-WebSocket-Key": base64.b64encode(b"x" * 17).decode()}, 400, "bad_key"),
        ("GET", (1, 1), {"Sec-WebSocket-Key": KEY[:-2]}, 400, "bad_key"),
        ("GET", (1, 1), {"Sec-WebSocket-Version": None}, 400, "bad_version"),
        ("GET", (1, 1), {"Sec-WebSocket-Version": "8"}, 426, "bad_version"),
        ("GET", (1, 1), {"Sec-WebSocket-Version": "13, 8"}, 426, "bad_version"),
    ],
)  # fmt: skip
def test_malformed_handshakes_are_refused_with_a_reason(
    method: str,
    version: tuple[int, int],
    overrides: dict[str, str | None],
    status: int,
    reason: str,
) -> None:
    refusal = validate_upgrade(method, version, headers(**overrides))
    assert refusal is not None
    assert (refusal.status, refusal.reason) == (status, reason)
    assert refusal.message


def test_a_wrong_version_is_told_which_one_we_speak() -> None:
    refusal = validate_upgrade("GET", (1, 1), headers(**{"Sec-WebSocket-Version": "8"}))
    assert refusal is not None
    assert dict(refusal.headers) == {"Sec-WebSocket-Version": "13"}


def test_method_is_checked_first() -> None:
    """A POST with every header wrong is refused for its method: the first fault is named."""
    refusal = validate_upgrade("POST", (1, 0), CIMultiDict({"Upgrade": "websocket"}))
    assert refusal is not None and refusal.reason == "bad_method"


@pytest.mark.parametrize(
    ("upgrade", "wanted"),
    [("websocket", True), ("WebSocket", True), ("h2c, websocket", True), ("h2c", False), (None, False)],
)  # fmt: skip
def test_only_a_websocket_upgrade_is_a_handshake(upgrade: str | None, wanted: bool) -> None:
    assert wants_websocket(headers(Upgrade=upgrade)) is wanted


def test_tokens() -> None:
    assert tokens(" Keep-Alive ,Upgrade,, ") == {"keep-alive", "upgrade"}
    assert tokens(None) == set()
