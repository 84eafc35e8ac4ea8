"""Per-session audio converters and the phone framer (sans-I/O).

An :class:`AudioConverter` turns chunks of one format into another, one per
session and direction: client -> engine input, engine output -> client. It
resamples with libsoxr's streaming resampler (``soxr``), whose state carries
across chunks, so chunk joins make no click, and counts samples on both sides,
so a front door can map playback positions, acks and truncation between the
client's timebase and the engine's. :class:`FrameCutter` cuts the output into
fixed frames (Twilio's 20 ms of mu-law, 160 bytes). For the OpenAI and phone
front doors (docs/design.md, Audio formats); interpreted in both builds.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Final

import numpy as np
import soxr

from proxy.core.audio_formats import (
    AudioError,
    AudioFormat,
    Encoding,
    Samples,
    decode_base64,
    decode_samples,
    encode_base64,
    encode_samples,
    ms_to_samples,
    partial_samples,
    rescale_samples,
    samples_to_ms,
)

__all__ = [
    "DEFAULT_RESAMPLE_QUALITY",
    "TWILIO_FRAME_BYTES",
    "TWILIO_FRAME_MS",
    "AudioConverter",
    "ConverterStatistics",
    "FrameCutter",
    "ResampleQuality",
    "silence",
]


class ResampleQuality(enum.Enum):
    """libsoxr's quality presets; the values are its names.

    Higher presets hold more audio back while streaming (measured in
    docs/performance.md, Audio conversion (for the OpenAI dialect and phone front doors)).
    """

    QUICK = "QQ"  # cubic interpolation, no anti-alias filter
    LOW = "LQ"  # 16-bit precision, band-limited
    MEDIUM = "MQ"
    HIGH = "HQ"  # 20-bit precision
    VERY_HIGH = "VHQ"


#: LQ: 16-bit precision is all PCM16 and G.711 carry (its error on a tone is
#: ~-105 dB), and it holds back least of the band-limited presets (under 1 ms at
#: 22.05 -> 24 kHz, where HQ holds a whole 40 ms chunk).
DEFAULT_RESAMPLE_QUALITY: Final = ResampleQuality.LOW

#: Twilio Media Streams: 20 ms frames of 8 kHz mu-law, 160 bytes each.
TWILIO_FRAME_MS: Final = 20
TWILIO_FRAME_BYTES: Final = 160

_EMPTY: Final = np.zeros(0, dtype=np.float32)


@dataclass(frozen=True, slots=True)
class ConverterStatistics:
    """Sample counts of one converter.

    ``source_samples`` and ``target_samples`` count the current segment: since
    construction, the last :meth:`AudioConverter.flush` or the last
    :meth:`AudioConverter.reset`. ``held_samples`` is the source audio taken in
    and not yet given out (the resampler's look-ahead), in source samples. The
    totals count every segment; ``dropped_samples`` is the source audio resets
    threw away before it came out.
    """

    source_samples: int
    target_samples: int
    held_samples: int
    total_source_samples: int
    total_target_samples: int
    dropped_samples: int


class AudioConverter:
    """Chunks of ``source`` in, chunks of ``target`` out, for one session and direction.

    Call :meth:`convert` per chunk, :meth:`flush` at the end of a continuous
    stretch (an engine response's last delta; a client's input commit) to get
    the audio the resampler still holds, and :meth:`reset` on a cancel or a
    barge-in to drop it. Formats at the same rate convert sample for sample and
    hold nothing; identical formats pass through unchanged.

    Args:
        source: the format of the chunks given to :meth:`convert`.
        target: the format of the chunks it returns.
        quality: the resampler's preset, when the rates differ.
    """

    __slots__ = (
        "_dropped",
        "_quality",
        "_source_samples",
        "_stream",
        "_target_samples",
        "_total_source",
        "_total_target",
        "source",
        "target",
    )

    def __init__(
        self,
        source: AudioFormat,
        target: AudioFormat,
        *,
        quality: ResampleQuality = DEFAULT_RESAMPLE_QUALITY,
    ) -> None:
        self.source = source
        self.target = target
        self._quality = quality
        self._stream: soxr.ResampleStream | None = self._new_stream()
        self._source_samples = 0
        self._target_samples = 0
        self._total_source = 0
        self._total_target = 0
        self._dropped = 0

    def _new_stream(self) -> soxr.ResampleStream | None:
        if self.source.rate == self.target.rate:
            return None
        return soxr.ResampleStream(
            self.source.rate, self.target.rate, 1, dtype="float32", quality=self._quality.value
        )

    @property
    def resamples(self) -> bool:
        """Whether the rates differ (the converter then holds some audio back)."""
        return self._stream is not None

    def convert(self, data: bytes) -> bytes | AudioError:
        """One chunk of ``source`` bytes; returns the ``target`` bytes ready now.

        With resampling the output may be shorter than the chunk's duration
        (the rest comes with the next chunk or :meth:`flush`), even empty.

        Returns:
            The converted bytes, or ``INVALID_AUDIO`` when ``data`` is not whole
            samples (nothing is taken in then).
        """
        if self.source == self.target:
            width = self.source.bytes_per_sample
            if len(data) % width:
                return partial_samples(self.source.encoding, len(data))
            count = len(data) // width
            self._count(count, count)
            return data
        samples = decode_samples(self.source.encoding, data)
        if isinstance(samples, AudioError):
            return samples
        out = samples if self._stream is None else self._resample(samples, last=False)
        self._count(len(samples), len(out))
        return encode_samples(self.target.encoding, out)

    def convert_base64(self, text: object) -> str | AudioError:
        """:meth:`convert` for base64 text (an append's ``audio``, a delta's ``delta``)."""
        data = decode_base64(text)
        if isinstance(data, AudioError):
            return data
        out = self.convert(data)
        if out is data and isinstance(text, str):
            return text  # passed through: the same text, not encoded again
        return out if isinstance(out, AudioError) else encode_base64(out)

    def flush(self) -> bytes:
        """The end of a continuous stretch: the held audio, as ``target`` bytes.

        The segment's output then lasts as long as its input (within one
        sample); the next chunk starts a new segment with a fresh resampler.
        """
        out = _EMPTY
        if self._stream is not None and self._source_samples:
            out = self._resample(_EMPTY, last=True)
            self._stream.clear()
        self._count(0, len(out))
        self._new_segment()
        return encode_samples(self.target.encoding, out) if len(out) else b""

    def reset(self) -> int:
        """A cancel or barge-in: drop the held audio and start a new segment.

        Returns:
            Source samples dropped (taken in, never given out).
        """
        held = self._held()
        self._dropped += held
        if self._stream is not None:
            self._stream.clear()
        self._new_segment()
        return held

    def statistics(self) -> ConverterStatistics:
        """A snapshot of the sample counts (see :class:`ConverterStatistics`)."""
        return ConverterStatistics(
            source_samples=self._source_samples,
            target_samples=self._target_samples,
            held_samples=self._held(),
            total_source_samples=self._total_source,
            total_target_samples=self._total_target,
            dropped_samples=self._dropped,
        )

    # -- timebases ---------------------------------------------------------------------

    def source_samples_for(self, target_samples: int) -> int:
        """The source position of a target position (the same instant).

        The resampler keeps time (its output is aligned with its input), so a
        client's play position of ``target_samples`` into a segment is
        this many samples into the engine's audio of that segment.
        """
        return rescale_samples(target_samples, self.target.rate, self.source.rate)

    def target_samples_for(self, source_samples: int) -> int:
        """The target position of a source position (the same instant)."""
        return rescale_samples(source_samples, self.source.rate, self.target.rate)

    def source_ms_for(self, target_ms: float) -> float:
        """A target position in ms as the source's ms, rounded to the source's samples
        (what a truncation's ``audio_end_ms`` is in the engine's timebase)."""
        target = ms_to_samples(target_ms, self.target.rate)
        return samples_to_ms(self.source_samples_for(target), self.source.rate)

    # -- internals ---------------------------------------------------------------------

    def _resample(self, samples: Samples, *, last: bool) -> Samples:
        assert self._stream is not None
        out: Samples = self._stream.resample_chunk(samples, last=last)
        return out

    def _held(self) -> int:
        given = self.source_samples_for(self._target_samples)
        return max(0, self._source_samples - given)

    def _count(self, source: int, target: int) -> None:
        self._source_samples += source
        self._target_samples += target
        self._total_source += source
        self._total_target += target

    def _new_segment(self) -> None:
        self._source_samples = 0
        self._target_samples = 0


def silence(encoding: Encoding) -> bytes:
    """One sample of silence in ``encoding`` (G.711 codes that decode to 0 or nearest)."""
    return encode_samples(encoding, np.zeros(1, dtype=np.float32))


class FrameCutter:
    """Cuts a byte stream into frames of exactly ``frame_bytes`` (Twilio: 160).

    Holds the remainder, under one frame, between calls, so it is bounded by
    construction. :meth:`flush` gives it out padded with silence to a whole
    frame; :meth:`reset` drops it.

    Args:
        frame_bytes: the frame size; a multiple of ``fill``'s length.
        fill: one sample of silence, used to pad the last frame.
    """

    __slots__ = ("_fill", "_held", "frame_bytes")

    def __init__(self, frame_bytes: int = TWILIO_FRAME_BYTES, fill: bytes = b"\xff") -> None:
        if frame_bytes <= 0 or not fill or frame_bytes % len(fill):
            raise ValueError(f"frame_bytes {frame_bytes} is not a positive multiple of the fill")
        self.frame_bytes = frame_bytes
        self._fill = fill
        self._held = b""

    @classmethod
    def for_format(cls, fmt: AudioFormat, frame_ms: int = TWILIO_FRAME_MS) -> FrameCutter:
        """Frames of ``frame_ms`` of ``fmt`` (whole samples), padded with its silence."""
        samples = max(1, fmt.rate * frame_ms // 1000)
        return cls(samples * fmt.bytes_per_sample, silence(fmt.encoding))

    @property
    def held_bytes(self) -> int:
        return len(self._held)

    def receive(self, data: bytes) -> list[bytes]:
        """Append ``data``; returns every whole frame now complete, in order."""
        buffer = self._held + data if self._held else data
        whole = len(buffer) - len(buffer) % self.frame_bytes
        self._held = buffer[whole:]
        size = self.frame_bytes
        return [buffer[i : i + size] for i in range(0, whole, size)]

    def flush(self, *, pad: bool = True) -> bytes:
        """The remainder (b"" when none), padded with silence to a whole frame unless
        ``pad`` is false."""
        held, self._held = self._held, b""
        if not held or not pad:
            return held
        missing = self.frame_bytes - len(held)
        return held + (self._fill * (missing // len(self._fill) + 1))[:missing]

    def reset(self) -> int:
        """Drop the remainder (a cancel or barge-in); returns the bytes dropped."""
        dropped = len(self._held)
        self._held = b""
        return dropped
