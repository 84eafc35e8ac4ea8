"""Fakes for driving ``engine_launcher.supervisor.Supervisor`` without sockets or children.

- :class:`FakeClock`: virtual time. ``sleep`` records the seconds it was asked
  for and, unless ``hold`` is set, returns at once with ``now`` advanced by
  exactly that much; with ``hold`` it parks until released (or cancelled), so a
  test can act "while the supervisor sleeps".
- :class:`FakeChild`: an engine child that never runs; the test makes it exit
  (``exit(status)``) and sees every ``stop(grace)``.
- :class:`ScriptedProbe`: answers from a list of ``True``/``False``/``HANG``
  and then a default; counts calls and cancellations.

Nothing here reads a real clock or opens a socket.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Final

from engine_launcher.process import HealthCheck
from proxy.settings import EngineConfig

__all__ = ["HANG", "FakeChild", "FakeClock", "ScriptedProbe", "Spawner"]

#: A probe answer that never comes (a stopped engine whose socket still accepts).
HANG: Final = "hang"


class FakeClock:
    """Virtual monotonic time (starts at 1000 s so that 0 is never special)."""

    def __init__(self, *, hold: bool = False) -> None:
        self.time = 1000.0
        self.sleeps: list[float] = []
        self.hold = hold
        self.parked = 0  # sleeps in progress (hold mode)
        self._release: asyncio.Event | None = None

    def now(self) -> float:
        return self.time

    async def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        if self.hold:
            if self._release is None:
                self._release = asyncio.Event()
            self.parked += 1
            try:
                await self._release.wait()
            finally:
                self.parked -= 1
        else:
            await asyncio.sleep(0)  # let others run, as a real sleep would
        self.time += seconds  # only when the sleep completed (not when cancelled)

    def release(self) -> None:
        """End the held sleeps and stop holding."""
        self.hold = False
        if self._release is not None:
            self._release.set()


_pids = itertools.count(40_000)


class FakeChild:
    """One fake engine run; ``exit_on_start`` makes it die at once (a crash loop)."""

    def __init__(
        self, argv: Sequence[str], env: dict[str, str], *, exit_on_start: int | None = None
    ) -> None:
        self.argv = list(argv)
        self.env = dict(env)
        self.pid: int | None = None
        self.returncode: int | None = None
        self.stops: list[float] = []
        self._exit_on_start = exit_on_start
        self._exited = asyncio.Event()

    async def start(self) -> None:
        self.pid = next(_pids)
        if self._exit_on_start is not None:
            self.exit(self._exit_on_start)

    async def wait(self) -> int:
        await self._exited.wait()
        assert self.returncode is not None
        return self.returncode

    def exit(self, status: int) -> None:
        self.returncode = status
        self._exited.set()

    async def stop(self, grace: float) -> int | None:
        self.stops.append(grace)
        if self.returncode is None:
            self.exit(-15)
        return self.returncode


@dataclass
class Spawner:
    """The supervisor's ``spawn``: records every child; ``on_spawn`` may act on each."""

    exit_on_start: int | None = None
    on_spawn: Callable[[int], None] | None = None
    children: list[FakeChild] = field(default_factory=list)

    def __call__(self, argv: Sequence[str], env: dict[str, str]) -> FakeChild:
        child = FakeChild(argv, env, exit_on_start=self.exit_on_start)
        self.children.append(child)
        if self.on_spawn is not None:
            self.on_spawn(len(self.children))
        return child


class ScriptedProbe:
    """Answers ``script`` in order, then ``default``; also the probe factory."""

    def __init__(self, script: Iterable[bool | str] = (), *, default: bool | str = True) -> None:
        self.script = list(script)
        self.default = default
        self.calls = 0
        self.cancelled = 0
        self.closed = 0
        self.made: list[tuple[EngineConfig, int | None]] = []

    def factory(self, config: EngineConfig, port: int | None) -> ScriptedProbe:
        self.made.append((config, port))
        return self

    async def __call__(self) -> HealthCheck:
        answer = self.script[self.calls] if self.calls < len(self.script) else self.default
        self.calls += 1
        if answer == HANG:
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.cancelled += 1
                raise
        if answer is True:
            return HealthCheck(True, "health", "200")
        return HealthCheck(False, "health", f"GET /health -> 503 (probe {self.calls})")

    async def aclose(self) -> None:
        self.closed += 1
