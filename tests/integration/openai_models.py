"""Strict validation of server events against the ``openai`` package's own models.

The SDK's ``parse_event`` falls back to a loose object for anything it does not
know; a stock stack (Pipecat, the Agents SDK) validates instead. This checks
each raw frame against the model of its ``type`` in the flavour's
``RealtimeServerEvent`` union, as those stacks do.
"""

from __future__ import annotations

import typing
from typing import Any

import orjson
import pydantic

__all__ = ["ServerEvents"]


def _by_type(union: Any) -> dict[str, type[pydantic.BaseModel]]:
    args = typing.get_args(union)
    if args and typing.get_origin(args[0]) is typing.Union:
        args = typing.get_args(args[0])  # Annotated[Union[...], discriminator]
    models: dict[str, type[pydantic.BaseModel]] = {}
    for model in args:
        for literal in typing.get_args(model.model_fields["type"].annotation):
            models[literal] = model
    return models


class ServerEvents:
    """Validates raw server frames of one flavour (``"ga"`` or ``"beta"``)."""

    def __init__(self, flavour: str) -> None:
        if flavour == "ga":
            from openai.types.realtime import RealtimeServerEvent
        else:
            from openai.types.beta.realtime import RealtimeServerEvent  # type: ignore[no-redef]
        self.models = _by_type(RealtimeServerEvent)

    def validate(self, raw: bytes | str) -> dict[str, Any]:
        """The event as a dict; raises AssertionError naming what does not validate."""
        body = orjson.loads(raw)
        model = self.models.get(body.get("type"))
        assert model is not None, f"not an OpenAI server event: {body.get('type')!r}"
        try:
            model.model_validate(body)
        except pydantic.ValidationError as exc:
            raise AssertionError(f"{body['type']} does not validate: {exc}") from None
        assert isinstance(body, dict)
        return body
