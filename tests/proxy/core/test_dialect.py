"""Who gets the OpenAI dialect (docs/design.md, OpenAI dialect): select_flavour."""

from __future__ import annotations

import pytest

from proxy.core.dialect import Flavour, select_flavour

REALTIME = "/v1/realtime"
AUTH = {"Authorization": "Bearer sk-test"}


@pytest.mark.parametrize(
    ("path", "query", "headers", "expected"),
    [
        # The openai SDK, LiveKit, Pipecat, the Agents SDK: ?model= and a bearer key.
        (REALTIME, {"model": "m"}, AUTH, Flavour.GA),
        (REALTIME, {"model": "m"}, {**AUTH, "OpenAI-Beta": "realtime=v1"}, Flavour.BETA),
        (REALTIME, {"model": "m"}, {**AUTH, "OpenAI-Beta": "assistants=v2, realtime=v1"},
         Flavour.BETA),
        # A browser: the key travels as a subprotocol.
        (REALTIME, {"model": "m"},
         {"Sec-WebSocket-Protocol": "realtime, openai-insecure-api-key.sk-x"}, Flavour.GA),
        # The engine's own clients: DuplexClient sends duplex=1 and autostart=0.
        (REALTIME, {"model": "m", "duplex": "1", "autostart": "0"}, AUTH, None),
        (REALTIME, {"model": "m", "autostart": "0"}, AUTH, None),
        (REALTIME, {"model": "m", "resume": "1"}, AUTH, None),
        (REALTIME, {"model": "m", "duplex": "1"}, AUTH, None),
        ("/v1/duplex", {"model": "m"}, AUTH, None),
        # Without a model or a credential it is not a stock OpenAI client.
        (REALTIME, {}, AUTH, None),
        (REALTIME, {"model": "m"}, {}, None),
    ],
)  # fmt: skip
def test_the_rule(
    path: str, query: dict[str, str], headers: dict[str, str], expected: Flavour | None
) -> None:
    assert select_flavour("auto", path, query, headers) is expected


def test_the_engine_setting_gives_everyone_the_engines_protocol() -> None:
    assert select_flavour("engine", REALTIME, {"model": "m"}, AUTH) is None
