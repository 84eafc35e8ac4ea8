"""The OpenAI Realtime dialect at the sidecar's front door (docs/design.md, OpenAI dialect).

A client of ``/v1/realtime`` that looks like a stock OpenAI Realtime client
gets the OpenAI protocol (GA, or beta when it sends ``OpenAI-Beta:
realtime=v1``), translated to and from the engine's by :class:`OpenAIDialect`;
clients of the engine's own protocol get the engine's frames untouched.
:func:`select_flavour` is the rule; ``tables`` drive every rewrite.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final, Literal

from proxy.core.dialect.tables import ENGINE_DIALECTS, EngineDialect, Flavour, engine_dialect
from proxy.core.dialect.translator import ClientStep, OpenAIDialect

__all__ = [
    "ENGINE_DIALECTS",
    "ClientDialectSetting",
    "ClientStep",
    "EngineDialect",
    "Flavour",
    "OpenAIDialect",
    "engine_dialect",
    "select_flavour",
]

#: The ``client_dialect`` setting: ``auto`` (the rule below) or ``engine`` (every
#: client gets the engine's own protocol, as before the dialect existed).
ClientDialectSetting = Literal["auto", "engine"]

#: Query parameters only the engine's own protocol uses (vLLM-Omni's DuplexClient
#: always sends ``duplex=1`` and ``autostart=0``; a resume sends ``resume=1``).
_ENGINE_PARAMS: Final = ("duplex", "autostart", "resume")
_INSECURE_KEY: Final = "openai-insecure-api-key."


def select_flavour(
    setting: str, path: str, query: Mapping[str, str], headers: Mapping[str, str]
) -> Flavour | None:
    """Which OpenAI flavour a new client connection speaks; None: the engine's protocol.

    With ``auto``, a connection to ``/v1/realtime`` speaks OpenAI's protocol when
    it looks like every stock OpenAI Realtime client (the ``openai`` SDK, LiveKit,
    Pipecat, the Agents SDK, a browser): ``?model=`` in the query, a credential
    as OpenAI takes it (``Authorization``, or the browser's
    ``openai-insecure-api-key.`` subprotocol), and none of the engine-only
    parameters ``duplex``, ``autostart``, ``resume``. It is the beta protocol
    when ``OpenAI-Beta`` says ``realtime=v1`` (what OpenAI itself reads), else
    GA. ``/v1/duplex`` is always the engine's.
    """
    if setting != "auto" or not path.endswith("/v1/realtime"):
        return None
    if not query.get("model") or any(name in query for name in _ENGINE_PARAMS):
        return None
    protocols = headers.get("Sec-WebSocket-Protocol", "")
    if not headers.get("Authorization") and _INSECURE_KEY not in protocols:
        return None
    beta = headers.get("OpenAI-Beta", "").replace(" ", "").lower()
    return Flavour.BETA if "realtime=v1" in beta else Flavour.GA
