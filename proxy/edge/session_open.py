"""Opening one session: slots, placement, quota, the upstream connect, the upgrade, the relay.

Called by the ``/v1/realtime`` and ``/v1/duplex`` handler (proxy/edge/client_app.py)
once the handshake was found valid and authorised (docs/design.md, Admission and
lifecycle). Usually the session's resources are taken and the engine connected
before the client's upgrade completes, so a refusal is an HTTP status; a
connection that may resume a session held here reads its first message first
and needs none of them (docs/design.md, Resume). One access line per attachment.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import socket
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any, Final
from urllib.parse import parse_qsl, urlsplit

import aiohttp
from aiohttp import web

from engine_launcher.admission import EngineAdmission
from proxy import compat
from proxy.core.capabilities import opens_at_connect, opens_with_first_message, session_is_duplex
from proxy.core.events import classify_upstream, is_engine_full
from proxy.edge.access import log_session_end
from proxy.edge.guard import client_address
from proxy.edge.refusals import json_error as _json_error
from proxy.edge.refusals import log_refused as _log_refused
from proxy.edge.refusals import quota_refused as _quota_refused
from proxy.edge.refusals import refuse_in_band
from proxy.edge.refusals import retry_after as _retry_after
from proxy.edge.resume import (
    ResumeRequest,
    current,
    first_message,
    parse_resume,
    refuse_resume,
    resume_held,
    verified,
)
from proxy.edge.resume_pass import Asked, ask_replicas
from proxy.edge.session_slots import FirstMessageWait
from proxy.edge.state import ProxyState, UpstreamTarget, client_query, openai_translator
from proxy.edge.state import upstream_headers as _upstream_headers
from proxy.edge.state import upstream_url as _upstream_url
from proxy.session.client_side import ClientSide
from proxy.session.limits import RelayLimits
from proxy.session.observer import SessionTracer
from proxy.session.openai_side import OpenAISide
from proxy.session.relay import Relay
from proxy.session.upstream_link import UpstreamConnectError, UpstreamLink, connect_upstream
from proxy.session.writer import AiohttpWriterAdapter

__all__ = [
    "MAX_UPSTREAM_MESSAGE_BYTES",
    "Placement",
    "Refused",
    "admitted",
    "open_link",
    "open_session",
    "replica_target",
    "tune_client_socket",
]

#: The name these lines have always been logged under (before the edge was split).
log = logging.getLogger("omni_sidecar.edge.app")

#: Largest frame accepted from the engine (DuplexClient allows 64 MiB too).
MAX_UPSTREAM_MESSAGE_BYTES: Final = 64 * 1024 * 1024
#: Subprotocols a browser Realtime client may offer; we accept, the engine never sees them.
_CLIENT_SUBPROTOCOLS: Final = ("realtime", "openai-beta.realtime-v1")


class Refused(Exception):
    """A step of the opening said no (counted and logged where it did).

    Before the upgrade the client gets ``response``; after it, an ``error``
    event {``reason``} and a close code (``refuse_in_band``).
    """

    def __init__(self, response: web.Response, reason: str, message: str) -> None:
        super().__init__(reason)
        self.response, self.reason, self.message = response, reason, message


def _refused(
    request: web.Request, state: ProxyState, status: int, reason: str, message: str, **headers: str
) -> Refused:
    state.metrics.sessions_rejected.labels(reason).inc()
    _log_refused(client_address(request), status, reason)
    return Refused(_json_error(status, reason, message, **headers), reason, message)


class Placement:
    """What an admitted session holds: its engine replica (None: one engine), key and trace."""

    def __init__(self, state: ProxyState, engine: int | None, key: str) -> None:
        self._state = state
        self.engine = engine
        self.key = key
        self.tracer: SessionTracer | None = None
        #: The engine URL the session's link was opened to.
        self.url = ""

    def move(self, engine: int, url: str) -> None:
        """The session lives on ``engine`` after all (a resume found it there)."""
        router = self._state.router
        assert router is not None and self.engine is not None
        router.take(engine)
        router.release(self.engine)
        self.engine, self.url = engine, url


@contextlib.asynccontextmanager
async def admitted(
    request: web.Request, state: ProxyState, key_name: str
) -> AsyncIterator[Placement]:
    """Take the session's resources, in order, until it ends; raises ``Refused``.

    The per-address and global slots (proxy/edge/session_slots.py), a replica
    when there is a pool (docs/design.md, Engine pool), the key's quota; the
    session's trace starts once it is admitted.
    """
    address = client_address(request)
    admission, router = state.admission, state.router
    async with contextlib.AsyncExitStack() as held:
        if not admission.acquire_ip(address):
            raise _refused(
                request,
                state,
                429,
                "capacity",
                "too many sessions from this address",
                **{"Retry-After": "1"},
            )
        held.callback(admission.release_ip, address)
        if not await admission.acquire():
            raise _refused(
                request,
                state,
                503,
                "capacity",
                "all session slots are in use",
                **{"Retry-After": "1"},
            )
        held.push_async_callback(admission.release)
        placement = Placement(state, None, uuid.uuid4().hex[:12])
        if router is not None:
            now = time.monotonic()
            engine = router.choose(state.registry.pending_by_engine(router.count), now)
            if engine is None:
                reason, message = router.refusal(now) or (
                    "capacity",
                    "every engine replica is full",
                )
                raise _refused(
                    request,
                    state,
                    503,
                    reason,
                    message,
                    **{"Retry-After": _retry_after(state, reason)},
                )
            router.take(engine)
            placement.engine = engine
            held.callback(_release_replica, router, placement)  # where it ended up
        refused = await state.quota.admit(key_name, placement.key)
        if refused is not None:
            state.metrics.sessions_rejected.labels("quota_exceeded").inc()
            _log_refused(address, 429, f"quota_exceeded ({refused.kind.value})")
            response = _quota_refused(refused)
            raise Refused(response, "quota_exceeded", f"{refused.kind.value} quota is used up")
        held.push_async_callback(_release_quota, state, placement.key)
        if state.tracing is not None:
            tracer = state.tracing.session(
                placement.key, request.headers, model=client_query(request).get("model")
            )
            placement.tracer = tracer
            held.callback(tracer.refused, "handshake_failed")  # no-op once its span ended
        yield placement


def _release_replica(router: EngineAdmission, placement: Placement) -> None:
    if placement.engine is not None:
        router.release(placement.engine)


async def _release_quota(state: ProxyState, key: str) -> None:
    with contextlib.suppress(Exception):
        await state.quota.release(key)


async def open_session(
    request: web.Request, state: ProxyState, key_name: str, key_id: str = ""
) -> web.StreamResponse:
    """Open and run one session; returns once it is over (or was refused)."""
    settings = state.settings
    resume_on = state.session_settings.client_resume_grace > 0
    # The client says it opens with its first message (its query's last values, as the
    # engine reads them): read here, so a resume is checked (held here, spent) before
    # any engine hears of it. On any other URL the session core refuses a resume.
    first_message_opens = opens_with_first_message(client_query(request))
    resumable = state.registry.resumable_of(key_id) if first_message_opens and resume_on else 0
    if resumable:
        # This key has a session a resume could take over: this may be it, so its
        # first message is read before any slot is taken (docs/design.md, Resume).
        by = key_id or f"address {client_address(request)}"  # without auth: by address
        wait, evicted = state.admission.begin_wait(by, resumable)
        state.metrics.resume_waits.inc()
        state.metrics.resume_wait_evictions.inc(evicted is not None)
        try:
            return await _open_resume_first(request, state, key_name, key_id, wait)
        finally:
            state.admission.end_wait(wait)
    try:
        async with admitted(request, state, key_name) as placement:
            upstream = await _connect(request, state, placement)
            if not first_message_opens:
                await _check_engine_full(request, state, placement, upstream)
            client, protocol = await _upgrade(request, state, upstream)
            opening: aiohttp.WSMessage | None = None
            passed = False
            if first_message_opens:
                opening = await first_message(client, settings.handshake_timeout, upstream)
                resume = parse_resume(opening)
                here = resume is not None and state.registry.holds(resume.session_id)
                if resume is not None and here and current(state.registry, resume, key_id):
                    # This key's, held here: it takes that session's resources back, so
                    # this connection's go back first (never a second slot).
                    await _close_link(upstream, settings.close_timeout)
                    raise _HeldHere(client, protocol, resume)
                if resume is not None:
                    # Refused before the link closes: as long whether held here or not.
                    checks = state.resume_checks
                    engine_text = None if here else await verified(resume, key_id, checks)
                    if engine_text is None:
                        await refuse_resume(state.metrics, client, resume)
                        await _close_link(upstream, settings.close_timeout)
                        return client
                    upstream = await _pass_resume(
                        request, state, placement, upstream, resume, engine_text
                    )
                    opening, passed = None, True
            side = _side_factory(request, state, client, protocol)(upstream)
            side.reader.first = opening
            await _run_relay(request, state, placement, side, upstream, (key_name, key_id), passed)
            return client
    except Refused as refused:
        return refused.response
    except _HeldHere as held:
        client, side_for = held.client, _side_factory(request, state, held.client, held.protocol)
        registry, metrics, tokens = state.registry, state.metrics, state.resume_checks
        if not await resume_held(registry, metrics, client, side_for, held.resume, key_id, tokens):
            await refuse_resume(metrics, client, held.resume)  # it ended meanwhile
        return client


class _HeldHere(Exception):
    """The first message resumes a session held here: leave the slots taken for a new one."""

    def __init__(self, client: web.WebSocketResponse, protocol: Any, resume: ResumeRequest):
        super().__init__(resume.session_id)
        self.client, self.protocol, self.resume = client, protocol, resume


async def _open_resume_first(
    request: web.Request, state: ProxyState, key_name: str, key_id: str, wait: FirstMessageWait
) -> web.StreamResponse:
    """Upgrade, read the first message; a resume of a session held here takes none of
    the resources a new session needs. Anything else is admitted now, refused in band;
    a connection whose wait was evicted for a newer one is refused at once."""
    settings = state.settings
    client, protocol = await _upgrade(request, state, None)
    opening = await wait.receive(client, settings.handshake_timeout)
    state.admission.end_wait(wait)  # read (or not): its place is free for the next
    if wait.evicted:
        state.metrics.sessions_rejected.labels("capacity").inc()
        message = "too many connections wait for their first message"
        await refuse_in_band(client, 503, "capacity", message, settings.close_timeout)
        return client
    resume = parse_resume(opening)
    side_for = _side_factory(request, state, client, protocol)
    if resume is not None and await resume_held(
        state.registry, state.metrics, client, side_for, resume, key_id, state.resume_checks
    ):
        return client
    engine_text = None if resume is None else await verified(resume, key_id, state.resume_checks)
    if resume is not None and engine_text is None:
        # Not held here, and its token is not this key's: nothing is admitted for it.
        await refuse_resume(state.metrics, client, resume)
        return client
    try:
        async with admitted(request, state, key_name) as placement:
            upstream = await _connect(request, state, placement)
            passed = resume is not None
            if resume is not None and engine_text is not None:
                upstream = await _pass_resume(
                    request, state, placement, upstream, resume, engine_text
                )
                opening = None
            side = side_for(upstream)
            side.reader.first = opening
            await _run_relay(request, state, placement, side, upstream, (key_name, key_id), passed)
    except Refused as refused:
        await refuse_in_band(
            client, refused.response.status, refused.reason, refused.message, settings.close_timeout
        )
    return client


async def _connect(request: web.Request, state: ProxyState, placement: Placement) -> UpstreamLink:
    """The engine WebSocket for this session (its replica's); raises ``Refused``."""
    engine, tracer = placement.engine, placement.tracer
    target = (
        state.target() if engine is None or state.router is None else replica_target(state, engine)
    )
    if target is None:
        if tracer is not None:
            tracer.refused("not_ready")
        raise _refused(
            request, state, 503, "not_ready", "engine is not ready", **{"Retry-After": "5"}
        )
    try:
        upstream, placement.url = await _connect_to(request, state, target, tracer)
        return upstream
    except (UpstreamConnectError, TimeoutError) as exc:
        state.metrics.sessions_rejected.labels("upstream_unavailable").inc()
        if tracer is not None:
            tracer.refused("upstream_unavailable")
        message = f"cannot reach the engine: {exc}"
        response = _json_error(502, "upstream_unavailable", message)
        raise Refused(response, "upstream_unavailable", message) from None


async def _connect_to(
    request: web.Request, state: ProxyState, target: UpstreamTarget, tracer: SessionTracer | None
) -> tuple[UpstreamLink, str]:
    """A link to ``target`` for this request, and its URL."""
    url = _upstream_url(state, target, request)
    headers = _upstream_headers(state, request)
    if tracer is not None:
        tracer.upstream_headers(headers)
    return await open_link(state, url, headers), url


async def open_link(state: ProxyState, url: str, headers: dict[str, str]) -> UpstreamLink:
    """The engine WebSocket at ``url``, within the connect and handshake timeouts,
    counted and timed; raises ``UpstreamConnectError`` or ``TimeoutError`` (logged)."""
    settings, metrics = state.settings, state.metrics
    metrics.upstream_connects.inc()
    started = time.monotonic()
    try:
        async with asyncio.timeout(
            min(settings.upstream_connect_timeout, settings.handshake_timeout)
        ):
            upstream = await connect_upstream(
                settings.upstream_client,
                url,
                headers=headers,
                max_message_bytes=MAX_UPSTREAM_MESSAGE_BYTES,
                write_limit=settings.max_pending_input_bytes,
                close_timeout=settings.close_timeout,
                session=state.client_session() if settings.upstream_client == "aiohttp" else None,
            )
    except (UpstreamConnectError, TimeoutError) as exc:
        metrics.upstream_connect_failures.inc()
        log.warning("upstream connect to %s failed: %s", url, exc or type(exc).__name__)
        raise
    metrics.upstream_connect.observe(time.monotonic() - started)
    return upstream


async def _check_engine_full(
    request: web.Request, state: ProxyState, placement: Placement, upstream: UpstreamLink
) -> None:
    """An engine that opens the session at connect says it is full as its first frame."""
    settings = state.settings
    query = dict(parse_qsl(urlsplit(placement.url).query, keep_blank_values=True))
    if settings.engine_open_wait <= 0 or not opens_at_connect(query):
        return
    first = await upstream.first_text(settings.engine_open_wait)
    if first is None or not is_engine_full(classify_upstream(first)):
        return
    await _close_link(upstream, settings.close_timeout)
    state.metrics.engine_full.labels("handshake").inc()
    state.engine_full(placement.engine)
    if placement.tracer is not None:
        placement.tracer.refused("engine_capacity")
    raise _refused(
        request,
        state,
        503,
        "engine_capacity",
        "the engine has no room for another session",
        **{"Retry-After": _retry_after(state, "engine_capacity")},
    )


async def _upgrade(
    request: web.Request, state: ProxyState, upstream: UpstreamLink | None
) -> tuple[web.WebSocketResponse, Any]:
    """Complete the client's WebSocket upgrade; returns it and its protocol."""
    settings = state.settings
    client = web.WebSocketResponse(
        protocols=_CLIENT_SUBPROTOCOLS,
        max_msg_size=settings.max_client_message_bytes,
        compress=False,
        autoping=False,
    )
    try:
        async with asyncio.timeout(settings.handshake_timeout):
            await client.prepare(request)
    except BaseException:
        if upstream is not None:
            await upstream.close()
        raise
    return client, tune_client_socket(request, settings.client_write_buffer_bytes)


def _side_factory(
    request: web.Request, state: ProxyState, client: web.WebSocketResponse, protocol: Any
) -> Callable[[UpstreamLink], ClientSide]:
    """How this connection becomes a session's client side, once its engine link is known."""

    def side_for(upstream: UpstreamLink) -> ClientSide:
        side = ClientSide(
            client,
            protocol,
            upstream,
            functools.partial(compat.push_text, client),
            write_buffer_bytes=state.settings.client_write_buffer_bytes,
            address=client_address(request),
            # A client that opens with its first message resumes after a 1012: a
            # drain hands its session over (docs/design.md, Start-up and shutdown).
            resumes=opens_with_first_message(client_query(request)),
            translator=openai_translator(request, state),  # for an OpenAI client
        )
        if isinstance(side.translator, OpenAISide):
            side.translator.writer = side.writer  # its own answers are written at once
        # Every frame to this client from now on goes through its frame writer, aiohttp's too.
        compat.install_client_writer(client, AiohttpWriterAdapter(side.writer))
        return side

    return side_for


async def _pass_resume(
    request: web.Request,
    state: ProxyState,
    placement: Placement,
    upstream: UpstreamLink,
    resume: ResumeRequest,
    text: str,
) -> UpstreamLink:
    """A resume of a session not held here goes to the engine replica that holds it:
    with a pool every serving replica is asked at once (proxy/edge/resume_pass.py)
    and the session moves to the one that has it. Its answer stays first on the link."""
    settings, router = state.settings, state.router
    state.metrics.resumes.labels("passed_upstream").inc()
    pool = [] if router is None or router.count < 2 else range(router.count)
    serving = [engine for engine in pool if router is not None and router.serving(engine)]

    async def connect(engine: int) -> Asked | None:
        target = replica_target(state, engine)
        with contextlib.suppress(UpstreamConnectError, TimeoutError):
            if target is not None:
                return (engine, *await _connect_to(request, state, target, placement.tracer))
        return None

    placed = (placement.engine, upstream, placement.url)
    timeouts = {"timeout": settings.handshake_timeout, "close_timeout": settings.close_timeout}
    engine, link, url = await ask_replicas(text, placed, serving, connect, **timeouts)
    if link is not upstream and engine is not None:
        placement.move(engine, url)
        log.info("session.resume of %s found on engine %d", resume.session_id, engine)
    return link


async def _close_link(upstream: UpstreamLink, timeout: float) -> None:
    with contextlib.suppress(Exception):
        async with asyncio.timeout(timeout):
            await upstream.close()


async def _run_relay(
    request: web.Request,
    state: ProxyState,
    placement: Placement,
    side: ClientSide,
    upstream: UpstreamLink,
    identity: tuple[str, str],
    resume_passed: bool,
) -> None:
    key_name, key_id = identity
    key, settings = placement.key, state.settings
    duplex = session_is_duplex(request.path, client_query(request))
    door = "duplex" if request.path.endswith("/v1/duplex") else "realtime"
    if isinstance(side.translator, OpenAISide):
        door = side.translator.label  # the OpenAI dialect (docs/design.md, OpenAI dialect)
    capabilities = state.registry.capabilities.current.for_session(duplex=duplex)
    observer = state.registry.observer(
        key,
        client_address=side.address,
        engine=placement.engine,
        key_name=key_name,
        tracer=placement.tracer,
        front_door=door,
    )
    relay = Relay(
        session_key=key,
        side=side,
        upstream=upstream,
        settings=state.session_settings,
        capabilities=capabilities,
        observer=observer,
        limits=RelayLimits.from_settings(settings),
        resuming=resume_passed,
        key_id=key_id,
    )
    state.quota.attach(key, relay.view, relay.end_for_quota)
    state.metrics.sessions_started.inc()
    state.metrics.front_door_sessions.labels(door).inc()
    state.registry.add(relay, key_id=key_id)
    if state.registry.closing_all:
        relay.shutdown()  # its handshake raced the shutdown: close it with 1001 now
    elif state.registry.handing_over:
        relay.hand_over()  # its handshake raced the drain: it moves once it may
    relay.log.info("session open: %s -> %s", side.address, placement.url)
    try:
        await relay.run()
    finally:
        state.registry.remove(relay)
        log_session_end(relay, observer, state.usage)
        if isinstance(side.translator, OpenAISide):
            side.translator.writer = None  # the one back-reference


def replica_target(state: ProxyState, engine: int) -> UpstreamTarget | None:
    """Where replica ``engine`` of the pool is (None: not serving)."""
    assert state.router is not None
    url = state.router.targets[engine]
    return None if url is None else UpstreamTarget.from_url(url)


def tune_client_socket(request: web.Request, write_buffer_bytes: int) -> Any:
    """Bound what the transport and kernel hold for this client; return its protocol."""
    transport = request.transport
    if transport is not None:
        with contextlib.suppress(Exception):
            transport.set_write_buffer_limits(high=write_buffer_bytes)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, write_buffer_bytes)
    return request.protocol
