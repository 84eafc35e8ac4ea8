"""Stand-in for ``torch.cuda``: devices come from ``FAKE_DEVICES``."""

from __future__ import annotations

GIB = 1024**3

#: One (free_bytes, total_bytes) pair per visible device; tests replace it.
FAKE_DEVICES: list[tuple[int, int]] = [(78 * GIB, 80 * GIB)]


def is_available() -> bool:
    return bool(FAKE_DEVICES)


def device_count() -> int:
    return len(FAKE_DEVICES)


def mem_get_info(device: int = 0) -> tuple[int, int]:
    if not 0 <= device < len(FAKE_DEVICES):
        raise RuntimeError(f"CUDA error: invalid device ordinal {device}")
    return FAKE_DEVICES[device]
