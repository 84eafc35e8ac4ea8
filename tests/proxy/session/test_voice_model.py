"""Loading the packaged voice-activity model (proxy/session/voice_model.py).

The model file is found in its installed package without importing that
package's code, loaded once per process, and a missing package is named in the
error (docs/design.md, Turn detection).
"""

from __future__ import annotations

import sys

import pytest

from proxy.core.voice_activity import SileroModel, VoiceModelError
from proxy.session import voice_model


def test_the_model_is_loaded_once_per_process() -> None:
    model = voice_model.load_voice_model()
    assert isinstance(model, SileroModel)
    assert voice_model.load_voice_model() is model


def test_the_models_package_code_is_not_imported() -> None:
    assert voice_model.model_path().is_file()
    assert voice_model.MODEL_PACKAGE not in sys.modules


def test_a_missing_package_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(voice_model, "MODEL_PACKAGE", "no_such_voice_model_package")
    with pytest.raises(VoiceModelError, match="no_such_voice_model_package is not installed"):
        voice_model.model_path()
