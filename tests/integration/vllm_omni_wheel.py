"""vLLM-Omni's own client and protocol code, loaded from the PyPI wheel at test time.

The released ``vllm-omni`` wheel cannot simply be imported: ``import vllm_omni``
runs the package ``__init__``, which pulls in torch and vLLM (docs/engine-protocol.md, Shipped
clients). Its
protocol codec, its ``DuplexClient`` and the engine's pure Realtime projection
do not need any of that, so this module

1. fetches ``vllm-omni==0.30.0`` with ``pip download --no-deps`` into a cache
   directory (``$OMNI_SIDECAR_TESTS_CACHE``, else
   ``$XDG_CACHE_HOME/omni-sidecar-tests`` or ``~/.cache/omni-sidecar-tests``),
   or takes the wheel named by ``$OMNI_SIDECAR_VLLM_OMNI_WHEEL`` (offline runs);
2. checks its SHA-256 against the published file;
3. extracts only ``vllm_omni/clients/``, ``vllm_omni/protocol/``,
   ``vllm_omni/utils/audio_resample.py`` and four pure modules of
   ``vllm_omni/engine/duplex/`` into a temporary directory, under empty
   ``__init__.py`` files for the parent packages (a bare namespace);
4. puts that directory first on ``sys.path``.

Nothing of vLLM-Omni is copied into this repository (Apache-2.0 code stays in
the wheel). The runtime needs are the standard library, ``numpy``, ``pybase64``
and ``websockets``. When the wheel cannot be fetched, every test that uses it
is skipped with the reason.

Use it through the ``vllm_omni`` fixture (``pytest_plugins =
["tests.integration.vllm_omni_wheel"]`` in a test module). ``run_duplex_session``
drives the wheel's ``DuplexClient`` through one scripted session (shared with
the real-engine tier, which passes the installed client module instead).
"""

from __future__ import annotations

import array
import asyncio
import hashlib
import importlib
import json
import math
import os
import subprocess
import sys
import tempfile
import warnings
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Final

import pytest

__all__ = [
    "VLLM_OMNI_VERSION",
    "WHEEL_SHA256",
    "DuplexRun",
    "EngineSession",
    "VllmOmni",
    "load_engine_session",
    "load_realtime_envelope",
    "load_vllm_omni",
    "run_duplex_session",
    "vllm_omni",
]

VLLM_OMNI_VERSION: Final = "0.30.0"
WHEEL_NAME: Final = f"vllm_omni-{VLLM_OMNI_VERSION}-py3-none-any.whl"
#: SHA-256 of the file PyPI serves for vllm-omni 0.30.0 (the wheel is immutable).
WHEEL_SHA256: Final = "141cb0c7b9c07970e5c92a99aab9696e81682dbfa3d2bfcde359c3c1533385f4"
#: ``pip download`` of an 8 MB wheel; well inside the per-test timeout.
PIP_TIMEOUT: Final = 90.0

#: What is taken out of the wheel: everything below these prefixes (``.py`` only).
_EXTRACT_PREFIXES: Final = (
    "vllm_omni/clients/",
    "vllm_omni/protocol/",
    "vllm_omni/utils/audio_resample.py",
    # The engine's stateless client-event parser and its wire projection. The
    # real vllm_omni/engine/__init__.py imports torch; these four modules only
    # import vllm_omni.protocol and each other.
    "vllm_omni/engine/duplex/commands.py",
    "vllm_omni/engine/duplex/events.py",
    "vllm_omni/engine/duplex/realtime_commands.py",
    "vllm_omni/engine/duplex/realtime_events.py",
)
#: Parent packages replaced by empty ``__init__.py`` files.
_EMPTY_PACKAGES: Final = (
    "vllm_omni",
    "vllm_omni/utils",
    "vllm_omni/engine",
    "vllm_omni/engine/duplex",
)
_MODULES: Final = {
    "client": "vllm_omni.clients.duplex",
    "realtime_events": "vllm_omni.protocol.realtime.events",
    "duplex_events": "vllm_omni.protocol.duplex.events",
    "errors": "vllm_omni.protocol.duplex.errors",
    "commands": "vllm_omni.engine.duplex.commands",
    "projection": "vllm_omni.engine.duplex.realtime_events",
}


class WheelUnavailable(Exception):
    """The wheel could not be fetched, verified or imported (the test is skipped)."""


@dataclass(frozen=True, slots=True)
class VllmOmni:
    """The wheel's modules this suite uses.

    Attributes:
        wheel: the verified wheel file.
        root: the directory holding the extracted ``vllm_omni`` namespace.
        client: ``vllm_omni.clients.duplex`` (``DuplexClient``, ``wrap_event``…).
        realtime_events: ``vllm_omni.protocol.realtime.events`` (Tier 1 classes).
        duplex_events: ``vllm_omni.protocol.duplex.events`` (Tier 1-3 vocabulary).
        errors: ``vllm_omni.protocol.duplex.errors`` (code → ``error.type``).
        commands: ``vllm_omni.engine.duplex.commands`` (client-event parser).
        projection: ``vllm_omni.engine.duplex.realtime_events`` (internal → wire).
    """

    wheel: Path
    root: Path
    client: ModuleType
    realtime_events: ModuleType
    duplex_events: ModuleType
    errors: ModuleType
    commands: ModuleType
    projection: ModuleType


def cache_dir() -> Path:
    """Where the downloaded wheel is kept between runs."""
    explicit = os.environ.get("OMNI_SIDECAR_TESTS_CACHE")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "omni-sidecar-tests"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def fetch_wheel() -> Path:
    """Return the verified vllm-omni 0.30.0 wheel, downloading it once with pip.

    Raises:
        WheelUnavailable: pip failed or timed out, or the file is not the published one.
    """
    explicit = os.environ.get("OMNI_SIDECAR_VLLM_OMNI_WHEEL")
    if explicit:
        candidates = [Path(explicit)]
    else:
        target = cache_dir() / f"vllm-omni-{VLLM_OMNI_VERSION}"
        wheel = target / WHEEL_NAME
        if not wheel.is_file():
            target.mkdir(parents=True, exist_ok=True)
            # Download next to the target and rename, so an interrupted run
            # never leaves a partial file under the final name.
            with tempfile.TemporaryDirectory(dir=target) as staging:
                command = [
                    sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                    "--disable-pip-version-check", "--dest", staging,
                    f"vllm-omni=={VLLM_OMNI_VERSION}",
                ]  # fmt: skip
                try:
                    done = subprocess.run(
                        command, capture_output=True, text=True, timeout=PIP_TIMEOUT, check=False
                    )
                except (OSError, subprocess.TimeoutExpired) as exc:
                    raise WheelUnavailable(f"pip download vllm-omni=={VLLM_OMNI_VERSION}: {exc}")
                staged = Path(staging) / WHEEL_NAME
                if done.returncode != 0 or not staged.is_file():
                    tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
                    raise WheelUnavailable(
                        f"pip download vllm-omni=={VLLM_OMNI_VERSION} failed "
                        f"(exit {done.returncode}): {' | '.join(tail)}"
                    )
                os.replace(staged, wheel)
        candidates = [wheel]
    wheel = candidates[0]
    if not wheel.is_file():
        raise WheelUnavailable(f"{wheel} does not exist")
    actual = _sha256(wheel)
    if actual != WHEEL_SHA256:
        raise WheelUnavailable(
            f"{wheel} has sha256 {actual}, expected the published {WHEEL_SHA256}"
        )
    return wheel


def extract_namespace(wheel: Path, dest: Path) -> Path:
    """Extract the pure parts of the wheel under ``dest``; return ``dest``."""
    with zipfile.ZipFile(wheel) as archive:
        members = [
            name
            for name in archive.namelist()
            if name.endswith(".py") and name.startswith(_EXTRACT_PREFIXES)
        ]
        if not any(name == "vllm_omni/clients/duplex.py" for name in members):
            raise WheelUnavailable(f"{wheel.name} has no vllm_omni/clients/duplex.py")
        for name in members:
            archive.extract(name, dest)
    for package in _EMPTY_PACKAGES:
        init = dest / package / "__init__.py"
        init.parent.mkdir(parents=True, exist_ok=True)
        init.write_text("")
    return dest


_LOADED: VllmOmni | None = None
_FAILED: str | None = None
_TMP: tempfile.TemporaryDirectory[str] | None = None


def load_vllm_omni() -> VllmOmni:
    """Fetch, extract and import once per process; later calls reuse the result.

    Raises:
        WheelUnavailable: with the reason (fetch, checksum, or a missing dependency).
    """
    global _LOADED, _FAILED, _TMP
    if _LOADED is not None:
        return _LOADED
    if _FAILED is not None:
        raise WheelUnavailable(_FAILED)
    try:
        for dependency in ("numpy", "pybase64", "websockets"):
            try:
                importlib.import_module(dependency)
            except ImportError as exc:
                raise WheelUnavailable(
                    f"vllm_omni's client needs {dependency!r}: pip install {dependency}"
                ) from exc
        wheel = fetch_wheel()
        _TMP = tempfile.TemporaryDirectory(prefix="vllm-omni-ns-")  # removed at exit
        root = extract_namespace(wheel, Path(_TMP.name))
        sys.path.insert(0, str(root))
        # A vllm_omni imported from elsewhere (a full install) must not shadow it.
        for name in [m for m in sys.modules if m == "vllm_omni" or m.startswith("vllm_omni.")]:
            del sys.modules[name]
        with warnings.catch_warnings():
            # protocol/realtime/audio.py imports audioop (deprecated in 3.11+).
            warnings.simplefilter("ignore", DeprecationWarning)
            modules = {key: importlib.import_module(name) for key, name in _MODULES.items()}
    except WheelUnavailable as exc:
        _FAILED = str(exc)
        raise
    except ImportError as exc:
        _FAILED = f"importing vllm_omni {VLLM_OMNI_VERSION} from the wheel failed: {exc!r}"
        raise WheelUnavailable(_FAILED) from exc
    _LOADED = VllmOmni(wheel=wheel, root=root, **modules)
    return _LOADED


# ---------------------------------------------- the engine's session bookkeeping (history)

#: The engine's per-session history and playback ledger (``DuplexEngineSession``)
#: and its ``playback.ack`` rules (``apply_playback_ack``). Pure Python, but the
#: real ``vllm_omni/engine/duplex/session/__init__.py`` imports the runner (torch)
#: and ``engine_session`` imports vLLM-Omni's metrics (vLLM): those are replaced
#: by the stand-ins below, which only provide the names.
_SESSION_MODULES: Final = (
    "vllm_omni/engine/duplex/config.py",
    "vllm_omni/engine/duplex/contracts.py",
    "vllm_omni/engine/duplex/session/engine_session.py",
    "vllm_omni/engine/duplex/session/lease.py",
    "vllm_omni/engine/duplex/session/playback_ledger.py",
)
_SESSION_STUBS: Final = {
    "vllm_omni/engine/duplex/session/__init__.py": "",
    "vllm_omni/metrics/__init__.py": "",
    # Per-response stage statistics: the ledger never reads them.
    "vllm_omni/metrics/stats.py": (
        "DUPLEX_STAGE_TABLE_EXCLUDE = frozenset()\n"
        "class OrchestratorAggregator:\n"
        "    def __init__(self, *args, **kwargs): pass\n"
        "    def __getattr__(self, name): return lambda *args, **kwargs: None\n"
        "class StageRequestStats: pass\n"
        "def _one_row_per_stage(*args, **kwargs): return []\n"
        "def _tpot_interval_weight(*args, **kwargs): return 0\n"
    ),
    "vllm_omni/metrics/utils.py": (
        "def _as_int(value, default=0):\n"
        "    try: return int(value)\n"
        "    except (TypeError, ValueError): return default\n"
        "def _as_optional_int(value):\n"
        "    try: return int(value)\n"
        "    except (TypeError, ValueError): return None\n"
    ),
}


@dataclass(frozen=True, slots=True)
class EngineSession:
    """The wheel's session bookkeeping modules.

    Attributes:
        engine_session: ``vllm_omni.engine.duplex.session.engine_session``
            (``DuplexEngineSession``: history, playback cursors, truncation).
        playback_ledger: ``vllm_omni.engine.duplex.session.playback_ledger``
            (``apply_playback_ack``).
        config: ``vllm_omni.engine.duplex.config`` (``DuplexSessionConfig``).
    """

    engine_session: ModuleType
    playback_ledger: ModuleType
    config: ModuleType


def load_engine_session(vo: VllmOmni) -> EngineSession:
    """Extract and import the engine's session bookkeeping next to ``vo``'s namespace.

    Raises:
        WheelUnavailable: a module is missing from the wheel or does not import.
    """
    with zipfile.ZipFile(vo.wheel) as archive:
        names = set(archive.namelist())
        for name in _SESSION_MODULES:
            if name not in names:
                raise WheelUnavailable(f"{vo.wheel.name} has no {name}")
            archive.extract(name, vo.root)
    for name, text in _SESSION_STUBS.items():
        path = vo.root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    try:
        importlib.import_module("regex")
    except ImportError:
        # contracts.py uses the third-party regex module only as a drop-in for re.
        import re

        sys.modules["regex"] = re
    try:
        return EngineSession(
            engine_session=importlib.import_module(
                "vllm_omni.engine.duplex.session.engine_session"
            ),
            playback_ledger=importlib.import_module(
                "vllm_omni.engine.duplex.session.playback_ledger"
            ),
            config=importlib.import_module("vllm_omni.engine.duplex.config"),
        )
    except ImportError as exc:
        raise WheelUnavailable(f"the engine's session modules do not import: {exc!r}") from exc


# ------------------------------------------ the engine's connection envelope (query parameters)

#: The serving layer's per-connection query policy (``RealtimeEnvelope``: whether
#: ``?model=`` opens a default session on connect, ``?autostart=0`` / ``?resume=1``).
#: It imports only modules already extracted; its parent packages are left empty.
_ENVELOPE_MODULE: Final = "vllm_omni/entrypoints/duplex/realtime_input.py"
_ENVELOPE_PACKAGES: Final = ("vllm_omni/entrypoints", "vllm_omni/entrypoints/duplex")


def load_realtime_envelope(vo: VllmOmni) -> ModuleType:
    """Extract and import ``vllm_omni.entrypoints.duplex.realtime_input`` next to ``vo``.

    Raises:
        WheelUnavailable: the module is missing from the wheel or does not import.
    """
    with zipfile.ZipFile(vo.wheel) as archive:
        if _ENVELOPE_MODULE not in archive.namelist():
            raise WheelUnavailable(f"{vo.wheel.name} has no {_ENVELOPE_MODULE}")
        archive.extract(_ENVELOPE_MODULE, vo.root)
    for package in _ENVELOPE_PACKAGES:
        init = vo.root / package / "__init__.py"
        if not init.exists():
            init.write_text("")
    try:
        return importlib.import_module("vllm_omni.entrypoints.duplex.realtime_input")
    except ImportError as exc:
        raise WheelUnavailable(f"importing {_ENVELOPE_MODULE}: {exc!r}") from exc


@pytest.fixture(scope="session")
def vllm_omni() -> VllmOmni:
    """vLLM-Omni 0.30.0's client/protocol modules; skips when the wheel is unavailable."""
    try:
        return load_vllm_omni()
    except WheelUnavailable as exc:
        pytest.skip(f"vllm-omni {VLLM_OMNI_VERSION} wheel unavailable: {exc}")


# ------------------------------------------------------------ a scripted DuplexClient session


@dataclass
class DuplexRun:
    """What one scripted ``DuplexClient`` session saw and sent, in wire order.

    Attributes:
        timeline: ``("send" | "recv", event)`` for every frame, in the order the
            client's transport sent or received it.
        session_id: from ``session.created``.
        completed_id / cancelled_id: the two responses.
        completed_audio: PCM the client's ``ResponseHandle.audio()`` yielded.
        completed_transcript: ``ResponseHandle.transcript`` of the first response.
        statuses: ``response.status`` of the two handles' terminal events.
        close_code: WebSocket close code seen by the client.
        closed_expected: the client ended the session the normal way.
    """

    timeline: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    session_id: str | None = None
    completed_id: str | None = None
    cancelled_id: str | None = None
    completed_audio: bytes = b""
    completed_transcript: str = ""
    statuses: tuple[str, str] | None = None
    close_code: int | None = None
    closed_expected: bool = False

    def received(self) -> list[dict[str, Any]]:
        return [event for way, event in self.timeline if way == "recv"]

    def sent(self) -> list[dict[str, Any]]:
        return [event for way, event in self.timeline if way == "send"]

    def after_first_sent(self, kind: str) -> list[dict[str, Any]]:
        """Events received after the client sent the first ``kind``."""
        at = next(
            i for i, (way, e) in enumerate(self.timeline) if way == "send" and e["type"] == kind
        )
        return [event for way, event in self.timeline[at:] if way == "recv"]


async def run_duplex_session(
    duplex: ModuleType, url: str, *, model: str, deadline: float, audio_type: str
) -> DuplexRun:
    """Drive ``vllm_omni.clients.duplex.DuplexClient`` through one whole session.

    Open (``session.update`` → ``session.created``), stream 400 ms of a 16 kHz
    PCM16 tone, commit (``auto_response``) and play a whole response; again, and
    ``cancel_response()`` after its first audio chunk; a heartbeat; then leave
    the context manager (``session.close`` → ``session.closed``). Every wait
    is bounded by ``deadline``.

    Args:
        duplex: the ``vllm_omni.clients.duplex`` module (wheel or installed).
        url: ``ws://host:port`` (the client adds ``/v1/realtime?duplex=1&...``).
        model: the ``model`` the client announces.
        deadline: seconds for any single wait.
        audio_type: the audio delta type the engine sends.
    """
    import websockets

    run = DuplexRun()

    class Recorder:
        """The client's transport, recording every frame in order."""

        def __init__(self, ws: Any) -> None:
            self.ws = ws

        async def send(self, data: str) -> None:
            run.timeline.append(("send", json.loads(data)))
            await self.ws.send(data)

        async def recv(self) -> str | bytes:
            data = await self.ws.recv()
            if isinstance(data, str):
                run.timeline.append(("recv", json.loads(data)))
            return data

        async def close(self) -> None:
            await self.ws.close()
            run.close_code = self.ws.close_code

    async def connect(target: str) -> Any:
        return Recorder(await websockets.connect(target, max_size=64 << 20))

    # A tone, not silence: vLLM-Omni's codec marks silent appends non-speech
    # (RMS below overlap_silence_rms) and a commit of only those is a silence
    # declaration (response.listen, no response).
    tone = array.array(
        "h",
        (int(9000 * math.sin(2 * math.pi * 440 * i / 16000)) for i in range(16000 * 400 // 1000)),
    )
    if sys.byteorder != "little":
        tone.byteswap()  # PCM16 on the wire is little-endian
    speech = tone.tobytes()
    client = duplex.DuplexClient(
        url, model=model, reconnect=None, heartbeat_interval_s=None, connect=connect
    )
    async with asyncio.timeout(deadline * 4):
        async with client:
            run.session_id = client.session_id
            responses = client.responses()
            await client.stream_pcm(speech, chunk_ms=200, realtime=False)
            await client.commit()
            async with asyncio.timeout(deadline):
                first = await anext(responses)
                chunks = [chunk async for chunk in first.audio()]
                await first.wait()
            run.completed_id = first.response_id
            run.completed_audio = b"".join(chunks)
            run.completed_transcript = first.transcript

            await client.stream_pcm(speech, chunk_ms=200, realtime=False)
            await client.commit()
            async with asyncio.timeout(deadline):
                second = await anext(responses)
                await anext(second.audio())  # the first audio chunk
            await client.cancel_response()
            await second.wait(deadline)
            run.cancelled_id = second.response_id
            run.statuses = (
                first.done_event.raw["response"]["status"],
                second.done_event.raw["response"]["status"],
            )

            ack = asyncio.ensure_future(
                client.wait_for("session.heartbeat_ack", timeout_s=deadline)
            )
            await asyncio.sleep(0)  # subscribed before the heartbeat goes out
            await client.send({"type": "session.heartbeat"})
            await ack
        run.closed_expected = bool(client._closed_marker and client._closed_marker.expected)
    assert any(e["type"] == audio_type for e in run.received())
    return run
