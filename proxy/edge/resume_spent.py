"""Which resume tokens are spent, across a fleet (docs/design.md, Resume).

Every token a sidecar issues for one engine token has a generation
(proxy/core/resume_token.py); once a client was given generation N, every
generation below it is spent. The sidecar that holds a session checks the
exact current token itself; one that does not (another sidecar, or this one
after a restart) asks here before it passes a resume to the engine, since the
engine knows only its own token. With ``quota_redis_url`` the newest
generation per session lives in that Redis, shared by every sidecar that
names it; without it, or while it does not answer, in this process only
(bounded: ``_MAX_LOCAL`` sessions, the oldest forgotten first).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import time
from collections import OrderedDict
from typing import Any, Final

from metrics import SidecarMetrics
from proxy.edge.quota_store import redis_client

__all__ = ["SpentTokens"]

log = logging.getLogger("omni_sidecar.edge.app")

#: KEYS: the session's record. ARGV: the generation presented, ttl_s.
#: Returns 1 when an older generation than the newest recorded is presented
#: (spent); else records it as the newest and returns 0.
_CHECK_AND_RECORD: Final = """
local newest = tonumber(redis.call('GET', KEYS[1]) or '-1')
local presented = tonumber(ARGV[1])
if presented < newest then
  return 1
end
redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2])
return 0
"""
_PREFIX: Final = "omni_sidecar:resume:"
#: Seconds a record lives: an engine token is good for as long as its session
#: (a day is longer than any call the defaults allow).
_TTL_SECONDS: Final = 24 * 3600
#: Seconds between two log lines about checks Redis did not answer.
_LOG_EVERY: Final = 10.0
#: Sessions remembered in this process when there is no shared store.
_MAX_LOCAL: Final = 65536


class SpentTokens:
    """The newest token generation issued per (session, engine token).

    Args:
        redis_url: ``quota_redis_url`` (None: this process only).
        timeout: seconds per Redis call, a wait for a pooled connection included
            (``quota_redis_timeout``).
        max_connections: ``quota_redis_max_connections``: past it a check waits for a
            connection (within ``timeout``), never skips Redis at once.
        metrics: counts the checks and those that fell back to this process.
    """

    def __init__(
        self,
        redis_url: str | None = None,
        timeout: float = 0.25,
        max_connections: int = 16,
        metrics: SidecarMetrics | None = None,
    ) -> None:
        self._local: OrderedDict[str, int] = OrderedDict()
        self._timeout = timeout
        self._metrics = metrics
        self._client: Any = None
        self._script: Any = None
        #: Fallbacks not logged yet, and when the last line was logged (monotonic).
        self._unlogged = 0
        self._logged_at = -math.inf
        if redis_url:
            # Blocking: past max_connections a check waits for a connection (within
            # ``timeout``) instead of failing at once and deciding in this process alone.
            self._client = redis_client(redis_url, max_connections, timeout, "omni-sidecar-resume")
            self._script = self._client.register_script(_CHECK_AND_RECORD)

    async def spent(self, session_id: str, engine_token: str, generation: int) -> bool:
        """``generation`` is older than one already issued (the token is spent);
        otherwise it is recorded as the newest."""
        key = _key(session_id, engine_token)
        spent_here = self._local_check(key, generation)
        if self._script is None:
            return spent_here
        if self._metrics is not None:
            self._metrics.resume_spent_checks.inc()
        try:
            answer = await asyncio.wait_for(
                self._script(keys=[_PREFIX + key], args=[generation, _TTL_SECONDS]),
                self._timeout,
            )
        except Exception as exc:  # noqa: BLE001 - Redis down: this process remembers alone
            self._fell_back(exc)
            return spent_here
        return spent_here or int(answer) == 1

    def _fell_back(self, exc: Exception) -> None:
        """Count a check Redis did not answer; one log line per ``_LOG_EVERY`` at most."""
        if self._metrics is not None:
            self._metrics.resume_spent_check_fallbacks.inc()
        self._unlogged += 1
        now = time.monotonic()
        if now - self._logged_at >= _LOG_EVERY:
            log.warning(
                "resume tokens: redis failed (%s); %d checks made in this process only",
                type(exc).__name__,
                self._unlogged,
            )
            self._unlogged, self._logged_at = 0, now

    async def issued(self, session_id: str, engine_token: str, generation: int) -> None:
        """A client was given ``generation``: every older one is spent now."""
        await self.spent(session_id, engine_token, generation)

    def _local_check(self, key: str, generation: int) -> bool:
        newest = self._local.get(key, -1)
        if generation < newest:
            return True
        self._local[key] = generation
        self._local.move_to_end(key)
        while len(self._local) > _MAX_LOCAL:
            self._local.popitem(last=False)
        return False

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()


def _key(session_id: str, engine_token: str) -> str:
    # The engine token itself is never stored: a digest names the record.
    digest = hashlib.sha256(f"{len(session_id)}:{session_id}|{engine_token}".encode())
    return digest.hexdigest()[:32]
