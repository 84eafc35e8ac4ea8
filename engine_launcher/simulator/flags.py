"""Command-line configuration of the engine simulator.

The simulator is started by the launcher (or by tests) exactly like the real
engine: as a child process with flags. Everything it needs is parsed here into
one frozen value object, so the rest of the package never touches ``argv``.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final, Literal

from engine_launcher.simulator.delivery import DEFAULT_OUTPUT_LIMITS, OutputLimits
from engine_launcher.simulator.playback_history import COMMIT_ALL_ON_DONE, PLAYBACK_COMMIT_POLICIES
from engine_launcher.simulator.releases import ENGINE_VERSIONS, EngineRelease, release_of
from engine_launcher.simulator.replay_journal import DEFAULT_JOURNAL_LIMITS, JournalLimits

__all__ = [
    "AUDIO_PROFILES",
    "DEFAULT_CHUNK_MS",
    "DEFAULT_HOST",
    "DEFAULT_MODEL",
    "DEFAULT_PORT",
    "ENGINE_VERSIONS",
    "SESSION_MODES",
    "EventNaming",
    "SimulatorConfig",
    "build_parser",
    "parse_args",
]

EventNaming = Literal["ga", "beta"]

#: ``--audio-profile``: the audio formats of a model family (docs/engine-protocol.md, Models).
#: minicpmo: output PCM16 24 kHz, input PCM16 16 kHz; nemotron: output PCM16 22.05 kHz
#: in 80 ms packets, input ``pcm_f32le`` 16 kHz. ``--sample-rate``/``--chunk-ms`` given
#: explicitly win over the profile's.
AUDIO_PROFILES: Final[dict[str, dict[str, int | str]]] = {
    "minicpmo": {"sample_rate": 24000, "chunk_ms": 1000, "input_format": "pcm16"},
    "nemotron": {"sample_rate": 22050, "chunk_ms": 80, "input_format": "pcm_f32le"},
}
#: ``--session-mode``: ``duplex`` (a model served with ``session_mode: duplex``) or
#: ``realtime`` (the plain OpenAI-style /v1/realtime handler of 0.31 and later).
SESSION_MODES: Final = ("duplex", "realtime")

DEFAULT_HOST: Final = "127.0.0.1"
DEFAULT_PORT: Final = 8091
DEFAULT_MODEL: Final = "omni-sim"
DEFAULT_CHUNK_MS: Final = 1000
DEFAULT_SAMPLE_RATE: Final = 24000
DEFAULT_REALTIME_FACTOR: Final = 1.0
DEFAULT_RESPONSE_SECONDS: Final = 4.0
DEFAULT_LATE_AUDIO_CHUNKS: Final = 3
DEFAULT_GENERATION_SPEED: Final = 1.0
#: vLLM-Omni's ``duplex_session.disconnect_grace_s`` and ``reaper_interval_s``.
DEFAULT_DISCONNECT_GRACE: Final = 30.0
DEFAULT_REAPER_INTERVAL: Final = 5.0


@dataclass(frozen=True, slots=True, kw_only=True)
class SimulatorConfig:
    """Everything one simulator process needs to know.

    Durations are float seconds; ``None`` disables a fault knob.
    """

    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    model: str = DEFAULT_MODEL
    chunk_ms: int = DEFAULT_CHUNK_MS
    sample_rate: int = DEFAULT_SAMPLE_RATE
    realtime_factor: float = DEFAULT_REALTIME_FACTOR
    response_seconds: float = DEFAULT_RESPONSE_SECONDS
    late_audio_chunks: int = DEFAULT_LATE_AUDIO_CHUNKS
    audio_path: str | None = None
    event_names: EventNaming = "ga"
    deterministic: bool = False
    listen_events: bool = False
    startup_delay: float = 0.0
    crash_after: float | None = None
    health_fail_after: float | None = None
    health_hang_after: float | None = None
    ignore_sigterm: bool = False
    stall_after: float | None = None
    playback_commit_policy: str = COMMIT_ALL_ON_DONE
    supports_audio_truncate: bool = False
    generation_speed: float = DEFAULT_GENERATION_SPEED
    engine_version: str = ENGINE_VERSIONS[0]
    max_pending_output_bytes: int | None = None
    max_pending_output_events: int | None = None
    output_reserve_bytes: int | None = None
    output_reserve_events: int | None = None
    max_sessions: int | None = None
    session_mode: str = "duplex"
    #: The default input format of a session (the profile's), at 16 kHz.
    input_format: str = "pcm16"
    session_resume: bool = True
    disconnect_grace: float = DEFAULT_DISCONNECT_GRACE
    reaper_interval: float = DEFAULT_REAPER_INTERVAL
    replay_ttl: float = DEFAULT_JOURNAL_LIMITS.ttl_s
    replay_max_bytes: int = DEFAULT_JOURNAL_LIMITS.max_bytes

    def __post_init__(self) -> None:
        # Validate here so a bad value fails at start-up with a message that
        # names the flag, not later inside a session task.
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be in 0..65535, got {self.port}")
        if self.chunk_ms <= 0:
            raise ValueError(f"--chunk-ms must be positive, got {self.chunk_ms}")
        if self.sample_rate < 8000 or self.sample_rate > 192000:
            raise ValueError(f"--sample-rate must be in 8000..192000, got {self.sample_rate}")
        if self.realtime_factor < 0 or not math.isfinite(self.realtime_factor):
            raise ValueError(f"--realtime-factor must be >= 0, got {self.realtime_factor}")
        if self.response_seconds <= 0 or not math.isfinite(self.response_seconds):
            raise ValueError(f"--response-seconds must be positive, got {self.response_seconds}")
        if self.late_audio_chunks < 0:
            raise ValueError(f"--late-audio-chunks must be >= 0, got {self.late_audio_chunks}")
        if self.generation_speed <= 0 or not math.isfinite(self.generation_speed):
            raise ValueError(f"--generation-speed must be > 0, got {self.generation_speed}")
        if self.playback_commit_policy not in PLAYBACK_COMMIT_POLICIES:
            raise ValueError(
                "--playback-commit-policy must be one of "
                f"{', '.join(PLAYBACK_COMMIT_POLICIES)}, got {self.playback_commit_policy!r}"
            )
        if self.event_names not in ("ga", "beta"):
            raise ValueError(f"--event-names must be ga or beta, got {self.event_names!r}")
        if self.engine_version not in ENGINE_VERSIONS:
            raise ValueError(
                f"--engine-version must be one of {', '.join(ENGINE_VERSIONS)}, "
                f"got {self.engine_version!r}"
            )
        if self.session_mode not in SESSION_MODES:
            raise ValueError(
                f"--session-mode must be duplex or realtime, got {self.session_mode!r}"
            )
        if self.session_mode == "realtime" and not self.release.openai_realtime_handler:
            raise ValueError(
                f"--session-mode realtime needs --engine-version {_first('openai_realtime_handler')}"
                " or later"
            )
        if self.max_sessions is not None and self.max_sessions <= 0:
            raise ValueError(f"--max-sessions must be positive, got {self.max_sessions}")
        bounds = {
            "max_pending_output_bytes": self.max_pending_output_bytes,
            "max_pending_output_events": self.max_pending_output_events,
            "output_reserve_bytes": self.output_reserve_bytes,
            "output_reserve_events": self.output_reserve_events,
        }
        for name, value in bounds.items():
            flag = "--" + name.replace("_", "-")
            if value is None:
                continue
            if not self.release.bounded_output:
                # A release without an output bound: a bound there would be a lie.
                raise ValueError(
                    f"{flag} needs --engine-version {_first('bounded_output')} or later"
                )
            if value <= 0:
                raise ValueError(f"{flag} must be positive, got {value}")
        for name in ("reaper_interval", "replay_ttl"):
            value = getattr(self, name)
            if not value > 0 or not math.isfinite(value):
                raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {value}")
        if self.replay_max_bytes <= 0:
            raise ValueError(f"--replay-max-bytes must be positive, got {self.replay_max_bytes}")
        names = (
            "startup_delay",
            "crash_after",
            "health_fail_after",
            "health_hang_after",
            "stall_after",
            "disconnect_grace",
        )
        for name in names:
            value = getattr(self, name)
            if value is not None and (value < 0 or not math.isfinite(value)):
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {value}")

    @property
    def release(self) -> EngineRelease:
        """What ``--engine-version`` does (engine_launcher/simulator/releases.py)."""
        return release_of(self.engine_version)

    @property
    def output_limits(self) -> OutputLimits | None:
        """Bounds of each session's queued output: ``None`` (unbounded) on 0.30.

        0.31 and later always bound it (``bounded_output``); unset flags take
        the engine's defaults.
        """
        if not self.release.bounded_output:
            return None
        d = DEFAULT_OUTPUT_LIMITS
        return OutputLimits(
            max_bytes=self.max_pending_output_bytes or d.max_bytes,
            max_events=self.max_pending_output_events or d.max_events,
            reserve_bytes=self.output_reserve_bytes or d.reserve_bytes,
            reserve_events=self.output_reserve_events or d.reserve_events,
        )

    @property
    def journal_limits(self) -> JournalLimits:
        """Bounds of each session's replay journal (``--replay-max-bytes``, ``--replay-ttl``)."""
        return JournalLimits(max_bytes=self.replay_max_bytes, ttl_s=self.replay_ttl)

    @property
    def resumable(self) -> bool:
        """Sessions advertise ``supports_session_resume``: a dropped socket only detaches.

        The plain realtime handler (``--session-mode realtime``) never resumes.
        """
        return self.session_resume and self.session_mode == "duplex"

    @property
    def late_audio(self) -> int:
        """Audio deltas of a cancelled response still sent after the cancel.

        ``--late-audio-chunks`` on 0.30; 0.31 and later (``drops_cancelled_audio``)
        produce none and remove what was queued.
        """
        return 0 if self.release.drops_cancelled_audio else self.late_audio_chunks

    @property
    def chunks_per_response(self) -> int:
        """Number of audio deltas in one uninterrupted response."""
        return max(1, math.ceil(self.response_seconds * 1000 / self.chunk_ms))

    @property
    def chunk_interval(self) -> float:
        """Seconds between two produced chunks (0 means as fast as possible).

        ``chunk_ms * realtime_factor / generation_speed``: with
        ``--generation-speed 4`` a 2 s reply is on the wire after 0.5 s, the way
        a GPU engine outruns playback.
        """
        return self.chunk_ms * self.realtime_factor / self.generation_speed / 1000

    @property
    def listen_interval(self) -> float:
        """Period of ``response.listen`` while idle (``--listen-events``).

        One chunk period of wall time; with ``--realtime-factor 0`` it stays at
        the nominal chunk length so an idle session does not flood the client.
        """
        interval = self.chunk_interval
        return interval if interval > 0 else self.chunk_ms / 1000


def _first(capability: str) -> str:
    """The oldest ``--engine-version`` with ``capability``."""
    return next(v for v in ENGINE_VERSIONS if getattr(release_of(v), capability))


def _non_negative_float(text: str) -> float:
    value = float(text)
    if value < 0 or not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """Return the argument parser of ``python -m engine_launcher.simulator``."""
    parser = argparse.ArgumentParser(
        prog="python -m engine_launcher.simulator",
        description=(
            "CPU stand-in for `vllm-omni serve MODEL --omni`: speaks the vLLM-Omni "
            "duplex realtime protocol with generated PCM16 audio, as "
            f"{', '.join(ENGINE_VERSIONS[:-1])} or {ENGINE_VERSIONS[-1]} behaves "
            "(--engine-version)."
        ),
    )
    parser.add_argument("--host", default=DEFAULT_HOST, help="bind address (default %(default)s)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="port (default %(default)s)")
    parser.add_argument("--model", default=DEFAULT_MODEL, help="model name (default %(default)s)")
    parser.add_argument(
        "--chunk-ms",
        type=int,
        default=None,
        help=f"audio length of one output delta in ms (default {DEFAULT_CHUNK_MS}, "
        "or the --audio-profile's)",
    )
    parser.add_argument(
        "--sample-rate",
        type=int,
        default=None,
        help=f"output PCM16 mono rate in Hz (default {DEFAULT_SAMPLE_RATE}, "
        "or the --audio-profile's)",
    )
    parser.add_argument(
        "--audio-profile",
        choices=tuple(AUDIO_PROFILES),
        default=None,
        help="audio formats of a model family: minicpmo (out PCM16 24 kHz, in PCM16 "
        "16 kHz) or nemotron (out PCM16 22.05 kHz in 80 ms packets, in pcm_f32le "
        "16 kHz); the default is minicpmo's formats with 1000 ms chunks",
    )
    parser.add_argument(
        "--realtime-factor",
        type=_non_negative_float,
        default=DEFAULT_REALTIME_FACTOR,
        help="pace: chunk_ms*factor/1000 s between chunks; 0 = as fast as possible",
    )
    parser.add_argument(
        "--response-seconds",
        type=float,
        default=DEFAULT_RESPONSE_SECONDS,
        help="audio length of each response (default %(default)s)",
    )
    parser.add_argument(
        "--late-audio-chunks",
        type=int,
        default=DEFAULT_LATE_AUDIO_CHUNKS,
        help="0.30: audio deltas of a cancelled response still sent after the cancel "
        "(the released engine's flaw; default %(default)s); 0.31+ send none",
    )
    parser.add_argument("--audio", dest="audio_path", help="WAV file (PCM16) used as the voice")
    parser.add_argument(
        "--event-names",
        choices=("ga", "beta"),
        default="ga",
        help="ga = 0.30 response.output_audio.*; beta = 0.28 response.audio.*",
    )
    parser.add_argument(
        "--deterministic",
        action="store_true",
        help="ids come from per-session counters (byte-identical sessions)",
    )
    parser.add_argument(
        "--listen-events",
        action="store_true",
        help="send response.listen once per chunk period while idle",
    )
    parser.add_argument(
        "--generation-speed",
        type=float,
        default=DEFAULT_GENERATION_SPEED,
        metavar="X",
        help="produce audio X times faster than real time: one chunk every chunk_ms/X "
        "(times --realtime-factor); 4 sends a 2 s reply in 0.5 s (default %(default)s)",
    )
    version = parser.add_argument_group("engine version")
    version.add_argument(
        "--engine-version",
        choices=ENGINE_VERSIONS,
        default=ENGINE_VERSIONS[0],
        help="behave like this vLLM-Omni release (default %(default)s). "
        "0.30: output queued without bound, --late-audio-chunks of a cancelled response "
        "still sent (and journaled for a resume). "
        "0.31: output bounded per session (the four bounds below, always on): overflow "
        "sends error{rate_limit_error, output_backpressure}, a failed response.done "
        "{output_backpressure}, session.closed{output_backpressure} and closes 1000; "
        "a cancel removes its queued audio before it is numbered (no late audio, no seq "
        "gap, nothing of it journaled); a playback.ack's truncate flag is ignored. "
        "0.32: as 0.31, plus truncate: true on playback.ack cuts history at committed_ms; "
        "a truncating ack or conversation.item.truncate naming no item that produced "
        "audio is bad_event; ack errors carry no event_id; playback_ack_too_late is not "
        "raised for replies without text; the capacity error carries retryable: true",
    )
    version.add_argument(
        "--max-pending-output-bytes",
        type=int,
        metavar="N",
        help="0.31+: bytes of queued output per session, base64 audio plus JSON "
        f"(default {DEFAULT_OUTPUT_LIMITS.max_bytes})",
    )
    version.add_argument(
        "--max-pending-output-events",
        type=int,
        metavar="N",
        help=f"0.31+: queued events per session (default {DEFAULT_OUTPUT_LIMITS.max_events})",
    )
    version.add_argument(
        "--output-reserve-bytes",
        type=int,
        metavar="N",
        help="0.31+: extra bytes only error and response.done may use "
        f"(default {DEFAULT_OUTPUT_LIMITS.reserve_bytes})",
    )
    version.add_argument(
        "--output-reserve-events",
        type=int,
        metavar="N",
        help="0.31+: extra events only error and response.done may use "
        f"(default {DEFAULT_OUTPUT_LIMITS.reserve_events})",
    )
    version.add_argument(
        "--max-sessions",
        type=int,
        metavar="N",
        help="duplex_session.max_sessions: a session opened beyond N open ones (those "
        "detached within their --disconnect-grace included) gets "
        "error{rate_limit_error, resource_exhausted, 'duplex_session_capacity_exhausted: "
        "limit=N'} (0.32: retryable: true) and close 1000 (default: no limit)",
    )
    version.add_argument(
        "--session-mode",
        choices=SESSION_MODES,
        default="duplex",
        help="duplex (default): the duplex session handler. realtime (0.31+): a model "
        "served without session_mode duplex: /v1/realtime opens at once, events carry no "
        "server_event_seq, and playback.ack, barge_in, turn.signal, input.cancel, "
        "session.resume, output_audio_buffer.clear (and the other duplex-only events) are "
        "answered with error invalid_event",
    )
    resume = parser.add_argument_group(
        "resume (docs/engine-protocol.md, Resume; the engine's duplex_session settings)"
    )
    resume.add_argument(
        "--no-session-resume",
        dest="session_resume",
        action="store_false",
        help="advertise supports_session_resume false: no resume_token in session.created, "
        "a dropped socket ends its session at once (as session.close would), and "
        "session.resume is answered unsupported_session_resume. Default: resume on",
    )
    resume.add_argument(
        "--disconnect-grace",
        type=_non_negative_float,
        default=DEFAULT_DISCONNECT_GRACE,
        metavar="S",
        help="disconnect_grace_s: a session whose socket dropped without session.close is "
        "detached: it keeps its slot (--max-sessions), keeps producing into its journal and "
        "can be resumed for S seconds, then expires (default %(default)s)",
    )
    resume.add_argument(
        "--reaper-interval",
        type=float,
        default=DEFAULT_REAPER_INTERVAL,
        metavar="S",
        help="reaper_interval_s: how often detached sessions past their grace are expired, "
        "freeing their slot (default %(default)s)",
    )
    resume.add_argument(
        "--replay-ttl",
        type=float,
        default=DEFAULT_JOURNAL_LIMITS.ttl_s,
        metavar="S",
        help="resume_replay_ttl_s: seconds a numbered frame stays in the session's replay "
        "journal unacknowledged; a resume from before a dropped frame gets "
        "session.resync_required{journal_gap} (default %(default)s)",
    )
    resume.add_argument(
        "--replay-max-bytes",
        type=int,
        default=DEFAULT_JOURNAL_LIMITS.max_bytes,
        metavar="N",
        help="resume_replay_max_bytes_per_session: bytes of frame JSON the journal holds; "
        "past it the session sends session.resync_required{journal_overflow} once and then "
        "numbers and journals nothing more (default %(default)s)",
    )
    playback = parser.add_argument_group("playback ledger and history")
    playback.add_argument(
        "--playback-commit-policy",
        choices=PLAYBACK_COMMIT_POLICIES,
        default=COMMIT_ALL_ON_DONE,
        help="default of each session (session.update playback_commit_policy overrides it): "
        "commit_all_on_done = a completed reply enters history whole unless acks say less; "
        "ack_only = history gets only what playback.ack committed, and response.create is "
        "refused (response_already_active) while sent audio is unacknowledged "
        "(default %(default)s)",
    )
    playback.add_argument(
        "--supports-audio-truncate",
        action="store_true",
        help="advertise capabilities.supports_audio_truncate and answer "
        "conversation.item.truncate with conversation.item.truncated (history cut at "
        "audio_end_ms); without it the event is an error",
    )
    fault = parser.add_argument_group("fault knobs")
    fault.add_argument(
        "--startup-delay",
        type=_non_negative_float,
        default=0.0,
        metavar="S",
        help="sleep S seconds before binding the port (a model load)",
    )
    fault.add_argument(
        "--crash-after",
        type=_non_negative_float,
        metavar="S",
        help="exit abruptly (os._exit(1)) S seconds after listening",
    )
    fault.add_argument(
        "--health-fail-after",
        type=_non_negative_float,
        metavar="S",
        help='GET /health answers 503 {"status":"unhealthy"} after S seconds',
    )
    fault.add_argument(
        "--health-hang-after",
        type=_non_negative_float,
        metavar="S",
        help="after S seconds GET /health never answers (a health route too slow under "
        "load); sessions go on streaming",
    )
    fault.add_argument(
        "--ignore-sigterm",
        action="store_true",
        help="ignore SIGTERM (only SIGKILL or SIGINT stops it)",
    )
    fault.add_argument(
        "--stall-after",
        type=_non_negative_float,
        metavar="S",
        help="after S seconds stop reading and sending on every socket (kept open)",
    )
    return parser


def parse_args(argv: Sequence[str] | None = None) -> SimulatorConfig:
    """Parse ``argv`` into a :class:`SimulatorConfig`.

    Raises:
        SystemExit: on invalid flags (argparse prints the reason, exit code 2).
    """
    parser = build_parser()
    ns = parser.parse_args(argv)
    profile = AUDIO_PROFILES.get(ns.audio_profile or "", {})
    if ns.chunk_ms is None:
        ns.chunk_ms = profile.get("chunk_ms", DEFAULT_CHUNK_MS)
    if ns.sample_rate is None:
        ns.sample_rate = profile.get("sample_rate", DEFAULT_SAMPLE_RATE)
    input_format = str(profile.get("input_format", "pcm16"))
    try:
        return SimulatorConfig(
            host=ns.host,
            port=ns.port,
            model=ns.model,
            chunk_ms=ns.chunk_ms,
            sample_rate=ns.sample_rate,
            realtime_factor=ns.realtime_factor,
            response_seconds=ns.response_seconds,
            late_audio_chunks=ns.late_audio_chunks,
            audio_path=ns.audio_path,
            event_names=ns.event_names,
            deterministic=ns.deterministic,
            listen_events=ns.listen_events,
            startup_delay=ns.startup_delay,
            crash_after=ns.crash_after,
            health_fail_after=ns.health_fail_after,
            health_hang_after=ns.health_hang_after,
            ignore_sigterm=ns.ignore_sigterm,
            stall_after=ns.stall_after,
            playback_commit_policy=ns.playback_commit_policy,
            supports_audio_truncate=ns.supports_audio_truncate,
            generation_speed=ns.generation_speed,
            engine_version=ns.engine_version,
            max_pending_output_bytes=ns.max_pending_output_bytes,
            max_pending_output_events=ns.max_pending_output_events,
            output_reserve_bytes=ns.output_reserve_bytes,
            output_reserve_events=ns.output_reserve_events,
            max_sessions=ns.max_sessions,
            session_mode=ns.session_mode,
            input_format=input_format,
            session_resume=ns.session_resume,
            disconnect_grace=ns.disconnect_grace,
            reaper_interval=ns.reaper_interval,
            replay_ttl=ns.replay_ttl,
            replay_max_bytes=ns.replay_max_bytes,
        )
    except ValueError as exc:
        parser.error(str(exc))
