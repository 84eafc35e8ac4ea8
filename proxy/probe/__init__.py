"""``omni-sidecar probe``: a realtime client for people and benchmarks.

The probe opens one realtime session, streams audio, asks for one or more
responses and measures what a client sees: time to ``session.created``, time
to the first audio delta, how much audio arrived and, when it cancels, how much
audio of the cancelled response still arrived after ``response.cancel``: the
gap the sidecar exists to close (docs/engine-protocol.md, Late audio after a cancel).

That last figure is an amount of audio, not a time: frames received after the
cancel was sent and the length of the audio they carry, computed from the
decoded size of each delta in its format (the delta's own ``format`` and
``sample_rate_hz``, else the session's output format from ``session.created`` /
``session.updated``, else PCM16 at 24 kHz). A wall-clock "cancel to silence"
would mislead: stale audio usually arrives in one burst right after the
cancel, so a few milliseconds of wall time can carry seconds of old answer.

What a listener hears is a third figure. :class:`PlayoutBuffer` models a client
that plays every received delta at 1x from the moment it arrives (queued behind
what it still has to play) and does not clear its buffer on a cancel, like a
telephony bridge. "Old answer heard after barge-in" is then the audio of the
cancelled response played after the cancel moment: what was buffered and not
yet played when the cancel was sent, plus that response's audio that still
arrived afterwards. Engines generate faster than real time, so an unpaced path
leaves seconds in the buffer even when no late delta arrives at all.

It is built like the rest of the package: :class:`~proxy.probe.recorder.Recorder`
is a sans-I/O core that takes events and timestamps and says what to send back
(acks, the cancel); :func:`run_probe` is the thin asyncio/aiohttp shell around
it. The shell reads ``time.monotonic()`` because it is the I/O layer; the
recorder never does.

Layout: ``options`` (ProbeOptions, ProbeResult, the errors), ``playout``
(PlayoutBuffer and the audio helpers), ``recorder`` (the sans-I/O core),
``session`` (run_probe, the asyncio shell), ``cli`` (arguments, output, exit
status). This package re-exports their public names.
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
