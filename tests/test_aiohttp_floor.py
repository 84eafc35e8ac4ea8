"""The lowest aiohttp that ``pyproject.toml`` allows really runs the proxy.

The proxy reaches into aiohttp internals (every one is named in
``proxy/compat/``), and those moved between minor releases: aiohttp 3.10.11
has no ``ClientWSTimeout`` and no ``send_frame`` writer behind
``WebSocketResponse``, and with it every upgrade answered HTTP 500 while the
old ``aiohttp>=3.9`` pin allowed it. A floor that nobody installs is a guess,
so this test installs exactly the declared floor, with the product's other
runtime dependencies as declared, into a clean scratch venv and runs one
proxied session through it with real ``serve`` and ``probe`` children.

The product comes from this checkout (a ``.pth`` line), as the suite runs it:
compiled where the suite's install compiled it, so the compiled core and shell
meet the floor's aiohttp at run time. Compiling once more inside the scratch
venv took two of this test's three minutes and checked nothing the run does not.

The floor is parsed from ``pyproject.toml``, so the test follows the pin. It
needs PyPI (pip's cache makes repeat runs fast) and skips, naming the pip
error, only when pip cannot reach an index at all; any other install failure
fails the test.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import sys
import tomllib
import venv
from pathlib import Path
from typing import Final

import pytest
from packaging.requirements import Requirement

from proxy.native import CORE_BUILD
from tests.children import SidecarChild
from tests.conftest import DEADLINE

ROOT: Final = Path(__file__).resolve().parent.parent
PYPROJECT: Final = ROOT / "pyproject.toml"

#: pip's messages when no index can be reached (DNS, refused, timed out, proxy, TLS).
NETWORK_ERROR: Final = re.compile(
    r"NewConnectionError|Failed to establish a new connection|Temporary failure in name "
    r"resolution|Name or service not known|Network is unreachable|No route to host|"
    r"ConnectTimeoutError|ReadTimeoutError|Connection refused|ProxyError|SSLError|"
    r"Max retries exceeded",
    re.IGNORECASE,
)
#: A cold pip cache downloads a few MB of wheels.
PIP_TIMEOUT: Final = 240.0
#: The built-in simulator, unpaced: one response of 3 audio chunks.
FAST_SIMULATOR: Final = "--realtime-factor 0 --chunk-ms 200 --response-seconds 0.6"


def _dependencies() -> list[Requirement]:
    project = tomllib.loads(PYPROJECT.read_text(encoding="utf-8"))["project"]
    return [Requirement(line) for line in project["dependencies"]]


def declared_floor() -> str:
    """The version in the ``aiohttp>=...`` requirement of ``[project] dependencies``."""
    for requirement in _dependencies():
        if requirement.name == "aiohttp":
            floors = [spec.version for spec in requirement.specifier if spec.operator == ">="]
            assert len(floors) == 1, f"aiohttp needs exactly one >= floor: {requirement}"
            return floors[0]
    raise AssertionError("pyproject.toml declares no aiohttp dependency")


def _child_env() -> dict[str, str]:
    """This environment without anything that would steer the scratch venv's Python."""
    drop = ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PIP_REQUIRE_VIRTUALENV")
    return {
        key: value
        for key, value in os.environ.items()
        if key not in drop
        and (not key.startswith("OMNI_SIDECAR_") or key.startswith("OMNI_SIDECAR_TESTS_"))
    }


async def _run(*argv: str | Path, cwd: Path, timeout: float) -> tuple[int, str]:
    """Run a child to completion: (exit status, stdout and stderr together)."""
    proc = await asyncio.create_subprocess_exec(
        *map(str, argv),
        cwd=cwd,
        env=_child_env(),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    try:
        async with asyncio.timeout(timeout):
            out, _ = await proc.communicate()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode is not None
    return proc.returncode, out.decode(errors="replace")


async def _pip(
    python: Path, *args: str, cwd: Path, what: str, retries: int = 2, timeout: int = 30
) -> None:
    """``pip --python PYTHON ARGS``; skip when no index answers, fail on any other error.

    The suite's own pip installs into the scratch venv, which then needs none of its
    own (seeding one took longer than the installs). ``retries`` and ``timeout`` are
    pip's (per request), so an unreachable index is told apart in seconds rather than
    after pip's default minutes.
    """
    rc, out = await _run(
        sys.executable, "-m", "pip", "--python", python, *args,
        "--retries", str(retries), "--timeout", str(timeout),
        cwd=cwd, timeout=PIP_TIMEOUT,
    )  # fmt: skip
    if rc == 0:
        return
    if NETWORK_ERROR.search(out):
        pytest.skip(f"PyPI unreachable while trying to {what}: {out.strip()[-600:]}")
    pytest.fail(f"pip could not {what} (exit {rc}):\n{out[-3000:]}")


def test_the_declared_range_holds_the_tested_version() -> None:
    """The dev venv's aiohttp (what the suite runs against) is inside the declared range."""
    import aiohttp

    (requirement,) = [r for r in _dependencies() if r.name == "aiohttp"]
    assert any(spec.operator == "<" for spec in requirement.specifier), (
        f"{requirement}: no upper bound; the next untested minor must be excluded"
    )
    assert requirement.specifier.contains(aiohttp.__version__), (
        f"aiohttp {aiohttp.__version__} runs the suite but {requirement} excludes it"
    )


@pytest.mark.timeout(4 * PIP_TIMEOUT)
async def test_one_proxied_session_on_the_declared_aiohttp_floor(tmp_path: Path) -> None:
    """serve and probe, installed with exactly the declared floor, complete one response.

    With the floor lowered to 3.10.11 this fails naming the missing hooks (and serve exits 2).
    """
    floor = declared_floor()
    others = [str(r) for r in _dependencies() if r.name != "aiohttp"]
    env_dir = tmp_path / "venv"
    await asyncio.to_thread(venv.EnvBuilder(with_pip=False, clear=True).create, env_dir)
    python = env_dir / "bin" / "python"

    await _pip(
        python, "download", "--no-deps", "--dest", str(tmp_path / "dl"), f"aiohttp=={floor}",
        cwd=tmp_path, what=f"download aiohttp=={floor}", retries=1, timeout=15,
    )  # fmt: skip
    await _pip(
        python, "install", "--quiet", "--no-compile", f"aiohttp=={floor}", *others,
        cwd=tmp_path, what=f"install aiohttp=={floor} and {others}",
    )  # fmt: skip
    # The product from this checkout, after the venv's own packages on sys.path.
    (site_packages,) = (env_dir / "lib").glob("python3*/site-packages")
    (site_packages / "omni_sidecar_checkout.pth").write_text(f"{ROOT}\n", encoding="utf-8")

    # What serve's startup check sees in that venv: the floor's aiohttp, this checkout's build.
    rc, out = await _run(
        python, "-c",
        "import json, aiohttp, proxy, proxy.compat as c, proxy.native as n;"
        "print(json.dumps([aiohttp.__version__, aiohttp.__file__, c.missing_hooks(),"
        " proxy.__file__, n.CORE_BUILD]))",
        cwd=tmp_path, timeout=DEADLINE,
    )  # fmt: skip
    assert rc == 0, out
    version, aiohttp_file, missing, package_file, build = json.loads(out.strip().splitlines()[-1])
    assert version == floor
    assert Path(aiohttp_file).is_relative_to(env_dir), aiohttp_file
    assert missing == [], f"aiohttp {floor} lacks hooks proxy/compat/ needs: {missing}"
    assert Path(package_file).is_relative_to(ROOT), package_file
    assert build == CORE_BUILD, f"the floor venv runs the {build} build, the suite the {CORE_BUILD}"

    log = tmp_path / "serve.log"
    serve = SidecarChild(
        "--log-level", "info", "--engine-simulator-args", FAST_SIMULATOR,
        command=[str(python), "-m", "proxy"], base_env=_child_env(), cwd=tmp_path, log_path=log,
        ready_timeout=DEADLINE * 3, stop_grace=DEADLINE,
    )  # fmt: skip
    serve.start()
    port = serve.port
    try:
        await serve.ready()

        rc, out = await _run(
            python, "-m", "proxy", "probe", f"ws://127.0.0.1:{port}/v1/realtime", "--json", "--no-realtime",
            "--input-seconds", "0.2", "--timeout", str(DEADLINE * 2),
            cwd=tmp_path, timeout=DEADLINE * 3,
        )  # fmt: skip
        assert rc == 0, f"probe on aiohttp {floor} failed:\n{out}\n{log.read_text()[-3000:]}"
        result = json.loads(out)
        assert result["completed"] is True, result
        assert result["response_statuses"] == ["completed"], result
        assert result["audio_frames"] == 3, result

        serve.proc.send_signal(signal.SIGTERM)
        assert await serve.exited(DEADLINE) == 0, log.read_text()[-3000:]
    finally:
        # serve's engine child dies with it (PR_SET_PDEATHSIG); only serve is ours to stop.
        await serve.astop()
