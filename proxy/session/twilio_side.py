"""A phone call's client side: Twilio Media Streams in front of a session.

The session is an ordinary one (relay, core, bounded output buffer,
cancellation ledger, playback ledger, quotas, metrics); only what crosses its
client socket is translated, by :class:`TwilioTranslator` installed in the
connection's :class:`~proxy.session.client_side.ClientSide` (its reader and
frame writer). The translation itself is sans-I/O: proxy/core/twilio_call.py
(docs/design.md, Phone front door).
"""

from __future__ import annotations

import logging

from proxy.core.twilio_call import TwilioCall, parse_twilio
from proxy.session.writer import ClientFrameWriter

__all__ = ["TwilioTranslator"]

log = logging.getLogger(__name__)


class TwilioTranslator:
    """Both directions of one call (the client side's ``translator``).

    Args:
        call: the call's translation state (it holds the stream's ``start``).
    """

    def __init__(self, call: TwilioCall) -> None:
        self.call = call
        #: The connection's frame writer, for the frames Twilio gets at once (a ``clear``).
        self.writer: ClientFrameWriter | None = None
        self._opened = False
        #: Twilio said ``stop``: the call is over (the session closes).
        self.stopped = False

    def from_client(self, text: str) -> list[str]:
        """A Twilio message: the session's client events (zero or more)."""
        body = parse_twilio(text)
        if body is None:
            log.debug("not a Twilio message; ignored")
            return []
        if body["event"] == "start":
            if self._opened:
                return []
            self._opened = True
            return [self.call.session_update()]
        inbound = self.call.from_twilio(body)
        if inbound.twilio and self.writer is not None:
            for frame in inbound.twilio:
                self.writer.send_text(frame)  # before anything the session still delivers
        if inbound.stopped:
            self.stopped = True
        return inbound.engine

    def to_client(self, text: str) -> list[str]:
        """An engine event the session delivers: the frames Twilio gets."""
        return self.call.to_twilio(text)
