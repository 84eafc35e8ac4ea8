"""CPU stand-in for ``vllm-omni serve MODEL --omni`` (docs/design.md, Simulator).

Speaks the vLLM-Omni 0.30 duplex realtime protocol (docs/engine-protocol.md)
with real PCM16 audio, including the released
engines' flaws (unbounded outbox, late audio after a cancel), plus fault knobs
for tests. Run it with ``python -m engine_launcher.simulator --help``.

Layout: ``config`` (flags), ``protocol`` (names, errors, ids), ``audio``
(voice, RMS), ``settings`` (``session.update``), ``conversation`` (input and
items), ``playback`` (playback ledger, commit policies, what history keeps of
each reply), ``responses`` (response event builders), ``handlers`` (client event
dispatch), ``session`` (sans-I/O core), ``connection`` (per-socket tasks),
``server`` (aiohttp app and process lifecycle).
"""

from __future__ import annotations

from engine_launcher.simulator.config import SimulatorConfig, parse_args
from engine_launcher.simulator.server import build_app, build_audio_bank, run, serve
from engine_launcher.simulator.session import DuplexSession, SimulatorStats

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
