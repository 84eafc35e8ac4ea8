"""A session's OpenAI dialect as its client connection's translator (docs/design.md, OpenAI dialect).

The connection's reader hands each client text frame to :meth:`OpenAISide.from_client`
and the relay reads what it returns; its frame writer writes each engine event
as :meth:`OpenAISide.to_client` rewrites it. What the dialect answers itself
(a truncation, the speech events of its turn detection, an error) is written at
once through the writer, ahead of what the engine answers.
"""

from __future__ import annotations

from proxy.core.dialect import Flavour, OpenAIDialect
from proxy.session.writer import ClientFrameWriter

__all__ = ["OpenAISide"]


class OpenAISide:
    """Both directions of one session's OpenAI dialect.

    ``writer`` is set once the client side exists and cleared when the session
    ends (the one back-reference: writer -> translator -> writer).
    """

    __slots__ = ("dialect", "writer")

    def __init__(self, dialect: OpenAIDialect) -> None:
        self.dialect = dialect
        self.writer: ClientFrameWriter | None = None

    @property
    def label(self) -> str:
        """The front door, as metrics and the console name it."""
        return "openai" if self.dialect.flavour is Flavour.GA else "openai_beta"

    def from_client(self, text: str) -> list[str]:
        step = self.dialect.from_client(text)
        writer = self.writer
        if step.replies and writer is not None:
            for reply in step.replies:
                for out in self.dialect.to_client(reply):
                    writer.send_text(out)
        return list(step.forward)

    def to_client(self, text: str) -> list[str]:
        return self.dialect.to_client(text)
