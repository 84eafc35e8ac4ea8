"""Quotas per named API key, counted in this process or shared through Redis.

The decisions are the core's (proxy/core/quota_rules.py); this shell keeps the
counts: this process's own (:class:`~proxy.core.quota_rules.LocalQuotaBook`),
or, with ``quota_redis_url``, Redis keys every sidecar shares, admitted by one
Lua script, with the local counts deciding while Redis does not answer.
``redis`` is imported only then. docs/design.md, Quotas.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final, Protocol

from metrics import SidecarMetrics
from proxy.core.quota_rules import (
    SECONDS_PER_DAY,
    KeyQuota,
    LocalQuotaBook,
    QuotaKind,
    QuotaRefusal,
    day_window,
    minute_window,
    refusal_for,
)

__all__ = ["QuotaGate"]

log = logging.getLogger("omni_sidecar.quota")

_PREFIX: Final = "omni_sidecar:quota:"

#: KEYS: slots, minute, day. ARGV: now_ms, expiry_ms, member, max_sessions,
#: sessions_per_minute, audio_seconds_per_day, minute_ttl_s, slots_ttl_ms.
#: Returns 0 (admitted, counted) or the refused quota: 1 day, 2 slots, 3 minute.
_ADMIT: Final = """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[1])
local day_limit = tonumber(ARGV[6])
if day_limit > 0 and tonumber(redis.call('GET', KEYS[3]) or '0') >= day_limit then
  return 1
end
local max_sessions = tonumber(ARGV[4])
if max_sessions > 0 and redis.call('ZCARD', KEYS[1]) >= max_sessions then
  return 2
end
local per_minute = tonumber(ARGV[5])
if per_minute > 0 and tonumber(redis.call('GET', KEYS[2]) or '0') >= per_minute then
  return 3
end
redis.call('ZADD', KEYS[1], ARGV[2], ARGV[3])
redis.call('PEXPIRE', KEYS[1], ARGV[8])
redis.call('INCR', KEYS[2])
redis.call('EXPIRE', KEYS[2], ARGV[7])
return 0
"""

#: KEYS: day. ARGV: seconds, ttl_s. Returns the day's total (as a string).
_CHARGE: Final = """
local total = redis.call('INCRBYFLOAT', KEYS[1], ARGV[1])
redis.call('EXPIRE', KEYS[1], ARGV[2])
return total
"""

_REFUSED: Final = {
    1: QuotaKind.AUDIO_SECONDS_PER_DAY,
    2: QuotaKind.MAX_SESSIONS,
    3: QuotaKind.SESSIONS_PER_MINUTE,
}


class AudioMeter(Protocol):
    """What the gate reads of a running session (proxy.core.usage.UsageMeter)."""

    def quota_seconds(self) -> float: ...


@dataclass(slots=True)
class _Live:
    """One admitted session with a quota."""

    name: str
    quota: KeyQuota
    member: str
    meter: AudioMeter | None = None
    end: Callable[[str], None] | None = None
    charged: float = 0.0
    ended: bool = False


@dataclass(slots=True)
class _Backend:
    """The Redis client and its scripts; ``up`` is False while it does not answer."""

    client: Any
    admit: Any
    charge: Any
    up: bool = True
    errors: int = field(default=0)


class QuotaGate:
    """Admits sessions against their key's quota and ends those out of audio.

    Args:
        metrics: where rejections, ended sessions and the backend state go.
        redis_url: ``quota_redis_url`` (None: counts per process).
        timeout: ``quota_redis_timeout`` (seconds per Redis call).
        slot_ttl: ``quota_slot_ttl`` (seconds a slot lives without a check).
        wall: wall clock (Unix seconds); minutes and days are UTC.
    """

    def __init__(
        self,
        metrics: SidecarMetrics,
        *,
        redis_url: str | None = None,
        timeout: float = 0.25,
        slot_ttl: float = 30.0,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self._metrics = metrics
        self._timeout = timeout
        self.slot_ttl = slot_ttl
        self._wall = wall
        self.quotas: Mapping[str, KeyQuota] = {}
        self._book = LocalQuotaBook()
        self._live: dict[str, _Live] = {}
        self._process = uuid.uuid4().hex[:12]
        self._backend: _Backend | None = None
        if redis_url:
            # Only with quota_redis_url (the redis extra).
            import redis.asyncio as aioredis
            from redis.asyncio.retry import Retry
            from redis.backoff import NoBackoff
            from redis.exceptions import ConnectionError as RedisConnectionError

            client = aioredis.Redis.from_url(
                redis_url,
                socket_timeout=timeout,
                socket_connect_timeout=timeout,
                # One reconnect for a pooled connection a restarted Redis closed;
                # quota_redis_timeout still bounds the whole call.
                retry=Retry(NoBackoff(), 1),
                retry_on_error=[RedisConnectionError],
                retry_on_timeout=False,
                decode_responses=True,
            )
            self._backend = _Backend(
                client, client.register_script(_ADMIT), client.register_script(_CHARGE)
            )

    # -- views -------------------------------------------------------------------------

    @property
    def shared(self) -> bool:
        """True when ``quota_redis_url`` is set."""
        return self._backend is not None

    def readiness(self) -> dict[str, str]:
        """``/readyz``'s ``quota`` detail: where the counts are and whether that works."""
        backend = self._backend
        if backend is None:
            return {"backend": "local", "state": "ok"}
        if backend.up:
            return {"backend": "redis", "state": "ok"}
        return {
            "backend": "redis",
            "state": "degraded",
            "detail": "redis does not answer; limits are per process until it does",
        }

    def headroom(self) -> list[dict[str, Any]]:
        """Each named key's quotas and this process's view of their use (the console)."""
        wall = self._wall()
        out = []
        for name, quota in sorted(self.quotas.items()):
            out.append(
                {
                    "key": name,
                    "max_sessions": quota.max_sessions,
                    "sessions": self._book.active(name),
                    "sessions_per_minute": quota.sessions_per_minute,
                    "sessions_this_minute": self._book.sessions_this_minute(name, wall),
                    "audio_seconds_per_day": quota.audio_seconds_per_day,
                    "audio_seconds_today": round(self._audio_today(name, wall), 3),
                }
            )
        return out

    def _audio_today(self, name: str, wall: float) -> float:
        used = self._book.audio_used(name, wall)
        # Sessions still running have used more than has been charged.
        for live in self._live.values():
            if live.name == name and live.meter is not None:
                used += max(0.0, live.meter.quota_seconds() - live.charged)
        return used

    # -- admission -----------------------------------------------------------------------

    async def admit(self, name: str, session: str) -> QuotaRefusal | None:
        """Admit session ``session`` of key ``name``, or say which quota refuses it.

        Keys without quotas are admitted without counting anything.
        """
        quota = self.quotas.get(name)
        if quota is None or not quota.limited:
            return None
        wall = self._wall()
        member = f"{self._process}:{session}"
        refused: QuotaRefusal | None = None
        decided = False
        backend = self._backend
        if backend is not None and backend.up:
            try:
                result = await self._call(
                    backend.admit(
                        keys=self._keys(name, wall),
                        args=[
                            int(wall * 1000),
                            int((wall + self.slot_ttl) * 1000),
                            member,
                            quota.max_sessions,
                            quota.sessions_per_minute,
                            quota.audio_seconds_per_day,
                            120,
                            int(self.slot_ttl * 2000),
                        ],
                    )
                )
            except _BackendDown:
                pass
            else:
                decided = True
                kind = _REFUSED.get(int(result))
                refused = None if kind is None else refusal_for(kind, quota, wall)
        if decided:
            if refused is None:
                self._book.admit(name, KeyQuota(), wall)  # this process's view, always kept
        else:
            refused = self._book.admit(name, quota, wall)
        if refused is not None:
            self._metrics.quota_rejections.labels(
                self._metrics.usage_key(name), refused.kind.value
            ).inc()
            return refused
        self._live[session] = _Live(name, quota, member)
        return None

    def attach(self, session: str, meter: AudioMeter, end: Callable[[str], None]) -> None:
        """The admitted session runs: its audio is charged, ``end`` stops it."""
        live = self._live.get(session)
        if live is not None:
            live.meter = meter
            live.end = end

    async def release(self, session: str) -> None:
        """The session ended: charge its last audio, free its slot."""
        live = self._live.pop(session, None)
        if live is None:
            return
        self._book.release(live.name)
        wall = self._wall()
        if live.meter is not None:
            delta = live.meter.quota_seconds() - live.charged
            live.charged += delta
            await self._charge(live.name, delta, wall)
        backend = self._backend
        if backend is not None and backend.up:
            try:
                await self._call(backend.client.zrem(self._slots(live.name), live.member))
            except _BackendDown:
                pass  # the slot expires after quota_slot_ttl

    # -- the periodic check ----------------------------------------------------------------

    async def run(self, interval: float) -> None:
        """Check every ``interval`` seconds until cancelled."""
        while True:
            await asyncio.sleep(interval)
            try:
                await self.check()
            except Exception:  # a bug here must not stop later checks
                log.exception("quota check failed")

    async def check(self) -> None:
        """Charge running sessions' audio, end those out of it, refresh Redis slots."""
        wall = self._wall()
        backend = self._backend
        if backend is not None and not backend.up:
            await self._reconnect(backend)
        by_name: dict[str, float] = {}
        for live in self._live.values():
            if live.meter is None:
                continue
            used = live.meter.quota_seconds()
            by_name[live.name] = by_name.get(live.name, 0.0) + used - live.charged
            live.charged = used
        totals = {name: await self._charge(name, delta, wall) for name, delta in by_name.items()}
        for live in list(self._live.values()):
            limit = live.quota.audio_seconds_per_day
            total = totals.get(live.name)
            if not limit or total is None or total < limit or live.ended or live.end is None:
                continue
            live.ended = True
            self._metrics.quota_sessions_ended.labels(self._metrics.usage_key(live.name)).inc()
            live.end(f"the key's audio_seconds_per_day ({limit:g} s) is used up for today (UTC)")
        if backend is not None and backend.up:
            if self._live:
                await self._refresh_slots(backend, wall)
            else:
                # Idle: still notice a Redis that went away before a handshake does.
                with contextlib.suppress(_BackendDown):
                    await self._call(backend.client.ping())

    async def _refresh_slots(self, backend: _Backend, wall: float) -> None:
        """Push live sessions' slot expiry ahead (and put back any Redis lost)."""
        expiry = int((wall + self.slot_ttl) * 1000)
        pipe = backend.client.pipeline(transaction=False)
        for live in self._live.values():
            pipe.zadd(self._slots(live.name), {live.member: expiry})
            pipe.pexpire(self._slots(live.name), int(self.slot_ttl * 2000))
        try:
            await self._call(pipe.execute())
        except _BackendDown:
            pass

    async def _reconnect(self, backend: _Backend) -> None:
        try:
            await asyncio.wait_for(backend.client.ping(), self._timeout)
        except Exception:  # noqa: BLE001 - any failure: still down, try at the next check
            return
        backend.up = True
        self._metrics.quota_backend_down.set(0.0)
        log.warning("quota backend: redis answers again; the counts are shared again")

    async def _charge(self, name: str, seconds: float, wall: float) -> float:
        """Add audio to today's count of ``name``; today's total (shared when Redis is up)."""
        local = self._book.charge_audio(name, seconds, wall)
        backend = self._backend
        if backend is None or not backend.up:
            return local
        try:
            total = await self._call(
                backend.charge(
                    keys=[self._day(name, wall)], args=[f"{seconds:.6f}", 2 * SECONDS_PER_DAY]
                )
            )
        except _BackendDown:
            return local
        return float(total)

    async def _call(self, awaitable: Any) -> Any:
        """One Redis call under ``quota_redis_timeout``; any failure marks Redis down."""
        backend = self._backend
        assert backend is not None
        try:
            return await asyncio.wait_for(awaitable, self._timeout)
        except Exception as exc:
            self._metrics.quota_backend_errors.inc()
            if backend.up:
                backend.up = False
                self._metrics.quota_backend_down.set(1.0)
                log.warning(
                    "quota backend: redis failed (%s); limits are per process until it answers",
                    type(exc).__name__,
                )
            raise _BackendDown from exc

    # -- keys -------------------------------------------------------------------------------

    def _keys(self, name: str, wall: float) -> list[str]:
        return [
            self._slots(name),
            f"{_PREFIX}minute:{name}:{minute_window(wall)}",
            self._day(name, wall),
        ]

    @staticmethod
    def _slots(name: str) -> str:
        return f"{_PREFIX}slots:{name}"

    @staticmethod
    def _day(name: str, wall: float) -> str:
        return f"{_PREFIX}day:{name}:{day_window(wall)}"

    async def close(self) -> None:
        """Close the Redis connections (if any)."""
        if self._backend is not None:
            await self._backend.client.aclose()


class _BackendDown(Exception):
    """A Redis call failed or timed out."""
