"""The phone front door: WS ``/v1/twilio``, Twilio Media Streams (docs/design.md, Phone front door).

Order: a valid upgrade; with ``twilio_auth_token``, the ``X-Twilio-Signature``
(403 before anything is spent: no slot, no engine); readiness and the
voice-activity model; the upgrade; Twilio's ``connected`` and ``start``
(within ``handshake_timeout``); without a token, an API key in
``customParameters`` (``api_key``; with one, a key there names the call's
usage); then slots, quota and engine link as for every session
(proxy/edge/session_open.py), and a relay whose client side speaks Twilio
(proxy/session/twilio_side.py). A refusal after the upgrade closes the
stream (1008 for auth, 1013 otherwise).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from typing import Any, Final

import aiohttp
from aiohttp import web

from proxy import compat
from proxy.core.audio_formats import G711_ULAW, AudioFormat, parse_engine_format
from proxy.core.playback import AckMode
from proxy.core.turns import TurnDetector
from proxy.core.twilio_call import (
    BargeIn,
    CallOptions,
    CallStart,
    TwilioCall,
    parse_start,
    parse_twilio,
)
from proxy.core.usage import UNNAMED_KEY
from proxy.core.voice_activity import VoiceModelError
from proxy.edge.access import log_session_end
from proxy.edge.guard import client_address
from proxy.edge.handshake import wants_websocket
from proxy.edge.refusals import check_upgrade, json_error, log_refused
from proxy.edge.session_open import (
    Placement,
    Refused,
    admitted,
    open_link,
    replica_target,
    tune_client_socket,
)
from proxy.edge.state import STATE, ProxyState, upstream_headers
from proxy.session.client_side import ClientSide
from proxy.session.limits import RelayLimits
from proxy.session.relay import Relay
from proxy.session.twilio_side import TwilioTranslator
from proxy.session.upstream_link import UpstreamConnectError, UpstreamLink
from proxy.session.voice_model import load_voice_model
from proxy.session.writer import AiohttpWriterAdapter

__all__ = ["TWILIO_PATH", "signature_valid", "twilio_stream"]

log = logging.getLogger("omni_sidecar.edge.twilio")

#: The phone front door's route.
TWILIO_PATH: Final = "/v1/twilio"
#: The engine route a call's session opens on: duplex, opened by the call's ``session.update``.
_ENGINE_PATH: Final = "/v1/realtime?autostart=0"
#: ``customParameters`` a call may set (the rest are ignored).
_KEY_PARAM: Final = "api_key"


def signature_valid(url: str, signature: str, token: str) -> bool:
    """``X-Twilio-Signature`` of a WebSocket upgrade (no body) for ``url``, by the
    ``twilio`` package's validator (imported only when a token is set)."""
    from twilio.request_validator import RequestValidator

    return bool(signature) and bool(RequestValidator(token).validate(url, {}, signature))


def _signed_url(request: web.Request, state: ProxyState) -> str:
    configured = state.settings.twilio_stream_url
    if configured:
        query = request.query_string
        return configured + ("?" + query if query and "?" not in configured else "")
    return f"wss://{request.host}{request.path_qs}"


async def twilio_stream(request: web.Request) -> web.StreamResponse:
    """WS ``/v1/twilio``: one call, one engine session (the module docstring's order)."""
    state = request.app[STATE]
    metrics = state.metrics
    address = client_address(request)
    if not wants_websocket(request.headers):
        return json_error(400, "websocket_required", "this route is a Twilio Media Stream")
    invalid = check_upgrade(request, state)
    if invalid is not None:
        return invalid
    token = state.settings.twilio_auth_token
    if token and not signature_valid(
        _signed_url(request, state), request.headers.get("X-Twilio-Signature", ""), token
    ):
        metrics.sessions_rejected.labels("bad_signature").inc()
        log_refused(address, 403, "bad_signature")
        return json_error(403, "bad_signature", "X-Twilio-Signature does not verify")
    refusal = state.refusal()
    if refusal is not None:
        metrics.sessions_rejected.labels(refusal[0]).inc()
        log_refused(address, 503, refusal[0])
        return json_error(503, refusal[0], refusal[1], **{"Retry-After": "5"})
    try:
        # The caller's turns: the packaged voice-activity model on Twilio's 8 kHz
        # (loaded once per process, off the event loop the first time).
        model = await asyncio.to_thread(load_voice_model)
    except VoiceModelError as exc:
        log.error("phone calls need the voice-activity model: %s", exc)
        metrics.sessions_rejected.labels("not_ready").inc()
        return json_error(503, "not_ready", "turn detection is not available")
    settings = state.settings
    client = web.WebSocketResponse(
        max_msg_size=settings.max_client_message_bytes, compress=False, autoping=False
    )
    async with asyncio.timeout(settings.handshake_timeout):
        await client.prepare(request)
    protocol = tune_client_socket(request, settings.client_write_buffer_bytes)
    opened = await _read_start(client, settings.handshake_timeout)
    if opened is None:
        await _close(client, 1008, b"no start", settings.close_timeout)
        return client
    start, start_text = opened
    key_name, key_id = UNNAMED_KEY, ""
    offered = start.custom.get(_KEY_PARAM)
    if not token or (offered is not None and state.auth.enabled):
        # Without a token the key is the credential; with one (the signature was the
        # credential) a key still names the call's usage and quotas, when it is right.
        result = state.auth.check({"Authorization": "Bearer " + (offered or "")}, ())
        if not result.ok:
            metrics.sessions_rejected.labels(result.reason).inc()
            log_refused(address, result.status, result.reason)
            await _close(client, 1008, result.reason.encode(), settings.close_timeout)
            return client
        key_name, key_id = result.key_name, result.key_id
    try:
        async with admitted(request, state, key_name) as placement:
            upstream = await _connect(request, state, placement)
            turns = TurnDetector(model.new_stream(G711_ULAW.rate))
            call = TwilioCall(start, _options(state, start), turns)
            translator = TwilioTranslator(call)
            side = ClientSide(
                client,
                protocol,
                upstream,
                None,
                write_buffer_bytes=settings.client_write_buffer_bytes,
                address=address,
                translator=translator,
            )
            translator.writer = side.writer
            compat.install_client_writer(client, AiohttpWriterAdapter(side.writer))
            side.reader.first = aiohttp.WSMessage(aiohttp.WSMsgType.TEXT, start_text, None)
            await _run_call(state, placement, side, upstream, translator, (key_name, key_id))
    except Refused as refused:
        await _close(client, 1013, refused.reason.encode(), settings.close_timeout)
    return client


async def _read_start(
    client: web.WebSocketResponse, timeout: float
) -> tuple[CallStart, str] | None:
    """Twilio's ``connected`` then ``start``; None when the stream does not start."""
    try:
        async with asyncio.timeout(timeout):
            while True:
                msg = await client.receive()
                if msg.type is not aiohttp.WSMsgType.TEXT:
                    return None
                body = parse_twilio(msg.data)
                if body is None or body["event"] == "connected":
                    continue
                if body["event"] != "start":
                    return None
                start = parse_start(body)
                if isinstance(start, str):
                    log.info("refused a Twilio stream: %s", start)
                    return None
                return start, msg.data
    except TimeoutError:
        return None


def _options(state: ProxyState, start: CallStart) -> CallOptions:
    """The call's engine session: settings, overridden by ``customParameters``."""
    settings, custom = state.settings, start.custom
    fmt = parse_engine_format(
        settings.twilio_engine_input_format, settings.twilio_engine_input_rate
    )
    assert isinstance(fmt, AudioFormat)  # both are checked settings
    return CallOptions(
        engine_input=fmt,
        barge_in=BargeIn(settings.twilio_turn_detection),
        model=custom.get("model", settings.twilio_model),
        voice=custom.get("voice", settings.twilio_voice),
        instructions=custom.get("instructions", settings.twilio_instructions),
    )


async def _connect(request: web.Request, state: ProxyState, placement: Placement) -> UpstreamLink:
    """The call's engine link (its replica's); raises ``Refused``."""
    metrics, engine = state.metrics, placement.engine
    target = (
        state.target() if engine is None or state.router is None else replica_target(state, engine)
    )
    if target is None:
        metrics.sessions_rejected.labels("not_ready").inc()
        raise Refused(json_error(503, "not_ready", "engine is not ready"), "not_ready", "")
    placement.url = target.ws_base + _ENGINE_PATH
    try:
        return await open_link(state, placement.url, upstream_headers(state, request))
    except (UpstreamConnectError, TimeoutError) as exc:
        metrics.sessions_rejected.labels("upstream_unavailable").inc()
        message = f"cannot reach the engine: {exc}"
        raise Refused(
            json_error(502, "upstream_unavailable", message), "upstream_unavailable", message
        ) from None


async def _run_call(
    state: ProxyState,
    placement: Placement,
    side: ClientSide,
    upstream: UpstreamLink,
    translator: TwilioTranslator,
    identity: tuple[str, str],
) -> None:
    """The call's relay, as ``open_session`` runs one, with a phone's session policy:
    never held for a resume (Twilio does not come back), paced to real time, and
    heard as Twilio's marks say (acked and truncated by the sidecar from them)."""
    key_name, key_id = identity
    key = placement.key
    base = state.session_settings
    playback = base.playback
    if playback.ack is not AckMode.OFF:
        playback = dataclasses.replace(playback, ack=AckMode.ALWAYS)
    playback = dataclasses.replace(playback, pacing=True, client_reports=True)
    policy = dataclasses.replace(base, client_resume_grace=0.0, playback=playback)
    capabilities = state.registry.capabilities.current.for_session(duplex=True)
    observer = state.registry.observer(
        key,
        client_address=side.address,
        engine=placement.engine,
        key_name=key_name,
        tracer=placement.tracer,
        front_door="twilio",
    )
    relay = Relay(
        session_key=key,
        side=side,
        upstream=upstream,
        settings=policy,
        capabilities=capabilities,
        observer=observer,
        limits=RelayLimits.from_settings(state.settings),
        key_id=key_id,
    )
    state.quota.attach(key, relay.view, relay.end_for_quota)
    state.metrics.sessions_started.inc()
    state.metrics.front_door_sessions.labels("twilio").inc()
    state.registry.add(relay, key_id=key_id)
    if state.registry.closing_all:
        relay.shutdown()  # its handshake raced the shutdown: close it with 1001 now
    elif state.registry.handing_over:
        relay.hand_over()  # a drain: a call is never handed over (Twilio cannot resume)
    call = translator.call
    relay.log.info(
        "phone call open: %s stream %s call %s -> %s",
        side.address,
        call.start.stream_sid,
        call.start.call_sid or "-",
        placement.url,
    )
    try:
        await relay.run()
    finally:
        translator.writer = None  # the one back-reference (writer -> translator -> writer)
        state.registry.remove(relay)
        clears = state.metrics.twilio_clears
        clears.labels("sidecar").inc(call.clears_by_sidecar)
        clears.labels("engine").inc(call.clears - call.clears_by_sidecar)
        log_session_end(relay, observer, state.usage, front_door="twilio")


async def _close(client: Any, code: int, reason: bytes, timeout: float) -> None:
    with contextlib.suppress(Exception):
        async with asyncio.timeout(timeout):
            await client.close(code=code, message=reason)
