"""An engine per GPU behind one sidecar: N supervised replicas (docs/design.md, Engine pool).

One unchanged :class:`~engine_launcher.supervisor.Supervisor` per replica, each
with its own child, port, ``CUDA_VISIBLE_DEVICES``, health checks, backoff and
restart budget. Every state change and drain is reported into the pool's
:class:`~engine_launcher.admission.EngineAdmission` (``pool.admission``), then
to the proxy through ``on_state(index, state, cause, detail)``.
:func:`plan_replicas` decides how many replicas and where; :meth:`EnginePool.run`
raises only once every replica has failed. Drains: :meth:`EnginePool.request_drain`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import re
import subprocess
from collections.abc import Callable, Mapping
from typing import Final

from engine_launcher.admission import EngineAdmission
from engine_launcher.engine_config import MAX_REPLICAS, EngineConfig, EngineConfigError
from engine_launcher.launcher_errors import RestartBudgetExhausted
from engine_launcher.policy import EngineState, Observation
from engine_launcher.supervisor import Supervisor
from engine_launcher.systemd import Notifier

__all__ = [
    "EnginePool",
    "PoolStateCallback",
    "Replica",
    "plan_replicas",
    "visible_gpus",
]

log = logging.getLogger("engine_launcher")

#: ``on_state(index, state, cause, detail)``: one replica's supervisor moved.
PoolStateCallback = Callable[[int, EngineState, Observation, str], None]
#: ``make(index, config, on_state)``: the supervisor of one run of a replica (tests inject).
SupervisorFactory = Callable[[int, EngineConfig, Callable[..., None]], Supervisor]

#: Seconds ``nvidia-smi -L`` may take before ``auto`` counts no GPU.
NVIDIA_SMI_TIMEOUT: Final = 10.0
_SMI_LINE: Final = re.compile(r"^GPU (\d+):", re.MULTILINE)


def _nvidia_smi() -> str | None:
    """``nvidia-smi -L`` output, or None when it is missing or fails."""
    try:
        done = subprocess.run(
            ["nvidia-smi", "-L"],
            capture_output=True,
            text=True,
            timeout=NVIDIA_SMI_TIMEOUT,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def visible_gpus(
    environ: Mapping[str, str], smi: Callable[[], str | None] = _nvidia_smi
) -> list[str]:
    """GPU ids a child may use: ``CUDA_VISIBLE_DEVICES`` when set, else ``nvidia-smi -L``."""
    listed = environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        ids = [part.strip() for part in listed.split(",") if part.strip()]
        # CUDA stops at the first invalid id; "-1" or "" means no GPU at all.
        valid: list[str] = []
        for gpu in ids:
            if gpu.startswith("-"):
                break
            valid.append(gpu)
        return valid[:MAX_REPLICAS]
    output = smi()
    if not output:
        return []
    return _SMI_LINE.findall(output)[:MAX_REPLICAS]


def plan_replicas(
    config: EngineConfig,
    environ: Mapping[str, str],
    smi: Callable[[], str | None] = _nvidia_smi,
) -> list[EngineConfig]:
    """One single-engine config per replica (see the module docstring for the rules).

    Raises:
        EngineConfigError: a fixed port plus the replica count runs past 65535.
    """
    single = {"replicas": 1, "gpus": None, "upstreams": ()}
    if config.kind == "external":
        urls = config.upstreams or ((config.upstream,) if config.upstream else ())
        many = len(urls) > 1
        return [
            dataclasses.replace(
                config,
                upstream=url,
                # One health_url cannot describe several endpoints: each gets its own /health.
                health_url=None if many else config.health_url,
                **single,  # type: ignore[arg-type]
            )
            for url in urls
        ]
    gpus: list[str] | None = None
    if config.gpus is not None and config.gpus.strip() == "auto":
        found = visible_gpus(environ, smi)
        if found:
            gpus = found
            log.info("engine.gpus = auto: %d visible GPUs (%s)", len(found), ",".join(found))
        else:
            log.info("engine.gpus = auto: no GPU visible; running 1 engine on the CPU")
            gpus = None
            config = dataclasses.replace(config, replicas=1)
    elif config.gpus is not None:
        gpus = [part.strip() for part in config.gpus.split(",")]
    count = len(gpus) if gpus is not None else config.replicas
    base = config.effective_port()
    if base is not None and count > 1 and base + count - 1 > 65535:
        raise EngineConfigError("port", f"{count} replicas from port {base} run past 65535")
    plans: list[EngineConfig] = []
    for index in range(count):
        env = config.env_dict()
        if gpus is not None:
            env["CUDA_VISIBLE_DEVICES"] = gpus[index]
        port = base + index if base is not None and count > 1 else config.port
        plans.append(
            dataclasses.replace(
                config,
                port=port,
                env=tuple(env.items()),
                **single,  # type: ignore[arg-type]
            )
        )
    return plans


@dataclasses.dataclass(eq=False)
class Replica:
    """One engine of the pool: its settings and the supervisor of its current run."""

    index: int
    config: EngineConfig
    supervisor: Supervisor
    #: The restart budget ran out: this replica stays down.
    failure: RestartBudgetExhausted | None = None
    #: Restarts of this replica's earlier runs, drains included (the supervisor counts its own).
    earlier_restarts: int = 0
    drain_requested: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    released: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)


class EnginePool:
    """N supervised engines; ``run`` until ``request_stop``.

    Args:
        config: the engine settings (``replicas``, ``gpus``, ``upstreams`` decide N).
        on_state: every replica's state changes, with its index (after
            :attr:`admission` took them in).
        max_per_engine: sessions per replica for :attr:`admission`; 0 = unlimited.
        sessions: live sessions on a replica (the drain waits for 0); by
            default :attr:`admission`'s count.
        on_drain: called with (index, True) when a drain begins and (index,
            False) when the replica was restarted and admits again.
        on_drain_timeout: called with the index when sessions outlived
            ``drain_timeout``; the proxy closes them before the restart.
        drain_timeout: seconds a draining replica's sessions may take.
        notifier: sd_notify sender shared by the supervisors.
        environ: for ``CUDA_VISIBLE_DEVICES`` with ``gpus = "auto"``.
        smi: ``nvidia-smi -L`` (tests inject).
        make_supervisor: builds one run's supervisor (tests inject fakes).
        activity: ``activity(index)``: monotonic seconds replica ``index``'s last
            frame reached one of its sessions (None: none); each supervisor asks it
            before it restarts an engine whose health fails (docs/design.md,
            Engine supervision). The proxy's session registry answers it.
    """

    def __init__(
        self,
        config: EngineConfig,
        *,
        on_state: PoolStateCallback | None = None,
        max_per_engine: int = 0,
        sessions: Callable[[int], int] | None = None,
        on_drain: Callable[[int, bool], None] | None = None,
        on_drain_timeout: Callable[[int], None] | None = None,
        drain_timeout: float = 30.0,
        notifier: Notifier | None = None,
        environ: Mapping[str, str] | None = None,
        smi: Callable[[], str | None] = _nvidia_smi,
        make_supervisor: SupervisorFactory | None = None,
        activity: Callable[[int], float | None] | None = None,
    ) -> None:
        self.config = config
        self._activity = activity
        self._on_state = on_state or (lambda index, state, cause, detail: None)
        self._sessions = sessions or self._admitted_sessions
        self._on_drain = on_drain or (lambda index, draining: None)
        self._on_drain_timeout = on_drain_timeout or (lambda index: None)
        self.drain_timeout = drain_timeout
        self._notifier = notifier
        self._make = make_supervisor or self._default_supervisor
        self._stop = asyncio.Event()
        plans = plan_replicas(config, environ or {}, smi)
        self.replicas = [
            Replica(k, plan, self._new_supervisor(k, plan)) for k, plan in enumerate(plans)
        ]
        #: Whether and where each replica admits; every state change and drain lands here.
        self.admission = EngineAdmission(
            len(plans),
            max_per_engine,
            on_release=self.session_released,
            restarts=self._replica_restarts,
            live_target=self.target,
        )

    def __len__(self) -> int:
        return len(self.replicas)

    # -- construction --------------------------------------------------------------------

    def _default_supervisor(
        self, index: int, config: EngineConfig, on_state: Callable[..., None]
    ) -> Supervisor:
        activity = self._activity
        return Supervisor(
            config,
            on_state=on_state,
            notifier=self._notifier,
            activity=None if activity is None else (lambda: activity(index)),
        )

    def _new_supervisor(self, index: int, config: EngineConfig) -> Supervisor:
        def on_state(state: EngineState, cause: Observation, detail: str) -> None:
            if len(self.replicas) > 1 or index > 0:
                log.info("engine %d: %s (%s) %s", index, state.value, cause.value, detail)
            target = self.replicas[index].supervisor.target
            self.admission.update(index, state.value, target, detail, cause.value)
            self._on_state(index, state, cause, detail)

        return self._make(index, config, on_state)

    # -- control -------------------------------------------------------------------------

    def request_stop(self) -> None:
        """Stop every replica (the sidecar's shutdown)."""
        self._stop.set()
        for replica in self.replicas:
            replica.supervisor.request_stop()

    def request_drain(self, index: int) -> bool:
        """Begin draining replica ``index``; False when it is already draining or failed.

        Raises:
            IndexError: no such replica.
        """
        replica = self.replicas[index]
        if self.admission.draining[index] or replica.failure is not None or self._stop.is_set():
            return False
        self.admission.set_draining(index, True)
        self._on_drain(index, True)
        replica.drain_requested.set()
        log.info("engine %d: draining (%d live sessions)", index, self._sessions(index))
        return True

    def session_released(self, index: int) -> None:
        """A session of ``index`` ended: wakes a drain waiting for it to empty."""
        if 0 <= index < len(self.replicas):
            self.replicas[index].released.set()

    # -- running -------------------------------------------------------------------------

    async def run(self) -> None:
        """Supervise every replica until ``request_stop``.

        Raises:
            RestartBudgetExhausted: every replica spent its restart budget.
        """
        async with asyncio.TaskGroup() as group:
            for replica in self.replicas:
                group.create_task(self._run_replica(replica))
        failures = [r.failure for r in self.replicas if r.failure is not None]
        if failures and len(failures) == len(self.replicas):
            raise failures[-1]

    async def _run_replica(self, replica: Replica) -> None:
        """Runs of one replica: a supervisor, then a fresh one after each drain."""
        while True:
            supervisor = replica.supervisor
            run = asyncio.ensure_future(supervisor.run())
            drain = asyncio.ensure_future(replica.drain_requested.wait())
            try:
                await asyncio.wait((run, drain), return_when=asyncio.FIRST_COMPLETED)
                if not run.done():
                    await self._drain_sessions(replica)
                    supervisor.request_stop()
                    await asyncio.wait((run,))
            finally:
                drain.cancel()
                if not run.done():
                    run.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.gather(run, drain, return_exceptions=True)
            error = None if run.cancelled() else run.exception()
            if isinstance(error, RestartBudgetExhausted):
                replica.failure = error
                alive = [r.index for r in self.replicas if r.failure is None]
                log.error(
                    "engine %d failed for good (%s); %s",
                    replica.index,
                    error,
                    f"engines {alive} still serve" if alive else "no engine left",
                )
                if not alive:
                    self.request_stop()  # nothing left to serve: the others are done too
                return
            if error is not None:
                raise error
            if self._stop.is_set() or not replica.drain_requested.is_set():
                return
            replica.drain_requested.clear()
            replica.earlier_restarts += supervisor.restarts + 1
            replica.supervisor = self._new_supervisor(replica.index, replica.config)
            self.admission.set_draining(replica.index, False)
            log.info("engine %d: drained, restarting", replica.index)
            self._on_drain(replica.index, False)

    async def _drain_sessions(self, replica: Replica) -> None:
        """Wait until the replica has no session, ``drain_timeout`` passes, or a stop."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.drain_timeout
        while self._sessions(replica.index) > 0 and not self._stop.is_set():
            left = deadline - loop.time()
            if left <= 0:
                log.warning(
                    "engine %d: %d sessions outlived the drain (%.0f s); closing them",
                    replica.index,
                    self._sessions(replica.index),
                    self.drain_timeout,
                )
                self._on_drain_timeout(replica.index)
                return
            replica.released.clear()
            released = asyncio.ensure_future(replica.released.wait())
            stopped = asyncio.ensure_future(self._stop.wait())
            try:
                await asyncio.wait((released, stopped), timeout=left, return_when="FIRST_COMPLETED")
            finally:
                released.cancel()
                stopped.cancel()
                await asyncio.gather(released, stopped, return_exceptions=True)

    # -- views ---------------------------------------------------------------------------

    def target(self, index: int) -> str | None:
        return self.replicas[index].supervisor.target

    def restarts(self) -> int:
        """Engine restarts over every replica and run (drains included)."""
        return sum(self._replica_restarts(r.index) for r in self.replicas)

    def _admitted_sessions(self, index: int) -> int:
        return self.admission.sessions[index]

    def _replica_restarts(self, index: int) -> int:
        replica = self.replicas[index]
        return replica.supervisor.restarts + replica.earlier_restarts
