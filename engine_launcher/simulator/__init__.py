"""CPU stand-in for ``vllm-omni serve MODEL --omni`` (docs/design.md, Simulator).

Speaks the vLLM-Omni duplex realtime protocol (docs/engine-protocol.md) with
real PCM16 audio, as 0.30, 0.31 or 0.32 behaves (``--engine-version``), with
fault knobs for tests. Run it with ``python -m engine_launcher.simulator --help``;
which module does what is in the same section of the design.
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
