"""One client session, end to end: the I/O shell around the I/O-free core.

``relay`` coordinates a session (the only caller of ``proxy.core``),
``writer`` owns every byte written to the client, ``upstream_link`` is the
session's WebSocket to the engine, ``timers`` keeps keepalive, idle, duration
and close deadlines, and ``observer`` turns what happened into metrics, the
console's lifecycle and tracing (docs/design.md, Relay shell).
"""
