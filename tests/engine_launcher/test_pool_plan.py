"""How many engines, on which GPU and port (engine_launcher/pool.py), and the pool's
failure and drain rules with fake supervisors: no children, no sockets."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import pytest

from engine_launcher.launcher_errors import RestartBudgetExhausted
from engine_launcher.policy import EngineState, Observation
from engine_launcher.pool import EnginePool, plan_replicas, visible_gpus
from proxy.settings import MAX_REPLICAS, EngineConfig, EngineConfigError
from tests.conftest import DEADLINE, wait_until

SMI = "GPU 0: NVIDIA H100 (UUID: GPU-a)\nGPU 1: NVIDIA H100 (UUID: GPU-b)\n"


def no_smi() -> str | None:
    return None


def cuda(plans: list[EngineConfig]) -> list[str | None]:
    return [dict(p.env).get("CUDA_VISIBLE_DEVICES") for p in plans]


def test_one_engine_by_default_with_the_inherited_environment() -> None:
    plans = plan_replicas(EngineConfig(), {}, no_smi)
    assert len(plans) == 1
    assert cuda(plans) == [None]
    assert plans[0].port is None


def test_replicas_without_gpus_get_free_ports_each() -> None:
    plans = plan_replicas(EngineConfig(replicas=3), {}, no_smi)
    assert [p.port for p in plans] == [None, None, None]
    assert all(p.replicas == 1 for p in plans)


def test_listed_gpus_pin_one_engine_each_and_fixed_ports_count_up() -> None:
    config = EngineConfig(kind="vllm-omni", model="m", gpus="0, 2,3", env={"A": "1"})
    plans = plan_replicas(config, {}, no_smi)
    assert cuda(plans) == ["0", "2", "3"]
    assert [p.port for p in plans] == [8091, 8092, 8093]
    assert all(dict(p.env)["A"] == "1" for p in plans)


def test_auto_uses_cuda_visible_devices_first_then_nvidia_smi() -> None:
    config = EngineConfig(gpus="auto")
    assert cuda(plan_replicas(config, {"CUDA_VISIBLE_DEVICES": "4,5"}, lambda: SMI)) == ["4", "5"]
    assert cuda(plan_replicas(config, {}, lambda: SMI)) == ["0", "1"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "1,-1,2"}) == ["1"]


def test_auto_without_a_gpu_is_one_engine_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "engine_launcher")
    plans = plan_replicas(EngineConfig(gpus="auto", replicas=4), {}, no_smi)
    assert len(plans) == 1
    assert "no GPU visible; running 1 engine" in caplog.text
    assert len(plan_replicas(EngineConfig(gpus="auto"), {"CUDA_VISIBLE_DEVICES": ""}, no_smi)) == 1


def test_external_takes_one_replica_per_upstream() -> None:
    config = EngineConfig(
        kind="external",
        upstreams=("ws://10.0.0.5:8091", "ws://10.0.0.6:8091"),
        health_url="http://10.0.0.5:8091/health",
    )
    plans = plan_replicas(config, {}, no_smi)
    assert [p.upstream for p in plans] == list(config.upstreams)
    assert [p.health_url for p in plans] == [None, None]
    single = plan_replicas(EngineConfig(kind="external", upstream="ws://h:1"), {}, no_smi)
    assert [p.upstream for p in single] == ["ws://h:1"]


@pytest.mark.parametrize(
    ("fields", "key"),
    [
        ({"replicas": 0}, "replicas"),
        ({"replicas": MAX_REPLICAS + 1}, "replicas"),
        ({"gpus": "0,,1"}, "gpus"),
        ({"gpus": "1,1"}, "gpus"),
        ({"upstreams": ("ws://h:1",)}, "upstreams"),
        ({"kind": "external", "upstreams": ("http://h:1",)}, "upstreams"),
    ],
)
def test_bad_pool_settings_name_their_key(fields: dict[str, Any], key: str) -> None:
    with pytest.raises(EngineConfigError) as info:
        EngineConfig(**fields)
    assert info.value.field == key


def test_fixed_ports_past_65535_are_refused() -> None:
    with pytest.raises(EngineConfigError, match="65535"):
        plan_replicas(EngineConfig(port=65535, replicas=2), {}, no_smi)


# -- the pool with fake supervisors --------------------------------------------------------------


class FakeSupervisor:
    """Runs until stopped, or raises the budget error when told to."""

    def __init__(self, index: int, on_state: Callable[..., None]) -> None:
        self.index = index
        self.on_state = on_state
        self.stop = asyncio.Event()
        self.fail = asyncio.Event()
        self.target: str | None = None
        self.restarts = 0
        self.ran = False

    def request_stop(self) -> None:
        self.stop.set()

    async def run(self) -> None:
        self.ran = True
        self.target = f"ws://127.0.0.1:{9000 + self.index}"
        self.on_state(EngineState.READY, Observation.READY, "")
        stop = asyncio.ensure_future(self.stop.wait())
        fail = asyncio.ensure_future(self.fail.wait())
        try:
            await asyncio.wait((stop, fail), return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
            fail.cancel()
        if self.fail.is_set():
            raise RestartBudgetExhausted("spent", restarts=1, window=1.0)


def fake_pool(count: int, **kwargs: Any) -> tuple[EnginePool, list[FakeSupervisor]]:
    made: list[FakeSupervisor] = []

    def make(index: int, config: EngineConfig, on_state: Callable[..., None]) -> Any:
        made.append(FakeSupervisor(index, on_state))
        return made[-1]

    pool = EnginePool(EngineConfig(replicas=count), make_supervisor=make, smi=no_smi, **kwargs)
    return pool, made


async def test_one_replica_failing_for_good_leaves_the_others_serving_until_all_fail() -> None:
    pool, made = fake_pool(2)
    task = asyncio.ensure_future(pool.run())
    await wait_until(lambda: all(s.ran for s in made), what="both running")
    made[0].fail.set()
    await wait_until(lambda: pool.replicas[0].failure is not None, what="replica 0 failed")
    assert not task.done()
    made[1].fail.set()
    with pytest.raises(RestartBudgetExhausted):
        async with asyncio.timeout(DEADLINE):
            await task


async def test_stop_ends_every_replica_without_an_error_even_after_one_failed() -> None:
    pool, made = fake_pool(3)
    task = asyncio.ensure_future(pool.run())
    await wait_until(lambda: all(s.ran for s in made), what="all running")
    made[2].fail.set()
    await wait_until(lambda: pool.replicas[2].failure is not None, what="replica 2 failed")
    pool.request_stop()
    async with asyncio.timeout(DEADLINE):
        await task


async def test_a_drain_waits_for_the_sessions_then_restarts_with_a_fresh_supervisor() -> None:
    live = {0: 0, 1: 2}
    events: list[tuple[int, bool]] = []
    pool, made = fake_pool(
        2,
        sessions=live.__getitem__,
        on_drain=lambda index, draining: events.append((index, draining)),
    )
    task = asyncio.ensure_future(pool.run())
    await wait_until(lambda: all(s.ran for s in made), what="both running")
    assert pool.request_drain(1)
    assert not pool.request_drain(1)  # already draining
    assert events == [(1, True)]
    for _ in range(20):
        await asyncio.sleep(0)
    assert not made[1].stop.is_set()  # its sessions are still live
    live[1] = 0
    pool.session_released(1)
    await wait_until(lambda: len(made) == 3 and made[2].ran, what="replica 1 restarted")
    assert made[1].stop.is_set()
    assert not made[0].stop.is_set()
    assert events == [(1, True), (1, False)]
    assert pool.replicas[1].supervisor is made[2]
    assert pool.restarts() == 1
    pool.request_stop()
    async with asyncio.timeout(DEADLINE):
        await task


async def test_sessions_that_outlive_the_drain_timeout_are_handed_back_to_close() -> None:
    closed: list[int] = []
    pool, made = fake_pool(
        1, sessions=lambda index: 1, on_drain_timeout=closed.append, drain_timeout=0.05
    )
    task = asyncio.ensure_future(pool.run())
    await wait_until(lambda: made[0].ran, what="running")
    pool.request_drain(0)
    await wait_until(lambda: closed == [0], what="drain timeout")
    await wait_until(lambda: len(made) == 2 and made[1].ran, what="restarted anyway")
    pool.request_stop()
    async with asyncio.timeout(DEADLINE):
        await task


def test_a_pool_whose_ports_run_out_is_a_config_error_before_anything_starts() -> None:
    """``serve`` exits 2 naming engine.port and its source, not with a traceback."""
    from proxy.errors import ConfigError
    from proxy.settings import load
    from proxy.startup import validate_runtime

    loaded = load(
        None, {"OMNI_SIDECAR_ENGINE_PORT": "65535", "OMNI_SIDECAR_ENGINE_REPLICAS": "2"}, None
    )
    with pytest.raises(ConfigError) as info:
        validate_runtime(loaded)
    assert info.value.key == "engine.port"
    assert "OMNI_SIDECAR_ENGINE_PORT" in str(info.value)
