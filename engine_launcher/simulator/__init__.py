"""CPU stand-in for ``vllm-omni serve MODEL --omni`` (docs/design.md, Simulator).

Speaks the vLLM-Omni duplex realtime protocol (docs/engine-protocol.md) with
real PCM16 audio, as 0.30, 0.31 or 0.32 behaves (``--engine-version``): by
default the released 0.30 engine's flaws (unbounded outbox, late audio after a
cancel), or the newer releases' bounded output and cancel/playback rules; plus
fault knobs for tests. Run it with ``python -m engine_launcher.simulator --help``.

Layout: ``config`` (flags), ``protocol`` (names, errors, ids), ``audio``
(voice, RMS), ``settings`` (``session.update``), ``conversation`` (input and
items), ``playback`` (playback ledger, commit policies, what history keeps of
each reply), ``responses`` (response event builders), ``handlers`` (client event
dispatch), ``delivery`` (each session's output queue), ``counters`` (session
slots, process stats), ``outbox`` (numbering and queueing of a session's
output), the sans-I/O session core in three layers: ``session_state`` (state,
queries, emitting, closing), ``generation`` (the response lifecycle) and
``session`` (opening, client input), then ``connection`` (per-socket tasks) and
``server`` (aiohttp app and process lifecycle).
"""

from __future__ import annotations

from engine_launcher.simulator.counters import SimulatorStats
from engine_launcher.simulator.duplex_session import DuplexSession
from engine_launcher.simulator.engine_server import build_app, build_audio_bank, run, serve
from engine_launcher.simulator.flags import SimulatorConfig, parse_args

__all__ = [
    "DuplexSession",
    "SimulatorConfig",
    "SimulatorStats",
    "build_app",
    "build_audio_bank",
    "parse_args",
    "run",
    "serve",
]
