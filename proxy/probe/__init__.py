"""``omni-sidecar probe``: a realtime client for people and benchmarks.

One realtime session that streams audio, asks for responses and measures what
a client sees, above all how much of a cancelled answer still arrives, and is
heard, after the cancel. What each figure means and why it is measured that
way: docs/design.md, Probe. A sans-I/O core (``recorder``) in a thin asyncio
shell (``measured_session``), beside ``options``, ``playout`` and ``probe_cli``;
this package re-exports their public names.
"""

from __future__ import annotations

from proxy.probe.measured_session import run_probe
from proxy.probe.options import (
    DEFAULT_URL,
    ProbeConnectError,
    ProbeError,
    ProbeOptions,
    ProbeResult,
    ProbeTimeout,
)
from proxy.probe.playout import PlayoutBuffer, base64_decoded_length, voice_like_pcm16
from proxy.probe.probe_cli import add_probe_arguments, format_result, main_probe, options_from_args
from proxy.probe.recorder import Recorder as _Recorder  # noqa: F401  (tests drive it)

__all__ = [
    "DEFAULT_URL",
    "PlayoutBuffer",
    "ProbeConnectError",
    "ProbeError",
    "ProbeOptions",
    "ProbeResult",
    "ProbeTimeout",
    "add_probe_arguments",
    "base64_decoded_length",
    "format_result",
    "main_probe",
    "options_from_args",
    "run_probe",
    "voice_like_pcm16",
]
