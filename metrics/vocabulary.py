"""The metrics' vocabulary: every label value and histogram bucket, as our own enums.

Label values come only from these tuples, never from the wire (docs/design.md,
Metrics); ``metrics.definitions`` declares the families over them and starts
every known combination at 0.
"""

from __future__ import annotations

from typing import Final

from proxy.core.engine_releases import EngineVersion

__all__ = [
    "ACK_ERROR_CODES",
    "AUDIO_LEAD_BUCKETS",
    "CANCEL_TO_SILENCE_BUCKETS",
    "CAPABILITY_SOURCES",
    "CLEAR_SOURCES",
    "CLIENT_PROTOCOL_VIOLATIONS",
    "CONFIG_RELOAD_RESULTS",
    "CONNECTION_REJECT_REASONS",
    "CONNECT_BUCKETS",
    "CORE_BUILDS",
    "DIRECTIONS",
    "DRAIN_OUTCOMES",
    "DROP_REASONS",
    "ENGINE_FULL_KINDS",
    "ENGINE_REPLICAS",
    "ENGINE_RESTART_REASONS",
    "ENGINE_STATES",
    "ENGINE_VERSIONS",
    "EVENT_KINDS",
    "FIRST_AUDIO_BUCKETS",
    "FRONT_DOORS",
    "LINGER_OUTCOMES",
    "OVERFLOW_POLICIES",
    "PREFIX",
    "QUEUE_DELAY_BUCKETS",
    "QUOTA_KINDS",
    "REJECT_REASONS",
    "RESUME_RESULTS",
    "SESSION_OUTCOMES",
    "STANDARD_PREFIXES",
    "TRUNCATION_SOURCES",
    "UNNAMED_KEY",
    "USAGE_DIRECTIONS",
    "USAGE_RESPONSE_OUTCOMES",
    "USAGE_TOKEN_KINDS",
]

PREFIX: Final = "omni_sidecar"
#: Families from prometheus_client's standard collectors (process RSS, CPU
#: seconds, open fds, start time; Python GC; python_info). They keep their
#: conventional names, so every dashboard and alert that knows them works:
#: the one exception to the ``omni_sidecar_`` prefix.
STANDARD_PREFIXES: Final = ("process_", "python_")

DIRECTIONS: Final = ("client_to_upstream", "upstream_to_client")
#: Coarse event kinds for events_total (audio vs control; invalid frames).
EVENT_KINDS: Final = ("audio", "control", "error", "invalid")
DROP_REASONS: Final = (
    "cancelled_audio",
    "late_audio",
    "overflow",
    "failed_response",
    "invalid_client_frame",
    "invalid_upstream_frame",
    # Beyond the original six (see docs/design.md, Metrics):
    # client audio appends over max_input_audio_rate,
    "input_backpressure",
    # engine output that arrived after the session began closing, or was still
    # queued when the client went away.
    "session_closed",
    # client frames over max_client_frame_rate.
    "client_rate_limited",
    # the engine's answers to the sidecar's own playback acks and truncations
    # (docs/design.md, Playback): never the client's to see.
    "playback_answer",
)
SESSION_OUTCOMES: Final = (
    "client_closed",
    "upstream_closed",
    "overflow",
    "engine_unavailable",
    "shutdown",
    "error",
    "rate_limited",
    # left the engine at a drain without session.close, its client told to resume
    # elsewhere with close 1012 (docs/design.md, Start-up and shutdown).
    "handed_over",
)
#: drain_sessions_total's ``outcome``: how each session live at a SIGTERM ended:
#: handed over to another sidecar (close 1012, the engine keeps it), ended by
#: itself before ``drain_timeout`` (drained), or ended by the sidecar (cut: the
#: deadline passed, or a second signal).
DRAIN_OUTCOMES: Final = ("handed_over", "drained", "cut")
REJECT_REASONS: Final = (
    "unauthorized",
    "forbidden_origin",
    "capacity",
    "not_ready",
    "draining",
    "upstream_unavailable",
    # the engine said it is full (resource_exhausted at open), or did so within
    # engine_full_backoff (docs/design.md, Engine capabilities).
    "engine_capacity",
    # the key's quota (docs/design.md, Quotas); quota_rejections_total says which.
    "quota_exceeded",
    # a phone call whose X-Twilio-Signature does not verify (docs/design.md, Phone front door).
    "bad_signature",
)
#: Connections or HTTP requests refused at the client listener's edge, before
#: any session exists (docs/security.md): proxy/edge/guard.py, proxy/edge/handshake.py,
#: proxy/edge/reverse_proxy.py, proxy/edge/listener.py.
CONNECTION_REJECT_REASONS: Final = (
    "head_too_large",
    "head_timeout",
    "pending_handshakes",
    "bad_handshake",
    "body_too_large",
    "untrusted_proxy_header",
    "bad_proxy_header",
    "bad_request_head",
    # closed at accept: the process had no file descriptor for it (proxy/edge/listener.py).
    "fd_limit",
)
#: Upgraded client connections failed with close 1002 for a WebSocket protocol
#: violation the sidecar itself checks (proxy.compat.install_mask_check): a frame
#: without the mask bit (RFC 6455 §5.1).
CLIENT_PROTOCOL_VIOLATIONS: Final = ("unmasked_frame",)
#: How a lingering close after an error answer ended (proxy/edge/guard.py): the
#: client closed its side, nothing arrived for lingering_timeout, lingering_time
#: passed after max_lingering_bytes were discarded (reading stopped), no room under
#: max_pending_handshakes (closed at once), the client reset, the sidecar shut down.
LINGER_OUTCOMES: Final = (
    "client_closed",
    "quiet",
    "time_limit",
    "byte_limit",
    "no_room",
    "reset",
    "shutdown",
)
OVERFLOW_POLICIES: Final = ("close_session", "fail_response", "process_total")
#: build_info's ``core``: the compiled build (mypyc, at install) or pure Python.
CORE_BUILDS: Final = ("mypyc", "python")
ENGINE_STATES: Final = (
    "starting",
    "ready",
    "unhealthy",
    "degraded",
    "restarting",
    "stopping",
    "stopped",
    "failed",
)
ENGINE_RESTART_REASONS: Final = ("exited", "unhealthy", "start_failed")
#: The ``engine`` label: a replica's index, "0" .. "63" (engine.replicas <= 64,
#: engine_launcher.engine_config.MAX_REPLICAS), so the label stays bounded.
ENGINE_REPLICAS: Final = tuple(str(index) for index in range(64))
#: A SIGHUP reload either applied (its live part) or was rejected (old config kept).
CONFIG_RELOAD_RESULTS: Final = ("applied", "rejected")
#: engine_info's ``version``: the EngineVersion values of proxy/core/engine_releases.py
#: (``unknown`` and each release; the one module of the proxy the metrics may import:
#: tests/test_architecture.py, SHARED_LEAVES).
ENGINE_VERSIONS: Final[tuple[str, ...]] = tuple(v.value for v in EngineVersion)
#: engine_info's ``source``: proxy.core.capabilities.CapabilitySource values.
CAPABILITY_SOURCES: Final = ("unknown", "wire", "preflight", "config")
#: engine_ack_errors_total's ``code``: proxy.core.playback.AckErrorCode values
#: (the engine's code when it is one of these, else "other").
ACK_ERROR_CODES: Final = (
    "playback_ack_too_late",
    "playback_item_not_found",
    "playback_item_mismatch",
    "bad_event",
    "invalid_event",
    "item_not_found",
    "other",
)
#: engine_full_total's ``kind``: where the sidecar saw the engine's
#: resource_exhausted: before the client's upgrade (answered 503) or in the
#: session (passed on to the client).
ENGINE_FULL_KINDS: Final = ("handshake", "session")
#: resumes_total's ``result`` (docs/design.md, Resume): a held session resumed on
#: the new connection; refused (unknown, expired, a forged or replayed token,
#: another key: one answer for all); what was missed is no longer kept
#: (``session.resync_required``); not held here, so passed to the engine.
RESUME_RESULTS: Final = ("resumed", "refused", "resync_required", "passed_upstream")
#: The usage families' ``key`` label (docs/design.md, Usage): the names of the
#: API keys in the operator's ``api_keys_file`` (declared with
#: ``SidecarMetrics.set_usage_keys``, never taken from the wire), plus this value
#: for unnamed keys and for sessions without auth.
UNNAMED_KEY: Final = "unnamed"
#: usage_audio_seconds_total's ``direction``: proxy.core.usage.AudioDirection values.
USAGE_DIRECTIONS: Final = ("in", "out", "delivered", "heard")
#: usage_responses_total's ``outcome``: proxy.core.usage.ResponseOutcome values.
USAGE_RESPONSE_OUTCOMES: Final = ("completed", "cancelled", "failed", "incomplete", "unfinished")
#: usage_tokens_total's ``kind``: the engine's reported input and output tokens.
USAGE_TOKEN_KINDS: Final = ("input", "output")
#: quota_rejections_total's ``quota``: proxy.core.quota_rules.QuotaKind values.
QUOTA_KINDS: Final = ("max_sessions", "sessions_per_minute", "audio_seconds_per_day")

# Buckets, in seconds.
#: Time an event waits in the output buffer: sub-ms when the client keeps up,
#: up to tens of seconds for a stalled reader before overflow.
QUEUE_DELAY_BUCKETS: Final = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
)
#: Fine steps from 5 ms to 2 s, where both timings below live: a p99 read from
#: these is off by at most one step (0.1 s around 1 s: a true 1.003 s reads
#: between 1.0 and 1.1 s, where the old 1.0/1.5/2.0 steps read 1.495 s).
_FINE_SECONDS: Final = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.6,
    0.75,
    0.9,
    1.0,
    1.1,
    1.25,
    1.5,
    2.0,
    3.0,
    5.0,
    10.0,
)
#: Cancel trigger → last audio byte of that response written: 0 is the goal
#: (sub-ms when nothing was in flight), up to seconds while a burst drains.
CANCEL_TO_SILENCE_BUCKETS: Final = (0.0, 0.0005, 0.001, 0.0025, *_FINE_SECONDS)
#: response.create → first audio: model latency dominates (0.05 s – several s).
FIRST_AUDIO_BUCKETS: Final = (*_FINE_SECONDS, 30.0)
#: Audio held by a client at a cancel: around max_audio_lead (0.5 s) and whole replies.
AUDIO_LEAD_BUCKETS: Final = (0.0, 0.1, 0.25, 0.5, 0.6, 0.75, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)
TRUNCATION_SOURCES: Final = ("client", "sidecar")
#: The routes a session came in through: the engine's protocol on /v1/realtime and
#: /v1/duplex, Twilio Media Streams on /v1/twilio (docs/design.md, Phone front door),
#: the OpenAI Realtime protocol, GA or beta, on /v1/realtime (docs/design.md, OpenAI dialect).
FRONT_DOORS: Final = ("realtime", "duplex", "twilio", "openai", "openai_beta")
#: Who heard the caller barge in on a phone call: the engine's voice detection or the sidecar's.
CLEAR_SOURCES: Final = ("engine", "sidecar")
#: Upstream WebSocket connect on loopback: ~ms; seconds mean trouble.
CONNECT_BUCKETS: Final = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)
