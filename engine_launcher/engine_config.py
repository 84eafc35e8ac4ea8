"""The ``[engine]`` section: which engine to run and how to supervise it.

:class:`EngineConfig` is a frozen value object, each field declared once with
``engine_launcher.setting_schema.setting``. It validates itself in
``__post_init__`` and raises :class:`EngineConfigError` naming the field, which
the proxy's loader turns into a ``ConfigError`` (docs/design.md, Code rules (4)).
The launcher reads this section alone, never the sidecar's ``Settings``
(docs/design.md, Settings).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Final, Literal, get_args
from urllib.parse import urlsplit

from engine_launcher.setting_schema import SECONDS, setting
from proxy.core.engine_releases import RELEASES

__all__ = [
    "DEFAULT_HEALTH_FAILURES",
    "DEFAULT_HEALTH_INTERVAL",
    "DEFAULT_HOST",
    "DEFAULT_MAX_RESTARTS",
    "DEFAULT_RESTART_WINDOW",
    "DEFAULT_STARTUP_TIMEOUT",
    "DEFAULT_STOP_GRACE",
    "DEFAULT_VLLM_OMNI_PORT",
    "ENGINE_KINDS",
    "ENGINE_VERSIONS",
    "MAX_REPLICAS",
    "PROBE_KINDS",
    "EngineConfig",
    "EngineConfigError",
    "EngineKind",
    "ProbeKind",
]

EngineKind = Literal["simulator", "vllm-omni", "command", "external"]
ENGINE_KINDS: Final[tuple[str, ...]] = get_args(EngineKind)
"""Every valid ``kind`` (docs/design.md, Engine supervision)."""
#: The releases of proxy/core/engine_releases.py, oldest first (the one module of the
#: proxy the launcher may import: tests/test_architecture.py, SHARED_LEAVES).
_RELEASES: Final[tuple[str, ...]] = tuple(r.version.value for r in RELEASES)
ENGINE_VERSIONS: Final[tuple[str, ...]] = ("auto", *_RELEASES)
"""Every valid ``version``: ``auto`` and each release (docs/design.md, Engine capabilities)."""

ProbeKind = Literal["auto", "health", "websocket", "tcp"]
PROBE_KINDS: Final[tuple[str, ...]] = get_args(ProbeKind)
"""Every valid ``probe`` (docs/design.md, Engine supervision, Readiness probes)."""

DEFAULT_HOST: Final = "127.0.0.1"
DEFAULT_VLLM_OMNI_PORT: Final = 8091
DEFAULT_STARTUP_TIMEOUT: Final = 1200 * SECONDS
DEFAULT_HEALTH_INTERVAL: Final = 2 * SECONDS
DEFAULT_HEALTH_FAILURES: Final = 3
DEFAULT_MAX_RESTARTS: Final = 5
DEFAULT_RESTART_WINDOW: Final = 600 * SECONDS
DEFAULT_STOP_GRACE: Final = 30 * SECONDS
#: Most engines one sidecar runs: bounds the ``engine`` metric label (0..MAX_REPLICAS-1).
MAX_REPLICAS: Final = 64

_WS_SCHEMES: Final = frozenset({"ws", "wss"})
_HTTP_SCHEMES: Final = frozenset({"http", "https"})


class EngineConfigError(ValueError):
    """An :class:`EngineConfig` field has an invalid value.

    Args:
        field: The field's name, without the ``engine.`` prefix.
        message: What is wrong with it, without the field's name.
        depends_on: For a cross-field rule, the other field that makes this
            one invalid (``kind`` when a kind needs ``model``), else ``None``.
    """

    field: str
    message: str
    depends_on: str | None

    def __init__(self, field: str, message: str, *, depends_on: str | None = None) -> None:
        self.field = field
        self.message = message
        self.depends_on = depends_on
        super().__init__(f"{field}: {message}")


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineConfig:
    """How to start (or find) the engine and how to supervise it.

    Args:
        kind: ``simulator`` (default; ``python -m engine_launcher.simulator``),
            ``vllm-omni`` (``vllm-omni serve MODEL --omni``), ``command`` (run
            :attr:`command` as given) or ``external`` (no child; connect to
            :attr:`upstream`).
        model: The model to serve; required for ``vllm-omni``.
        deploy_config: Path of a deploy-config YAML passed as
            ``--deploy-config`` to ``vllm-omni``.
        host: The address the child listens on and the proxy connects to.
        port: The child's port. ``None`` leaves it to :meth:`effective_port`:
            8091 for ``vllm-omni``, a free port chosen by the launcher for the
            simulator and ``command``.
        extra_args: Extra argv appended to the engine's command line.
        env: Environment overrides for the child, as ``(name, value)`` pairs
            (a tuple keeps the object hashable); see :meth:`env_dict`. A
            mapping or list of pairs is accepted and converted.
        python: The interpreter for ``simulator`` and ``vllm-omni``; ``None``
            means ``sys.executable`` at launch (see :meth:`effective_python`).
        command: The full argv for ``kind = "command"``.
        upstream: The ``ws://``/``wss://`` URL of an existing engine; required
            for ``external``.
        health_url: The URL polled for readiness and health; ``None`` means
            ``http://HOST:PORT/health``.
        probe: How readiness and health are probed: ``health`` (``GET``
            :attr:`health_url` = 200), ``websocket`` (a handshake with
            ``autostart=0``, closed before any session opens), ``tcp`` (the
            port accepts) or ``auto`` (``health``; for ``external`` without
            :attr:`health_url`, a handshake when ``/health`` answers 400, 404,
            405, 426 or not HTTP).
        simulator_args: Extra flags for the simulator.
        startup_timeout: Seconds to wait for the first healthy answer (the real
            engine may take 20 minutes to load).
        health_interval: Seconds between health polls while ready.
        health_failures: Consecutive failed polls that count as a crash.
        max_restarts: Restarts allowed within :attr:`restart_window` before the
            launcher raises ``RestartBudgetExhausted``.
        restart_window: The window, in seconds, in which restarts are counted.
        stop_grace: Seconds between SIGTERM and SIGKILL when stopping the child.
        replicas: Engines behind this sidecar (engine_launcher/pool.py).
        gpus: ``"0,1"`` or ``"auto"``: one engine per GPU, pinned with
            ``CUDA_VISIBLE_DEVICES``; overrides :attr:`replicas`.
        upstreams: For ``external``: one engine per URL; overrides :attr:`replicas`.
        version: The vLLM-Omni behaviour to expect (a release of
            :data:`ENGINE_VERSIONS`); ``auto`` asks preflight, then what
            sessions see.

    Raises:
        EngineConfigError: A field has an invalid value.
    """

    kind: EngineKind = setting(  # noqa: RUF009 - setting() returns a dataclasses.field
        "simulator",
        help='"simulator" (built-in CPU stand-in), "vllm-omni" (vllm-omni serve MODEL '
        '--omni), "command" (run `command` as given) or "external" (`upstream` URL, '
        "no child process).",
        metavar="KIND",
    )
    model: str | None = setting(
        None,
        help='Model to serve; required for "vllm-omni".',
        example='"openbmb/MiniCPM-o-4_5"',
        metavar="MODEL",
    )
    deploy_config: str | None = setting(
        None,
        help="Deploy-config YAML passed as --deploy-config to vllm-omni.",
        example='"minicpmo_4_5.yaml"',
        metavar="PATH",
    )
    host: str = setting(
        DEFAULT_HOST,
        help="Address the child listens on and the proxy connects to.",
        metavar="HOST",
    )
    port: int | None = setting(
        None,
        help="Child's port. Unset: 8091 for vllm-omni, a free port for the simulator and "
        'for "command".',
        minimum=1,
        maximum=65535,
        example="8091",
        metavar="PORT",
    )
    extra_args: tuple[str, ...] = setting(
        (),
        help="Extra argv appended to the engine's command line.",
        example='["--trust-remote-code"]',
        metavar="ARGS",
        argv=True,
    )
    env: tuple[tuple[str, str], ...] = setting(
        (),
        help="Environment overrides for the child (a table of strings; env and flag "
        "form: K=V,K2=V2).",
        example='{CUDA_VISIBLE_DEVICES = "0"}',
        metavar="K=V,...",
    )
    python: str | None = setting(
        None,
        help="Interpreter for the simulator and vllm-omni. Unset: the one running omni-sidecar.",
        example='"/opt/vllm/bin/python"',
        metavar="PATH",
    )
    command: tuple[str, ...] = setting(
        (),
        help='Full argv for kind "command".',
        example='["/opt/engine/bin/serve", "--port", "8091"]',
        metavar="ARGV",
        argv=True,
    )
    upstream: str | None = setting(
        None,
        help='ws:// URL for kind "external" (or set the top-level `upstream`).',
        example='"ws://127.0.0.1:8091"',
        metavar="URL",
    )
    health_url: str | None = setting(
        None,
        help="Readiness and health URL. Unset: http://HOST:PORT/health.",
        example='"http://127.0.0.1:8091/health"',
        metavar="URL",
    )
    probe: ProbeKind = setting(  # noqa: RUF009 - setting() returns a dataclasses.field
        "auto",
        help='Readiness and health probe: "health" (GET health_url = 200), "websocket" (a '
        "handshake on the realtime URL with autostart=0, closed at once, so no engine "
        'session opens), "tcp" (the port accepts a connection) or "auto": "health", and '
        'for "external" without health_url a handshake when /health answers 400, 404, 405, '
        "426 or not HTTP.",
        metavar="PROBE",
    )
    simulator_args: tuple[str, ...] = setting(
        (),
        help="Extra flags for the simulator (python -m engine_launcher.simulator --help).",
        example='["--realtime-factor", "0"]',
        metavar="ARGS",
        argv=True,
    )
    startup_timeout: float = setting(
        DEFAULT_STARTUP_TIMEOUT,
        help="Seconds to wait for the engine's first healthy answer (loading may take 20 min).",
        unit="seconds",
        positive=True,
    )
    health_interval: float = setting(
        DEFAULT_HEALTH_INTERVAL,
        help="Seconds between health polls while ready.",
        unit="seconds",
        positive=True,
    )
    health_failures: int = setting(
        DEFAULT_HEALTH_FAILURES,
        help="Consecutive failed health polls that count as a crash.",
        unit="count",
        minimum=1,
    )
    max_restarts: int = setting(
        DEFAULT_MAX_RESTARTS,
        help="Restarts allowed within restart_window before omni-sidecar exits 1 "
        "(engine failed for good).",
        unit="count",
        minimum=0,
    )
    restart_window: float = setting(
        DEFAULT_RESTART_WINDOW,
        help="The window, in seconds, in which restarts are counted.",
        unit="seconds",
        positive=True,
    )
    stop_grace: float = setting(
        DEFAULT_STOP_GRACE,
        help="Seconds between SIGTERM and SIGKILL when stopping the engine.",
        unit="seconds",
        minimum=0,
    )
    replicas: int = setting(
        1,
        help="Engines run behind this sidecar, each its own supervised child with its own "
        "port, health checks, backoff and restart budget (docs/design.md, Engine pool). "
        "engine.gpus or engine.upstreams, when set, decide the count instead.",
        unit="count",
        minimum=1,
        maximum=MAX_REPLICAS,
    )
    gpus: str | None = setting(
        None,
        help='GPUs, one engine each, as CUDA_VISIBLE_DEVICES of its child: "0,1,2,3", or '
        '"auto" = every visible GPU (CUDA_VISIBLE_DEVICES, else nvidia-smi -L; none: one '
        "engine). Unset: engine.replicas engines with the inherited environment.",
        example='"auto"',
        metavar="IDS",
    )
    upstreams: tuple[str, ...] = setting(
        (),
        help='ws:// URLs for kind "external", one replica each (instead of `upstream`).',
        example='["ws://10.0.0.5:8091", "ws://10.0.0.6:8091"]',
        metavar="URLS",
    )
    version: str = setting(
        "auto",
        help="vLLM-Omni behaviour to expect: "
        + "".join(f'"{release}", ' for release in _RELEASES)
        + 'or "auto": the '
        "vllm-omni package in the engine's interpreter (preflight; for the simulator its "
        "--engine-version), else "
        f"what sessions see on the wire, else {_RELEASES[0]}'s "
        "(docs/design.md, Engine capabilities). "
        "Shown in /debug/summary and omni_sidecar_engine_info.",
        metavar="VERSION",
        choices=ENGINE_VERSIONS,
    )

    def __post_init__(self) -> None:
        if self.kind not in ENGINE_KINDS:
            raise EngineConfigError(
                "kind", f"unknown engine kind {self.kind!r}; expected one of {_or(ENGINE_KINDS)}"
            )
        if self.version not in ENGINE_VERSIONS:
            raise EngineConfigError(
                "version",
                f"unknown engine version {self.version!r}; expected one of {_or(ENGINE_VERSIONS)}",
            )
        for name in ("model", "deploy_config", "python"):
            _check_optional_text(name, getattr(self, name))
        if not isinstance(self.host, str) or not self.host.strip():
            raise EngineConfigError("host", f"expected a non-empty host, got {self.host!r}")
        if self.port is not None and (
            not isinstance(self.port, int)
            or isinstance(self.port, bool)
            or not 1 <= self.port <= 65535
        ):
            raise EngineConfigError("port", f"expected a port in 1..65535, got {self.port!r}")
        for name in ("extra_args", "command", "simulator_args"):
            object.__setattr__(self, name, _str_tuple(name, getattr(self, name)))
        object.__setattr__(self, "env", _env_pairs(self.env))
        if self.upstream is not None:
            _check_url("upstream", self.upstream, _WS_SCHEMES)
        if self.health_url is not None:
            _check_url("health_url", self.health_url, _HTTP_SCHEMES)
        if self.probe not in PROBE_KINDS:
            raise EngineConfigError(
                "probe", f"unknown probe {self.probe!r}; expected one of {_or(PROBE_KINDS)}"
            )
        if self.health_url is not None and self.probe in ("websocket", "tcp"):
            raise EngineConfigError(
                "health_url", f"unused by probe {self.probe!r}", depends_on="probe"
            )
        for name in ("startup_timeout", "health_interval", "restart_window"):
            object.__setattr__(self, name, _float(name, getattr(self, name), positive=True))
        object.__setattr__(self, "stop_grace", _float("stop_grace", self.stop_grace))
        _check_int("health_failures", self.health_failures, minimum=1)
        _check_int("max_restarts", self.max_restarts, minimum=0)
        _check_int("replicas", self.replicas, minimum=1)
        if self.replicas > MAX_REPLICAS:
            raise EngineConfigError("replicas", f"must be <= {MAX_REPLICAS}, got {self.replicas}")
        _check_optional_text("gpus", self.gpus)
        if self.gpus is not None and self.gpus.strip() != "auto":
            ids = [part.strip() for part in self.gpus.split(",")]
            if not all(ids) or len(ids) > MAX_REPLICAS or len(set(ids)) != len(ids):
                raise EngineConfigError(
                    "gpus",
                    f'expected "auto" or up to {MAX_REPLICAS} distinct comma-separated GPU ids, '
                    f"got {self.gpus!r}",
                )
        object.__setattr__(self, "upstreams", _str_tuple("upstreams", self.upstreams))
        if len(self.upstreams) > MAX_REPLICAS:
            raise EngineConfigError("upstreams", f"at most {MAX_REPLICAS} URLs")
        for url in self.upstreams:
            _check_url("upstreams", url, _WS_SCHEMES)
        if self.upstreams and self.kind != "external":
            raise EngineConfigError(
                "upstreams", 'only for engine kind "external"', depends_on="kind"
            )

        # Cross-field rules: each kind needs the field that says what to run.
        required = {"vllm-omni": "model", "command": "command", "external": "upstream"}
        needed = required.get(self.kind)
        if needed == "upstream" and self.upstreams:
            needed = None  # a list of upstreams stands for the one
        if needed is not None and not getattr(self, needed):
            raise EngineConfigError(
                needed, f"required when engine kind is {self.kind!r}", depends_on="kind"
            )

    def effective_port(self) -> int | None:
        """Return the port the child should listen on, if it is fixed.

        Returns:
            :attr:`port` when set; 8091 for ``vllm-omni``; for ``external``
            the port of :attr:`upstream` (its scheme's default if it names
            none); otherwise ``None``, which tells the launcher to pick a free
            loopback port and pass it to the child.
        """
        if self.port is not None:
            return self.port
        if self.kind == "vllm-omni":
            return DEFAULT_VLLM_OMNI_PORT
        if self.kind == "external" and self.upstream is not None:
            parts = urlsplit(self.upstream)
            return parts.port or (443 if parts.scheme == "wss" else 80)
        return None

    def effective_python(self) -> str:
        """Return :attr:`python`, or the running interpreter when it is ``None``."""
        return self.python if self.python is not None else sys.executable

    def env_dict(self) -> dict[str, str]:
        """Return :attr:`env` as a new ``dict`` (later pairs win; there are no duplicates)."""
        return dict(self.env)


def _or(values: Iterable[str]) -> str:
    return ", ".join(repr(v) for v in values)


def _check_optional_text(name: str, value: object) -> None:
    if value is not None and (not isinstance(value, str) or not value.strip()):
        raise EngineConfigError(name, f"expected a non-empty string or nothing, got {value!r}")


def _check_int(name: str, value: object, *, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise EngineConfigError(name, f"expected an integer, got {value!r}")
    if value < minimum:
        raise EngineConfigError(name, f"must be >= {minimum}, got {value}")


def _float(name: str, value: object, *, positive: bool = False) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise EngineConfigError(name, f"expected a number of seconds, got {value!r}")
    try:
        result = float(value)
    except OverflowError:
        result = math.inf
    if not math.isfinite(result):
        raise EngineConfigError(name, f"must be finite, got {value!r}")
    if positive and result <= 0:
        raise EngineConfigError(name, f"must be > 0 seconds, got {value!r}")
    if result < 0:
        raise EngineConfigError(name, f"must be >= 0 seconds, got {value!r}")
    return result


def _str_tuple(name: str, value: object) -> tuple[str, ...]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise EngineConfigError(name, f"expected a sequence of strings, got {value!r}")
    items = tuple(value)
    for item in items:
        if not isinstance(item, str):
            raise EngineConfigError(name, f"expected a sequence of strings, got item {item!r}")
    return items


def _env_pairs(value: object) -> tuple[tuple[str, str], ...]:
    pairs: list[tuple[object, object]] = []
    if isinstance(value, Mapping):
        pairs.extend(value.items())
    elif isinstance(value, Iterable) and not isinstance(value, (str, bytes)):
        for item in value:
            if not isinstance(item, (tuple, list)) or len(item) != 2:
                raise EngineConfigError("env", f"expected (name, value) pairs, got {item!r}")
            pairs.append((item[0], item[1]))
    else:
        raise EngineConfigError("env", f"expected (name, value) pairs, got {value!r}")
    seen: set[str] = set()
    result: list[tuple[str, str]] = []
    for key, val in pairs:
        if not isinstance(key, str) or not key or "=" in key or "\0" in key:
            raise EngineConfigError("env", f"invalid environment variable name {key!r}")
        if not isinstance(val, str) or "\0" in val:
            raise EngineConfigError("env", f"value of {key} must be a string, got {val!r}")
        if key in seen:
            raise EngineConfigError("env", f"duplicate environment variable {key}")
        seen.add(key)
        result.append((key, val))
    return tuple(result)


def _check_url(name: str, value: object, schemes: frozenset[str]) -> None:
    expected = " or ".join(f"{s}://" for s in sorted(schemes))
    if not isinstance(value, str):
        raise EngineConfigError(name, f"expected a {expected} URL, got {value!r}")
    try:
        parts = urlsplit(value)
        parts.port  # noqa: B018 - raises ValueError on a bad port
    except ValueError as exc:
        raise EngineConfigError(name, f"invalid URL {value!r}: {exc}") from None
    if parts.scheme not in schemes or not parts.hostname:
        raise EngineConfigError(name, f"expected a {expected} URL with a host, got {value!r}")
