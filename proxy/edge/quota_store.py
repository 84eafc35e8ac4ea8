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

__all__ = ["QuotaGate", "redis_client"]

log = logging.getLogger("omni_sidecar.quota")

_PREFIX: Final = "omni_sidecar:quota:"

#: The key holding the current epoch: a random id, set by the first process that finds none.
_EPOCH_KEY: Final = f"{_PREFIX}epoch"

#: Drops the expired members of the slot set KEYS[1] (ARGV[1]: now, ms). Every script
#: that touches a slot set starts with it: the one rule, in one string.
_DROP_EXPIRED: Final = "redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[1])\n"

#: KEYS: slots, minute, day, epoch. ARGV: now_ms, expiry_ms, member, max_sessions,
#: sessions_per_minute, audio_seconds_per_day, minute_ttl_s, slots_ttl_ms, epoch.
#: Returns 0 (admitted, counted) or the refused quota: 1 day, 2 slots, 3 minute;
#: 4 (nothing done): Redis does not hold the caller's epoch, it must reseed first.
_ADMIT: Final = (
    _DROP_EXPIRED
    + """
if redis.call('GET', KEYS[4]) ~= ARGV[9] then
  return 4
end
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
)

#: KEYS: slots. ARGV: now_ms, expiry_ms, slots_ttl_ms, member... (this process's live
#: sessions of the name). Returns the slots held now.
_REFRESH: Final = (
    _DROP_EXPIRED
    + """
for i = 4, #ARGV do
  redis.call('ZADD', KEYS[1], ARGV[2], ARGV[i])
end
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return redis.call('ZCARD', KEYS[1])
"""
)

#: KEYS: day. ARGV: seconds, ttl_s. Returns the day's total (as a string).
_CHARGE: Final = """
local total = redis.call('INCRBYFLOAT', KEYS[1], ARGV[1])
redis.call('EXPIRE', KEYS[1], ARGV[2])
return total
"""

#: KEYS: epoch. ARGV: a new id, taken when Redis has none. Returns the epoch.
_EPOCH: Final = """
local epoch = redis.call('GET', KEYS[1])
if not epoch then
  redis.call('SET', KEYS[1], ARGV[1])
  return ARGV[1]
end
return epoch
"""

#: KEYS: day, minute. ARGV: day seconds, day ttl_s, minute sessions, minute ttl_s,
#: day seconds Redis never had. Raises each count to the given one (never lowers
#: it), then adds the seconds counted while Redis did not answer.
_RESEED: Final = """
if tonumber(ARGV[1]) > tonumber(redis.call('GET', KEYS[1]) or '0') then
  redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2])
end
if tonumber(ARGV[5]) > 0 then
  redis.call('INCRBYFLOAT', KEYS[1], ARGV[5])
  redis.call('EXPIRE', KEYS[1], ARGV[2])
end
if tonumber(ARGV[3]) > tonumber(redis.call('GET', KEYS[2]) or '0') then
  redis.call('SET', KEYS[2], ARGV[3], 'EX', ARGV[4])
end
return 0
"""

#: What the admission script answers when Redis does not hold the caller's epoch.
_RESEED_FIRST: Final = 4
#: Seconds a minute counter lives (two windows: it is read only in its own).
_MINUTE_TTL: Final = 120

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
    refresh: Any
    epoch: Any
    reseed: Any
    up: bool = True
    errors: int = field(default=0)


def redis_client(url: str, max_connections: int, timeout: float, name: str) -> Any:
    """A Redis client for ``quota_redis_url`` (the redis extra, imported only here).

    Bounded: a call that finds all ``max_connections`` busy waits for one within
    ``timeout``, which also bounds each call; one reconnect for a pooled connection
    a restarted Redis closed. Closing the client closes its pool.
    """
    import redis.asyncio as aioredis
    from redis.asyncio.retry import Retry
    from redis.backoff import NoBackoff
    from redis.exceptions import ConnectionError as RedisConnectionError

    pool = aioredis.BlockingConnectionPool.from_url(
        url,
        max_connections=max_connections,
        timeout=timeout,
        socket_timeout=timeout,
        socket_connect_timeout=timeout,
        retry=Retry(NoBackoff(), 1),
        retry_on_error=[RedisConnectionError],
        decode_responses=True,
        client_name=name,
    )
    return aioredis.Redis.from_pool(pool)


class QuotaGate:
    """Admits sessions against their key's quota and ends those out of audio.

    Args:
        metrics: where rejections, ended sessions and the backend state go.
        redis_url: ``quota_redis_url`` (None: counts per process).
        timeout: ``quota_redis_timeout`` (seconds per Redis call).
        max_connections: ``quota_redis_max_connections`` (the pool's bound).
        slot_ttl: ``quota_slot_ttl`` (seconds a slot lives without a check).
        wall: wall clock (Unix seconds); minutes and days are UTC.
    """

    def __init__(
        self,
        metrics: SidecarMetrics,
        *,
        redis_url: str | None = None,
        timeout: float = 0.25,
        max_connections: int = 16,
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
        #: The Redis epoch whose counts include this process's (None: none seen yet).
        self._epoch: str | None = None
        #: name -> (UTC day, the last shared day total Redis answered for it).
        self._seen: dict[str, tuple[int, float]] = {}
        #: name -> (UTC day, audio seconds counted here that Redis has not had: charged
        #: while it did not answer). Sent with the next charge, or added by a reseed.
        self._unshared: dict[str, tuple[int, float]] = {}
        self._backend: _Backend | None = None
        if redis_url:
            client = redis_client(redis_url, max_connections, timeout, "omni-sidecar")
            self._backend = _Backend(
                client,
                client.register_script(_ADMIT),
                client.register_script(_CHARGE),
                client.register_script(_REFRESH),
                client.register_script(_EPOCH),
                client.register_script(_RESEED),
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
        # A second try only after a reseed (Redis lost its data since the last check).
        for _attempt in range(2):
            if backend is None or not backend.up:
                break
            try:
                result = int(
                    await self._call(
                        backend.admit(
                            keys=[*self._keys(name, wall), _EPOCH_KEY],
                            args=[
                                int(wall * 1000),
                                int((wall + self.slot_ttl) * 1000),
                                member,
                                quota.max_sessions,
                                quota.sessions_per_minute,
                                quota.audio_seconds_per_day,
                                _MINUTE_TTL,
                                int(self.slot_ttl * 2000),
                                self._epoch or "",
                            ],
                        )
                    )
                )
            except _BackendDown:
                break
            if result == _RESEED_FIRST:
                if not await self._sync_epoch(backend, wall):
                    break
                continue
            decided = True
            kind = _REFUSED.get(result)
            refused = None if kind is None else refusal_for(kind, quota, wall)
            break
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
        if backend is not None and backend.up:
            # Before any charge: a Redis that lost its data gets this process's counts
            # back first. Also the round trip that notices a Redis gone while idle.
            await self._sync_epoch(backend, wall)
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
        if backend is not None and backend.up and self._live:
            await self._refresh_slots(backend, wall)

    async def _refresh_slots(self, backend: _Backend, wall: float) -> None:
        """Drop expired slots, push live sessions' expiry ahead (and put back any Redis lost)."""
        members: dict[str, list[str]] = {}
        for live in self._live.values():
            members.setdefault(live.name, []).append(live.member)
        now_ms, expiry = int(wall * 1000), int((wall + self.slot_ttl) * 1000)
        pipe = backend.client.pipeline(transaction=False)
        for name, held in members.items():
            await backend.refresh(
                keys=[self._slots(name)],
                args=[now_ms, expiry, int(self.slot_ttl * 2000), *held],
                client=pipe,
            )
        with contextlib.suppress(_BackendDown):
            await self._call(pipe.execute())

    async def _sync_epoch(self, backend: _Backend, wall: float) -> bool:
        """Make sure Redis holds this process's counts; False when Redis did not answer.

        Redis without this process's epoch lost what it held (a restart without
        persistence, a flush): each named key's day and minute counts are raised
        to what this process knows and its live slots put back, then the epoch
        is taken as this process's.
        """
        try:
            epoch = str(await self._call(backend.epoch(keys=[_EPOCH_KEY], args=[uuid.uuid4().hex])))
        except _BackendDown:
            return False
        if epoch == self._epoch:
            return True
        try:
            reseeded = await self._reseed(backend, wall)
        except _BackendDown:
            return False
        if self._live:
            await self._refresh_slots(backend, wall)
        if self._epoch is not None:
            self._metrics.quota_backend_reseeds.inc()
            log.warning(
                "quota backend: redis lost the quota counts (restarted or flushed); "
                "reseeded %d key names from this process's counts",
                reseeded,
            )
        self._epoch = epoch
        return True

    async def _reseed(self, backend: _Backend, wall: float) -> int:
        """Raise each named key's day and minute counts in Redis to what this process knows.

        What Redis had of a day: this process's own count less what Redis never
        had of it, or the last shared total Redis answered, whichever is higher;
        the day is raised to that, then what this process counted while Redis
        did not answer is added (every process adds only its own: none is lost).
        Returns how many names were sent.
        """
        day = day_window(wall)
        pipe = backend.client.pipeline(transaction=False)
        sent: list[str] = []
        for name in self.quotas:
            unshared = self._unshared_today(name, day)
            had = self._book.audio_used(name, wall) - unshared
            seen_day, seen = self._seen.get(name, (day, 0.0))
            if seen_day == day:
                had = max(had, seen)
            minute = self._book.sessions_this_minute(name, wall)
            if had <= 0 and unshared <= 0 and minute <= 0:
                continue
            await backend.reseed(
                keys=[self._day(name, wall), self._minute(name, wall)],
                args=[f"{had:.6f}", 2 * SECONDS_PER_DAY, minute, _MINUTE_TTL, f"{unshared:.6f}"],
                client=pipe,
            )
            sent.append(name)
        if sent:
            await self._call(pipe.execute())
            for name in sent:
                self._unshared.pop(name, None)
        return len(sent)

    def _unshared_today(self, name: str, day: int) -> float:
        at, seconds = self._unshared.get(name, (day, 0.0))
        return seconds if at == day else 0.0

    async def _reconnect(self, backend: _Backend) -> None:
        try:
            await asyncio.wait_for(backend.client.ping(), self._timeout)
        except Exception:  # noqa: BLE001 - any failure: still down, try at the next check
            return
        backend.up = True
        self._metrics.quota_backend_down.set(0.0)
        log.warning("quota backend: redis answers again; the counts are shared again")

    async def _charge(self, name: str, seconds: float, wall: float) -> float:
        """Add audio to today's count of ``name``; today's total (shared when Redis is up).

        What Redis does not get (down, or the call failed) is kept as unshared
        and sent with the next charge that it answers (or added by a reseed).
        A call that failed late may have counted in Redis after all: then it
        counts twice, never less than it was (the quota's safe side).
        """
        local = self._book.charge_audio(name, seconds, wall)
        backend = self._backend
        if backend is None:
            return local
        day = day_window(wall)
        owed = self._unshared_today(name, day) + max(0.0, seconds)
        if not backend.up:
            self._unshared[name] = (day, owed)
            return local
        try:
            total = await self._call(
                backend.charge(
                    keys=[self._day(name, wall)], args=[f"{owed:.6f}", 2 * SECONDS_PER_DAY]
                )
            )
        except _BackendDown:
            self._unshared[name] = (day, owed)
            return local
        self._unshared.pop(name, None)
        shared = float(total)
        self._seen[name] = (day, shared)
        return shared

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
        return [self._slots(name), self._minute(name, wall), self._day(name, wall)]

    @staticmethod
    def _minute(name: str, wall: float) -> str:
        return f"{_PREFIX}minute:{name}:{minute_window(wall)}"

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
