"""Playback ledger and assistant history of a simulated session (no I/O, no clock).

Per response, the audio generated, sent, played and committed; from that
ledger and the session's ``playback_commit_policy``, what the model's history
keeps of each reply, its text cut where its audio was. The simulator's own
model of vLLM-Omni 0.30's behaviour (docs/design.md, Simulator); the wire
shapes are built by the callers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final, Literal

__all__ = [
    "ACK_ONLY",
    "COMMIT_ALL_ON_DONE",
    "PLAYBACK_COMMIT_POLICIES",
    "AssistantRecord",
    "PlaybackCursor",
    "TextMark",
    "chars_for_audio_ms",
    "normalize_policy",
]

CommitPolicy = Literal["commit_all_on_done", "ack_only"]

COMMIT_ALL_ON_DONE: Final = "commit_all_on_done"
ACK_ONLY: Final = "ack_only"
PLAYBACK_COMMIT_POLICIES: Final = (COMMIT_ALL_ON_DONE, ACK_ONLY)


def normalize_policy(value: object, default: str = COMMIT_ALL_ON_DONE) -> str:
    """Return the policy named by ``value``; anything unknown means ``commit_all_on_done``.

    Like the engine, an unknown spelling is not an error: it falls back to the
    policy stock clients need (they never ack). ``default`` is returned only
    when ``value`` is not a string at all (the key was absent).
    """
    if not isinstance(value, str):
        return default
    normalized = value.strip().lower()
    return normalized if normalized in PLAYBACK_COMMIT_POLICIES else COMMIT_ALL_ON_DONE


@dataclass(slots=True)
class PlaybackCursor:
    """Ledger of one response's audio, in ms of audio (not wall time).

    Attributes:
        generated_ms: audio the model produced.
        sent_ms: audio put on the wire (equal to generated here: nothing is held back).
        played_ms: highest ``played_ms`` the client acknowledged.
        committed_ms: highest position the client asked to commit; lowered
            only by a truncating ack (capped at what was sent).
    """

    generated_ms: int = 0
    sent_ms: int = 0
    played_ms: int = 0
    committed_ms: int = 0

    @property
    def total_ms(self) -> int:
        """All audio this response put out so far."""
        return max(self.sent_ms, self.generated_ms)

    @property
    def unacknowledged(self) -> bool:
        """Sent audio the client has not yet acknowledged as committed."""
        return self.sent_ms > self.committed_ms

    def mark_sent(self, total_ms: int) -> None:
        """Record that the response's audio now reaches ``total_ms`` (cumulative)."""
        self.generated_ms = max(self.generated_ms, total_ms)
        self.sent_ms = max(self.sent_ms, total_ms)

    def acknowledge(self, played_ms: int, committed_ms: int | None) -> None:
        """Apply an ack: both cursors only move forward (acks may arrive out of order)."""
        self.played_ms = max(self.played_ms, max(0, played_ms))
        committed = self.played_ms if committed_ms is None else committed_ms
        self.committed_ms = max(self.committed_ms, max(0, committed))

    def truncate(self, committed_ms: int) -> None:
        """A truncating ack: commit exactly ``committed_ms`` (never beyond what was sent)."""
        self.committed_ms = max(0, min(self.total_ms, committed_ms))

    def as_dict(self) -> dict[str, int]:
        """The four numbers as the engine puts them on the wire (``playback{...}``)."""
        return {
            "generated_ms": self.generated_ms,
            "sent_ms": self.sent_ms,
            "played_ms": self.played_ms,
            "committed_ms": self.committed_ms,
        }


@dataclass(frozen=True, slots=True)
class TextMark:
    """By ``audio_end_ms`` of the reply's audio, ``text_chars`` characters were spoken."""

    text_chars: int
    audio_end_ms: int


def chars_for_audio_ms(
    audio_end_ms: int, text_len: int, marks: list[TextMark], total_ms: int
) -> int:
    """How many characters of a ``text_len`` reply were spoken by ``audio_end_ms``.

    Piecewise linear through ``marks`` (sorted by audio position), then up to
    the whole text at ``total_ms``; proportional to ``total_ms`` without marks.
    """
    if text_len <= 0 or audio_end_ms <= 0:
        return 0
    if not marks:
        return int(text_len * min(1.0, audio_end_ms / max(1, total_ms)))
    prev_ms = 0
    prev_chars = 0
    for mark in sorted(marks, key=lambda m: m.audio_end_ms):
        mark_ms = max(prev_ms, mark.audio_end_ms)
        mark_chars = min(text_len, max(prev_chars, mark.text_chars))
        if audio_end_ms <= mark_ms:
            if mark_ms == prev_ms:
                return mark_chars
            ratio = (audio_end_ms - prev_ms) / (mark_ms - prev_ms)
            return int(prev_chars + (mark_chars - prev_chars) * ratio)
        prev_ms, prev_chars = mark_ms, mark_chars
    final_ms = max(total_ms, prev_ms)
    if audio_end_ms >= final_ms:
        return text_len
    ratio = (audio_end_ms - prev_ms) / max(1, final_ms - prev_ms)
    return int(prev_chars + (text_len - prev_chars) * ratio)


@dataclass(slots=True, kw_only=True)
class AssistantRecord:
    """What the engine remembers of one assistant reply.

    Attributes:
        response_id: the response that produced it.
        item_id: ``item_<response_id>``.
        turn_id: the user turn it answers; an ack for it after a later user
            commit is ``playback_ack_too_late`` unless it already holds a
            history position.
        cursor: its playback ledger. Once its audio is fully acknowledged
            after the end, the engine forgets it: a later ack starts from an
            empty ledger.
        generated_ms: all audio it produced (kept when the ledger is dropped).
        full_text: everything the model said (the transcript of all deltas).
        marks: one :class:`TextMark` per delta.
        text: what history holds for it (``None``: not in history, waiting
            for an ack or cut to nothing).
        audio_ms: the audio position ``text`` was cut at (``generated_ms`` when whole).
        reserved: an ack has claimed its history position.
        hard_cap_ms: a truncation (``truncate: true`` or
            ``conversation.item.truncate``) that later acks cannot exceed.
        pending_ms: the last cut asked for while it could not apply (the
            response was running, or the cut was empty); applied when the
            response ends.
        ended: the response has ended (completed or cancelled).
        released: its audio was acknowledged in full after it ended; from
            then on cuts can only shorten its history text, and the cap and
            the full text no longer count.
    """

    response_id: str
    item_id: str
    turn_id: int
    cursor: PlaybackCursor = field(default_factory=PlaybackCursor)
    generated_ms: int = 0
    full_text: str = ""
    marks: list[TextMark] = field(default_factory=list)
    text: str | None = None
    audio_ms: int = 0
    reserved: bool = False
    hard_cap_ms: int | None = None
    pending_ms: int | None = None
    ended: bool = False
    released: bool = False

    @property
    def in_history(self) -> bool:
        """Whether the model's history currently holds (part of) this reply."""
        return self.text is not None

    def add_chunk(self, text: str, chunk_ms: int) -> int:
        """Account one delta (its transcript text and audio); return the cumulative ms."""
        self.full_text += text
        total = self.cursor.sent_ms + chunk_ms
        self.cursor.mark_sent(total)
        self.generated_ms = max(self.generated_ms, total)
        self.marks.append(TextMark(text_chars=len(self.full_text), audio_end_ms=total))
        return total

    def _cut(self, text: str, audio_end_ms: int) -> str:
        keep = chars_for_audio_ms(audio_end_ms, len(text), self.marks, self.generated_ms)
        return text[:keep].rstrip()

    def cap(self, audio_end_ms: int) -> None:
        """A truncation: later cuts never reach beyond ``audio_end_ms``."""
        if self.hard_cap_ms is None or audio_end_ms < self.hard_cap_ms:
            self.hard_cap_ms = max(0, audio_end_ms)

    def truncate(self, audio_end_ms: int) -> bool:
        """Cut the reply's history at ``audio_end_ms``; return whether history changed.

        While the response runs nothing is in history yet: the cut is kept
        and applied at the end. Until released, the cut is taken from the
        full text (so a later ack may lengthen it again); an empty cut changes
        nothing. After release, cuts only shorten what history holds, down to
        removing it.
        """
        audio_end_ms = max(0, audio_end_ms)
        if self.hard_cap_ms is not None:
            audio_end_ms = min(audio_end_ms, self.hard_cap_ms)
        if not self.ended:
            self.pending_ms = audio_end_ms
            return False
        if not self.released:
            text = self._cut(self.full_text.strip(), audio_end_ms)
            if not text:
                self.pending_ms = audio_end_ms
                return False
            self.text = text
            self.audio_ms = min(audio_end_ms, self.generated_ms)
            self.pending_ms = None
            return True
        if self.text is None:
            return False
        self.text = self._cut(self.text, audio_end_ms) or None
        self.audio_ms = min(self.audio_ms, audio_end_ms) if self.text else 0
        return True

    def release(self) -> None:
        """Fully acknowledged after its end: the engine drops its ledger, full text and cap."""
        self.released = True
        self.cursor = PlaybackCursor()
        self.hard_cap_ms = None

    def end(self, policy: str, *, late: bool, cancelled: bool) -> bool:
        """Apply the commit policy as the response ends; return whether history got text.

        Args:
            policy: the session's policy (``ack_only`` for a cancel, whatever
                the session's).
            late: a user turn was committed while it ran: the policy puts
                nothing in history (a kept cut or a later ack still may).
            cancelled: the response was cancelled: if the policy put nothing
                in history, the acknowledged position is cut once more.
        """
        self.ended = True
        text = "" if late else self._committed_text(policy)
        if text:
            self.text = text
            committed = self.cursor.committed_ms
            self.audio_ms = committed if 0 < committed < self.generated_ms else self.generated_ms
        if self.pending_ms is not None:
            self.truncate(self.pending_ms)
        committed = self.cursor.committed_ms
        if (
            cancelled
            and not text
            and committed > 0
            and (not late or self.reserved or self.in_history)
        ):
            self.truncate(committed)
        return bool(text)

    def _committed_text(self, policy: str) -> str:
        full = self.full_text.strip()
        total = self.cursor.total_ms
        committed = self.cursor.committed_ms
        if total <= 0 or committed >= total:
            return full
        if committed <= 0:
            return full if policy == COMMIT_ALL_ON_DONE else ""
        return self._cut(full, committed)
