"""The ``sidecar`` image of deploy/container/Containerfile, built and run with podman
(issue "The image the manifests name"; docs/operations.md, Container image).

The image is built on a Debian bookworm base made with debootstrap (cached in
``.cache/container-image/``, tests/integration/container_image.py) and run the
way the manifests run it: read-only root filesystem with no tmpfs at all
(``--read-only --read-only-tmpfs=false``), the listeners and the admin token from
the environment. From the host, as a client and an operator see it: ``/readyz``
200 in front of the built-in simulator, the image's HEALTHCHECK passing, one
relayed session whose cancel leaves no audio of the cancelled response (the
simulator sends late audio; the sidecar's metrics show it dropped), ``--version``
and the startup log naming the compiled build, a non-root process, and
``podman stop`` (the image's STOPSIGNAL, SIGTERM) draining a live session: 503
while draining, ``session.closed`` {shutdown} and close 1001 at the drain
deadline, exit status 0 inside the stop timeout.

Skips with the reason where podman cannot build and run images (not root, or
podman, runc or debootstrap missing: .ci/run installs them). The first build
debootstraps the base and downloads the dependencies (a few minutes); later runs
reuse both.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import subprocess
import time
import tomllib
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.children import child_pids, free_port
from tests.conftest import DEADLINE, MS, wait_until
from tests.integration.container_image import (
    REPO_ROOT,
    BuiltImage,
    build_image,
    missing_tools,
    remove_image,
)
from tests.integration.helpers import AUDIO_DELTA, cancel_mid_response, connect, request_response

WHY_NOT = missing_tools()

pytestmark = [
    pytest.mark.skipif(WHY_NOT is not None, reason=WHY_NOT or ""),
    # A cold first build (debootstrap, packages, dependencies) takes minutes.
    pytest.mark.timeout(1800),
]

VENV = "/opt/omni-sidecar/venv"
ADMIN_TOKEN = f"container-tier-{uuid.uuid4().hex}"
#: 200 ms chunks at real-time pace, 3 late chunks after a cancel (the 0.30 engine's flaw).
PACED = "--chunk-ms 200 --realtime-factor 1 --response-seconds 1.2 --late-audio-chunks 3"
#: Drain for the SIGTERM test (seconds) and podman's stop timeout around it.
DRAIN_TIMEOUT = 2000 * MS
STOP_TIMEOUT = 30


def _version() -> str:
    with open(REPO_ROOT / "pyproject.toml", "rb") as handle:
        return str(tomllib.load(handle)["project"]["version"])


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BuiltImage]:
    built = build_image("sidecar", log_dir=tmp_path_factory.mktemp("image"))
    try:
        yield built
    finally:
        remove_image(built)


@dataclass
class Container:
    image: BuiltImage
    name: str
    port: int
    admin_port: int

    @property
    def http(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def ws(self) -> str:
        return f"ws://127.0.0.1:{self.port}/v1/realtime"

    @property
    def admin(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}"

    def inspect(self, template: str) -> str:
        return self.image.podman.run("inspect", "--format", template, self.name).stdout.strip()

    def exec(self, *argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return self.image.podman.run("exec", self.name, *argv, check=check)

    def logs(self) -> str:
        done = self.image.podman.run("logs", self.name, check=False)
        return done.stdout + done.stderr

    def readyz(self) -> int:
        try:
            with urllib.request.urlopen(f"{self.http}/readyz", timeout=1) as response:
                return int(response.status)
        except urllib.error.HTTPError as exc:
            return exc.code
        except OSError:
            return 0

    def wait_ready(self, timeout: float = 3 * DEADLINE) -> None:
        deadline = time.monotonic() + timeout
        while self.readyz() != 200:
            if self.inspect("{{.State.Running}}") != "true":
                pytest.fail(f"container {self.name} exited:\n{self.logs()[-4000:]}")
            if time.monotonic() > deadline:
                pytest.fail(f"/readyz not 200 within {timeout} s:\n{self.logs()[-4000:]}")
            time.sleep(0.1)


@contextlib.contextmanager
def running(image: BuiltImage, label: str, **env: str) -> Iterator[Container]:
    """Run the image as the manifests do (read-only root, settings from the environment)."""
    container = Container(
        image, f"omni-sidecar-test-{image.run_id}-{label}", free_port(), free_port()
    )
    settings = {
        "OMNI_SIDECAR_LISTEN": f"127.0.0.1:{container.port}",
        "OMNI_SIDECAR_ADMIN_LISTEN": f"127.0.0.1:{container.admin_port}",
        "OMNI_SIDECAR_ADMIN_TOKEN": ADMIN_TOKEN,
        **env,
    }
    image.podman.run(
        "run", "--detach", "--name", container.name, "--runtime", "runc",
        "--network", "host", "--read-only", "--read-only-tmpfs=false",
        # No timers (they need systemd): `podman healthcheck run` runs the check by hand.
        "--health-interval", "disable",
        *(arg for key, value in settings.items() for arg in ("--env", f"{key}={value}")),
        image.tag,
    )  # fmt: skip
    try:
        yield container
    finally:
        image.podman.run("rm", "--force", "--time", "0", container.name, check=False)


@pytest.fixture(scope="module")
def serving(image: BuiltImage) -> Iterator[Container]:
    with running(image, "serving", OMNI_SIDECAR_ENGINE_SIMULATOR_ARGS=PACED) as container:
        container.wait_ready()
        yield container


def test_the_image_is_configured_as_documented(image: BuiltImage, serving: Container) -> None:
    inspected = json.loads(image.podman.run("image", "inspect", image.tag).stdout)[0]
    config = inspected["Config"]
    assert config["User"] == "10001:10001"
    assert config["Entrypoint"] == [f"{VENV}/bin/omni-sidecar"]
    assert config["Cmd"] == ["serve"]
    assert config["StopSignal"] in ("SIGTERM", "15")
    assert "/opt/omni-sidecar/healthcheck.py" in " ".join(inspected["Healthcheck"]["Test"])
    env = dict(item.split("=", 1) for item in config["Env"])
    # Listeners keep the sidecar's loopback defaults unless the deployment says otherwise.
    assert "OMNI_SIDECAR_LISTEN" not in env and "OMNI_SIDECAR_ADMIN_LISTEN" not in env
    assert float(env["OMNI_SIDECAR_DRAIN_TIMEOUT"]) + 5 < 30  # preStop 5 s + drain < 30 s grace
    # No compiler or installer in the final stage.
    found = serving.exec(
        "/bin/sh",
        "-c",
        f"for t in cc gcc c++ make ld as {VENV}/bin/pip; do command -v $t; done; true",
    ).stdout.split()
    assert found == []


def test_version_names_the_build_the_image_runs(serving: Container) -> None:
    # In the running container (podman 4.3 with runc here waits 20 s after a
    # short-lived `podman run` has exited; exec does not).
    image = serving.image
    entrypoint = json.loads(
        image.podman.run(
            "image", "inspect", "--format", "{{json .Config.Entrypoint}}", image.tag
        ).stdout
    )
    line = serving.exec(*entrypoint, "--version").stdout.strip()
    assert line.startswith(f"omni-sidecar {_version()}"), line
    build = serving.exec(
        f"{VENV}/bin/python", "-c", "from proxy.native import CORE_BUILD; print(CORE_BUILD)"
    ).stdout.strip()
    # The builder stage has a C compiler, so the image runs the compiled build, and
    # says so everywhere: --version, the ready line.
    assert build == "mypyc", line
    assert line == f"omni-sidecar {_version()} (mypyc build)", line
    ready = re.search(r"omni-sidecar ready: .*\(core: (\w+)", serving.logs())
    assert ready is not None and ready.group(1) == "mypyc"


async def test_ready_and_a_cancel_leaves_no_stale_audio(serving: Container) -> None:
    async with aiohttp.ClientSession() as http:
        for path in ("/healthz", "/readyz"):
            async with http.get(serving.http + path) as response:
                assert response.status == 200, path
    # The image's HEALTHCHECK finds the listener from OMNI_SIDECAR_LISTEN.
    check = serving.image.podman.run("healthcheck", "run", serving.name, check=False)
    assert check.returncode == 0, check.stdout + check.stderr

    async with connect(serving.ws) as client:
        cancelled = await cancel_mid_response(
            client, lambda rid: {"type": "response.cancel", "response_id": rid}
        )
    assert cancelled.audio_after() == []
    assert cancelled.done()["response"]["status"] == "cancelled"

    # The engine did send late audio: the sidecar dropped it (admin listener, with the token).
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{serving.admin}/metrics") as response:
            assert response.status == 401
        async with http.get(
            f"{serving.admin}/metrics", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}
        ) as response:
            assert response.status == 200
            text = await response.text()
    late = [
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "omni_sidecar_dropped_events_total"
        and sample.labels.get("reason") == "late_audio"
    ]
    assert late and late[0] >= 1


def _uids(pid: int) -> list[int]:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Uid:"):
            return [int(field) for field in line.split()[1:]]
    raise AssertionError(f"no Uid line for {pid}")


def test_runs_as_non_root_on_a_read_only_root(serving: Container) -> None:
    assert serving.inspect("{{.HostConfig.ReadonlyRootfs}}") == "true"
    # The process as the host sees it (no user namespace: container uid = host uid).
    sidecar = int(serving.inspect("{{.State.Pid}}"))
    engine = child_pids(sidecar)
    assert len(engine) == 1, engine  # the simulator child
    for pid in (sidecar, *engine):
        assert set(_uids(pid)) == {10001}, pid
    # Not even /tmp is writable, and the sidecar served all the same.
    write = serving.exec(f"{VENV}/bin/python", "-c", "open('/tmp/probe', 'w')", check=False)
    assert write.returncode != 0
    assert "Read-only file system" in write.stderr
    assert serving.readyz() == 200


async def test_podman_stop_drains_a_live_session_then_exits_0(image: BuiltImage) -> None:
    with running(
        image,
        "drain",
        OMNI_SIDECAR_DRAIN_TIMEOUT=str(DRAIN_TIMEOUT),
        OMNI_SIDECAR_ENGINE_SIMULATOR_ARGS="--chunk-ms 200 --realtime-factor 1 "
        "--response-seconds 60",
    ) as container:
        container.wait_ready()
        async with connect(container.ws) as client, aiohttp.ClientSession() as http:
            await request_response(client, open_session=True)
            await client.recv_until(AUDIO_DELTA)  # a response is in flight
            stop = await asyncio.create_subprocess_exec(
                *image.podman.argv("stop", "--time", str(STOP_TIMEOUT), container.name),
                env=image.podman.env,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
            )
            stopped_at = time.monotonic()

            async def draining() -> bool:
                try:
                    async with http.get(f"{container.http}/readyz") as response:
                        return response.status == 503
                except aiohttp.ClientError:
                    return False

            await wait_until(draining, timeout=DEADLINE, what="/readyz 503 while draining")
            events = await client.recv_until_closed(timeout=DRAIN_TIMEOUT + DEADLINE)
            closed_at = time.monotonic()
            assert client.close_code == 1001
            assert events[-1]["type"] == "session.closed"
            assert events[-1]["reason"] == "shutdown"
            assert DRAIN_TIMEOUT * 0.9 <= closed_at - stopped_at
        async with asyncio.timeout(STOP_TIMEOUT + DEADLINE):
            output, _ = await stop.communicate()
        took = time.monotonic() - stopped_at
        assert stop.returncode == 0, output
        state: dict[str, Any] = json.loads(container.inspect("{{json .State}}"))
        assert state["Running"] is False
        assert state["ExitCode"] == 0, container.logs()[-4000:]
        assert took < STOP_TIMEOUT, f"podman stop took {took:.1f} s: SIGKILL, not a drain"
        assert container.logs().rstrip().endswith("stopped")
