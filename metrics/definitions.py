"""Metric definitions: every family, declared once (label values: ``metrics.vocabulary``)."""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    Info,
    PlatformCollector,
    ProcessCollector,
)

from metrics.folded import FoldedHistogram
from metrics.vocabulary import (
    ACK_ERROR_CODES,
    AUDIO_LEAD_BUCKETS,
    CANCEL_TO_SILENCE_BUCKETS,
    CAPABILITY_SOURCES,
    CLEAR_SOURCES,
    CLIENT_PROTOCOL_VIOLATIONS,
    CONFIG_RELOAD_RESULTS,
    CONNECT_BUCKETS,
    CONNECTION_REJECT_REASONS,
    CORE_BUILDS,
    DIRECTIONS,
    DRAIN_OUTCOMES,
    DROP_REASONS,
    ENGINE_FULL_KINDS,
    ENGINE_REPLICAS,
    ENGINE_RESTART_REASONS,
    ENGINE_STATES,
    ENGINE_VERSIONS,
    EVENT_KINDS,
    FIRST_AUDIO_BUCKETS,
    FRONT_DOORS,
    LINGER_OUTCOMES,
    OVERFLOW_POLICIES,
    PREFIX,
    QUEUE_DELAY_BUCKETS,
    QUOTA_KINDS,
    REJECT_REASONS,
    RESUME_RESULTS,
    SESSION_OUTCOMES,
    STANDARD_PREFIXES,
    TRUNCATION_SOURCES,
    UNNAMED_KEY,
    USAGE_DIRECTIONS,
    USAGE_RESPONSE_OUTCOMES,
    USAGE_TOKEN_KINDS,
)

__all__ = [
    "ACK_ERROR_CODES",
    "CAPABILITY_SOURCES",
    "CLEAR_SOURCES",
    "CLIENT_PROTOCOL_VIOLATIONS",
    "CONFIG_RELOAD_RESULTS",
    "CONNECTION_REJECT_REASONS",
    "DIRECTIONS",
    "DRAIN_OUTCOMES",
    "DROP_REASONS",
    "ENGINE_FULL_KINDS",
    "ENGINE_REPLICAS",
    "ENGINE_RESTART_REASONS",
    "ENGINE_STATES",
    "ENGINE_VERSIONS",
    "EVENT_KINDS",
    "FRONT_DOORS",
    "LINGER_OUTCOMES",
    "OVERFLOW_POLICIES",
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
    "SidecarMetrics",
]


class SidecarMetrics:
    """All omni_sidecar_* metrics on one registry.

    Args:
        registry: where to register (a fresh ``CollectorRegistry()`` in tests).
        version: reported by ``build_info``.
        core_build: reported by ``build_info`` (``"mypyc"`` or ``"python"``).
        process_metrics: also register the standard process, GC and platform
            collectors (see ``STANDARD_PREFIXES``); they read ``/proc`` at scrape
            time only, never on the relay's path.
        replicas: engine replicas whose ``engine``-labelled series start at 0.
    """

    def __init__(
        self,
        registry: CollectorRegistry,
        *,
        version: str = "0",
        core_build: str = "python",
        process_metrics: bool = True,
        replicas: int = 1,
    ) -> None:
        if core_build not in CORE_BUILDS:
            raise ValueError(f"core_build must be one of {CORE_BUILDS}, got {core_build!r}")
        if not 1 <= replicas <= len(ENGINE_REPLICAS):
            raise ValueError(f"replicas must be 1..{len(ENGINE_REPLICAS)}, got {replicas}")
        self.replicas = replicas
        self.registry = registry
        if process_metrics:
            ProcessCollector(registry=registry)
            GCCollector(registry=registry)
            PlatformCollector(registry=registry)
        p = PREFIX
        self.sessions_active = Gauge(
            f"{p}_sessions_active", "Client sessions currently relayed.", registry=registry
        )
        self.sessions = Counter(
            f"{p}_sessions", "Client sessions ended, by outcome.", ["outcome"], registry=registry
        )
        self.sessions_started = Counter(
            f"{p}_sessions_started", "Client sessions admitted.", registry=registry
        )
        self.sessions_rejected = Counter(
            f"{p}_sessions_rejected",
            "Session attempts refused before the upgrade, by reason.",
            ["reason"],
            registry=registry,
        )
        self.rejected_connections = Counter(
            f"{p}_rejected_connections",
            "Client connections or requests refused at the listener's edge, by reason.",
            ["reason"],
            registry=registry,
        )
        self.pending_handshakes = Gauge(
            f"{p}_pending_handshakes",
            "Client connections whose request head is not complete yet.",
            registry=registry,
        )
        self.lingering_connections = Gauge(
            f"{p}_lingering_connections",
            "Client connections reading out input after an error answer, before they close.",
            registry=registry,
        )
        self.lingering_closes = Counter(
            f"{p}_lingering_closes",
            "Lingering closes after an error answer before the upgrade, by how they ended.",
            ["outcome"],
            registry=registry,
        )
        self.client_protocol_violations = Counter(
            f"{p}_client_protocol_violations",
            "Upgraded client connections failed with close 1002 for a WebSocket protocol "
            "violation, by reason (unmasked_frame: a client frame without the mask bit).",
            ["reason"],
            registry=registry,
        )
        self.events = Counter(
            f"{p}_events",
            "Events relayed, by direction and kind.",
            ["direction", "kind"],
            registry=registry,
        )
        self.bytes = Counter(
            f"{p}_bytes", "Frame bytes relayed, by direction.", ["direction"], registry=registry
        )
        self.dropped_events = Counter(
            f"{p}_dropped_events",
            "Events not delivered, by reason.",
            ["reason"],
            registry=registry,
        )
        self.dropped_bytes = Counter(
            f"{p}_dropped_bytes",
            "Frame bytes not delivered, by reason.",
            ["reason"],
            registry=registry,
        )
        self.overflows = Counter(
            f"{p}_overflows",
            "Output buffer overflows, by policy applied.",
            ["policy"],
            registry=registry,
        )
        self.output_pending_bytes = Gauge(
            f"{p}_output_pending_bytes",
            "Bytes queued for clients, all sessions.",
            registry=registry,
        )
        self.output_pending_events = Gauge(
            f"{p}_output_pending_events",
            "Events queued for clients, all sessions.",
            registry=registry,
        )
        # Observed once per relayed event: integer buckets, folded at scrape time.
        self.output_queue_delay = FoldedHistogram(
            f"{p}_output_queue_delay_seconds",
            "Time an event waited in the output buffer.",
            QUEUE_DELAY_BUCKETS,
            registry=registry,
        )
        self.cancel_to_silence = Histogram(
            f"{p}_cancel_to_silence_seconds",
            "Cancel trigger to the last audio byte of that response written to the client.",
            buckets=CANCEL_TO_SILENCE_BUCKETS,
            registry=registry,
        )
        self.first_audio = Histogram(
            f"{p}_first_audio_seconds",
            "response.create to the first audio frame written.",
            buckets=FIRST_AUDIO_BUCKETS,
            registry=registry,
        )
        # Playback ledger (docs/design.md, Playback).
        self.audio_delivered = Counter(
            f"{p}_audio_delivered_seconds",
            "Audio seconds of engine output released to clients.",
            registry=registry,
        )
        self.audio_lead_at_cancel = Histogram(
            f"{p}_audio_lead_at_cancel_seconds",
            "Audio a client held unplayed when its response was cancelled (the old answer "
            "it could still play if it does not clear its buffer).",
            buckets=AUDIO_LEAD_BUCKETS,
            registry=registry,
        )
        self.playback_acks = Counter(
            f"{p}_playback_acks",
            "playback.ack frames the sidecar sent to the engine on behalf of clients.",
            registry=registry,
        )
        self.front_door_sessions = Counter(
            f"{p}_front_door_sessions",
            "Client sessions admitted, by the front door they came in through.",
            ["front_door"],
            registry=registry,
        )
        self.twilio_clears = Counter(
            f"{p}_twilio_clears",
            "Phone calls' clear messages (Twilio's queued audio dropped at a barge-in), by "
            "who heard the caller.",
            ["source"],
            registry=registry,
        )
        self.truncations = Counter(
            f"{p}_truncations",
            "Assistant items truncated at a cancel to what was heard, by who asked.",
            ["source"],
            registry=registry,
        )
        self.paced_bound_releases = Counter(
            f"{p}_paced_bound_releases",
            "Paced audio released early because max_paced_audio_bytes was reached.",
            registry=registry,
        )
        self.upstream_connect = Histogram(
            f"{p}_upstream_connect_seconds",
            "Upstream WebSocket connect time.",
            buckets=CONNECT_BUCKETS,
            registry=registry,
        )
        self.upstream_connects = Counter(
            f"{p}_upstream_connects", "Upstream WebSocket connect attempts.", registry=registry
        )
        self.upstream_connect_failures = Counter(
            f"{p}_upstream_connect_failures",
            "Upstream WebSocket connects that failed.",
            registry=registry,
        )
        self.late_audio_after_eviction = Counter(
            f"{p}_late_audio_after_eviction",
            "Audio deltas forwarded to a client although their response was cancelled, "
            "because its tombstone had been evicted (max_tombstones / tombstone_ttl too small).",
            registry=registry,
        )
        self.engine_up = Gauge(f"{p}_engine_up", "1 when the engine is ready.", registry=registry)
        self.engine_state = Gauge(
            f"{p}_engine_state",
            "Engine supervisor state (1 for the current one).",
            ["state"],
            registry=registry,
        )
        self.engine_restarts = Counter(
            f"{p}_engine_restarts", "Engine restarts, by reason.", ["reason"], registry=registry
        )
        self.engine_start_seconds = Gauge(
            f"{p}_engine_start_seconds",
            "Duration of the last engine start until ready.",
            registry=registry,
        )
        # Per replica of the engine pool (docs/design.md, Engine pool); the
        # unlabelled engine_* families above describe the pool as a whole.
        self.engine_replica_up = Gauge(
            f"{p}_engine_replica_up",
            "1 when this engine replica is ready and not draining.",
            ["engine"],
            registry=registry,
        )
        self.engine_replica_draining = Gauge(
            f"{p}_engine_replica_draining",
            "1 while this engine replica drains (admits nothing, then restarts).",
            ["engine"],
            registry=registry,
        )
        self.engine_replica_sessions = Gauge(
            f"{p}_engine_replica_sessions",
            "Client sessions placed on this engine replica (handshakes included).",
            ["engine"],
            registry=registry,
        )
        self.engine_replica_restarts = Counter(
            f"{p}_engine_replica_restarts",
            "Restarts of this engine replica (failures and drains).",
            ["engine"],
            registry=registry,
        )
        self.config_reloads = Counter(
            f"{p}_config_reloads",
            "SIGHUP config reloads, by result (applied, rejected: old config kept).",
            ["result"],
            registry=registry,
        )
        self.engine_info = Info(
            f"{p}_engine",
            "The engine behaviour the sidecar expects (docs/design.md, Engine capabilities): "
            "version and where it came from.",
            registry=registry,
        )
        self.engine_info.info({"version": "unknown", "source": "unknown"})
        self.engine_ack_errors = Counter(
            f"{p}_engine_ack_errors",
            "Engine errors answering the sidecar's own playback acks and truncations (not "
            "shown to the client), by code.",
            ["code"],
            registry=registry,
        )
        self.engine_full = Counter(
            f"{p}_engine_full",
            "Sessions the engine refused as full (resource_exhausted at open), by where the "
            "sidecar saw it: handshake (answered 503) or session (passed on).",
            ["kind"],
            registry=registry,
        )
        self.sessions_detached = Gauge(
            f"{p}_sessions_detached",
            "Sessions held for a resume: their client dropped, their grace runs "
            "(docs/design.md, Resume).",
            registry=registry,
        )
        self.resumes = Counter(
            f"{p}_resumes",
            "session.resume requests on a new connection, by result.",
            ["result"],
            registry=registry,
        )
        self.drain_sessions = Counter(
            f"{p}_drain_sessions",
            "Sessions live when the sidecar began to drain, by how each ended: "
            "handed_over, drained, cut (docs/design.md, Start-up and shutdown).",
            ["outcome"],
            registry=registry,
        )
        self.resume_waits = Counter(
            f"{p}_resume_waits",
            "Connections that read their first message before taking a slot (their API key "
            "has a session a resume could take over).",
            registry=registry,
        )
        self.resume_wait_evictions = Counter(
            f"{p}_resume_wait_evictions",
            "First-message waits ended early to make room for a newer connection "
            "(max_resume_waits, max_resume_waits_per_key); refused with capacity.",
            registry=registry,
        )
        self.resume_waiting = Gauge(
            f"{p}_resume_waiting",
            "Connections reading their first message now, without a slot.",
            registry=registry,
        )
        self.session_slots_used = Gauge(
            f"{p}_session_slots_used",
            "max_sessions slots taken now (sessions, held ones included, and handshakes admitted).",
            registry=registry,
        )
        self.resume_grace_expired = Counter(
            f"{p}_resume_grace_expired",
            "Held sessions whose client never came back within client_resume_grace.",
            registry=registry,
        )
        self.resume_replayed_events = Counter(
            f"{p}_resume_replayed_events",
            "Events replayed to resumed clients: written before the drop, after their cursor.",
            registry=registry,
        )
        self.resume_spent_checks = Counter(
            f"{p}_resume_spent_checks",
            "Resume token generations checked against (or recorded in) the fleet's Redis "
            "(quota_redis_url).",
            registry=registry,
        )
        self.resume_spent_check_fallbacks = Counter(
            f"{p}_resume_spent_check_fallbacks",
            "Of those, checks Redis did not answer in time (down, or every pooled connection "
            "busy past quota_redis_timeout): checked against this process's record only.",
            registry=registry,
        )
        self.usage_sessions = Counter(
            f"{p}_usage_sessions",
            "Ended sessions, by API key name (docs/design.md, Usage).",
            ["key"],
            registry=registry,
        )
        self.usage_session_seconds = Counter(
            f"{p}_usage_session_seconds",
            "Seconds ended sessions lasted, by API key name.",
            ["key"],
            registry=registry,
        )
        self.usage_audio_seconds = Counter(
            f"{p}_usage_audio_seconds",
            "Audio seconds of ended sessions, by API key name and direction: in (appended "
            "by the client), out (generated by the engine), delivered (written to the "
            "client), heard (the playback estimate).",
            ["key", "direction"],
            registry=registry,
        )
        self.usage_responses = Counter(
            f"{p}_usage_responses",
            "Responses of ended sessions, by API key name and how they ended.",
            ["key", "outcome"],
            registry=registry,
        )
        self.usage_tokens = Counter(
            f"{p}_usage_tokens",
            "Tokens the engine reported in response.done (response.usage), by API key name "
            "and kind.",
            ["key", "kind"],
            registry=registry,
        )
        self.usage_records_dropped = Counter(
            f"{p}_usage_records_dropped",
            "Usage records not written to usage_file: the writer was usage_file_max_pending "
            "records behind, or the file could not be written.",
            registry=registry,
        )
        #: The ``key`` label values declared so far (grows on reload, never shrinks).
        self.quota_rejections = Counter(
            f"{p}_quota_rejections",
            "Handshakes refused with 429 quota_exceeded, by API key name and quota "
            "(docs/design.md, Quotas).",
            ["key", "quota"],
            registry=registry,
        )
        self.quota_sessions_ended = Counter(
            f"{p}_quota_sessions_ended",
            "Running sessions ended because their key's audio_seconds_per_day ran out, by API "
            "key name.",
            ["key"],
            registry=registry,
        )
        self.quota_backend_down = Gauge(
            f"{p}_quota_backend_down",
            "1 while quota_redis_url is set and Redis does not answer: quotas are then "
            "counted by this process alone; 0 otherwise.",
            registry=registry,
        )
        self.quota_backend_errors = Counter(
            f"{p}_quota_backend_errors",
            "Redis quota calls that failed or timed out (each one decided locally instead).",
            registry=registry,
        )
        self.quota_backend_reseeds = Counter(
            f"{p}_quota_backend_reseeds",
            "Times this process found Redis without the quota counts it had charged there "
            "(restarted without persistence, or flushed) and reseeded each named key's day "
            "and minute counts from its own.",
            registry=registry,
        )
        self.usage_keys: set[str] = set()
        self.build = Info(f"{p}_build", "Build information.", registry=registry)
        # core: "mypyc" (compiled at install) or "python"; both values are ours.
        self.build.info({"version": version, "core": core_build})
        self._init_series()

    def _init_series(self) -> None:
        for outcome in SESSION_OUTCOMES:
            self.sessions.labels(outcome)
        for reason in REJECT_REASONS:
            self.sessions_rejected.labels(reason)
        for reason in CONNECTION_REJECT_REASONS:
            self.rejected_connections.labels(reason)
        for outcome in LINGER_OUTCOMES:
            self.lingering_closes.labels(outcome)
        for reason in CLIENT_PROTOCOL_VIOLATIONS:
            self.client_protocol_violations.labels(reason)
        for direction in DIRECTIONS:
            self.bytes.labels(direction)
            for kind in EVENT_KINDS:
                self.events.labels(direction, kind)
        for reason in DROP_REASONS:
            self.dropped_events.labels(reason)
            self.dropped_bytes.labels(reason)
        for policy in OVERFLOW_POLICIES:
            self.overflows.labels(policy)
        for state in ENGINE_STATES:
            self.engine_state.labels(state)
        for reason in ENGINE_RESTART_REASONS:
            self.engine_restarts.labels(reason)
        for result in CONFIG_RELOAD_RESULTS:
            self.config_reloads.labels(result)
        for engine in ENGINE_REPLICAS[: self.replicas]:
            for family in (
                self.engine_replica_up,
                self.engine_replica_draining,
                self.engine_replica_sessions,
                self.engine_replica_restarts,
            ):
                family.labels(engine)
        for source in TRUNCATION_SOURCES:
            self.truncations.labels(source)
        for door in FRONT_DOORS:
            self.front_door_sessions.labels(door)
        for source in CLEAR_SOURCES:
            self.twilio_clears.labels(source)
        for code in ACK_ERROR_CODES:
            self.engine_ack_errors.labels(code)
        for kind in ENGINE_FULL_KINDS:
            self.engine_full.labels(kind)
        for result in RESUME_RESULTS:
            self.resumes.labels(result)
        for outcome in DRAIN_OUTCOMES:
            self.drain_sessions.labels(outcome)
        self.set_usage_keys(())

    def set_usage_keys(self, names: Iterable[str]) -> None:
        """Declare key names from the operator's file: their usage series start at 0.

        ``unnamed`` is always declared. A name not declared here is counted as
        ``unnamed`` by :meth:`usage_key`, so the label set stays the file's.
        """
        for name in (UNNAMED_KEY, *names):
            if name in self.usage_keys:
                continue
            self.usage_keys.add(name)
            self.usage_sessions.labels(name)
            self.usage_session_seconds.labels(name)
            for direction in USAGE_DIRECTIONS:
                self.usage_audio_seconds.labels(name, direction)
            for outcome in USAGE_RESPONSE_OUTCOMES:
                self.usage_responses.labels(name, outcome)
            for kind in USAGE_TOKEN_KINDS:
                self.usage_tokens.labels(name, kind)
            for quota in QUOTA_KINDS:
                self.quota_rejections.labels(name, quota)
            self.quota_sessions_ended.labels(name)

    def usage_key(self, name: str) -> str:
        """The ``key`` label value for ``name``: itself when declared, else ``unnamed``."""
        return name if name in self.usage_keys else UNNAMED_KEY

    def set_engine_info(self, version: str, source: str) -> None:
        """``engine_info``: one of ENGINE_VERSIONS, one of CAPABILITY_SOURCES."""
        if version not in ENGINE_VERSIONS or source not in CAPABILITY_SOURCES:
            raise ValueError(f"not our label values: {version!r}, {source!r}")
        self.engine_info.info({"version": version, "source": source})

    def set_engine_state(self, state: str) -> None:
        for known in ENGINE_STATES:
            self.engine_state.labels(known).set(1.0 if known == state else 0.0)
        self.engine_up.set(1.0 if state == "ready" else 0.0)
