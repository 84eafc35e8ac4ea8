"""Break each relay-shell rule once, in a throwaway copy, and see which test catches it.

    python scripts/shell_defects.py            # every defect
    python scripts/shell_defects.py 3 7        # defects 3 and 7 only

For each single-point defect: export the committed tree (``git archive HEAD``)
to a temporary directory, apply the one edit, run the test file that owns the
rule with ``-x``, and report whether it failed (caught), the first failing
test and the seconds the file took. The working tree is never modified, so it
is safe to run while others work in it. Exit status 1 when a defect survives.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Defect:
    what: str
    path: str
    old: str
    new: str
    test: str


DEFECTS = [
    Defect(
        "writer: room while the transport is paused",
        "proxy/session/writer.py",
        "        if compat.writing_paused(protocol) or self.close_sent:\n            return 0",
        "        if self.close_sent:\n            return 0",
        "tests/proxy/session/test_writer.py",
    ),
    Defect(
        "writer: what the client transport holds does not count against the bound",
        "proxy/session/writer.py",
        "        return max(0, self._bound - int(transport.get_write_buffer_size()))",
        "        return self._bound",
        "tests/proxy/session/test_writer.py",
    ),
    Defect(
        "writer: events written after the close frame",
        "proxy/session/writer.py",
        "        if compat.writing_paused(protocol) or self.close_sent:\n            return 0",
        "        if compat.writing_paused(protocol):\n            return 0",
        "tests/proxy/session/test_writer.py",
    ),
    Defect(
        "frames: 126-byte payload gets the 7-bit length form",
        "proxy/session/frames.py",
        "    if length < 126:\n        return bytes((first, length))",
        "    if length <= 126:\n        return bytes((first, length))",
        "tests/proxy/session/test_writer.py",
    ),
    Defect(
        "frames: 65536-byte payload gets the 16-bit length form",
        "proxy/session/frames.py",
        "    if length < 65536:\n        return _PACK_16(first, 126, length)",
        "    if length <= 65536:\n        return _PACK_16(first, 126, length)",
        "tests/proxy/session/test_writer.py",
    ),
    Defect(
        "writer: every pong written, none coalesced above the mark",
        "proxy/session/writer.py",
        "        if self.paused and not self.gone:\n            if self._pending_pong",
        "        if False:\n            if self._pending_pong",
        "tests/proxy/session/test_writer.py",
    ),
    Defect(
        "writer: close frame can be written twice",
        "proxy/session/writer.py",
        "        if self.close_sent:\n            return False",
        "        if False:\n            return False",
        "tests/proxy/session/test_writer.py",
    ),
    Defect(
        "core: a drain takes more than the room",
        "proxy/core/session_output.py",
        "                if size and size + head.event.size > room:",
        "                if False:",
        "tests/proxy/session/test_writer.py",
    ),
    Defect(
        "core: a drain does not re-check queued audio against the ledger",
        "proxy/core/session_output.py",
        "                if rid is not None and self.ledger.cancelled_at(rid) is not None:",
        "                if False:",
        "tests/proxy/core/test_session_core.py",
    ),
    Defect(
        "timers: keepalive drops a peer after three intervals, not two",
        "proxy/session/timers.py",
        "            if silent >= 2 * interval:",
        "            if silent >= 3 * interval:",
        "tests/proxy/session/test_timers.py",
    ),
    Defect(
        "timers: close deadline never armed",
        "proxy/session/timers.py",
        "        when = self._scheduler.time() + budget\n",
        "        return\n        when = self._scheduler.time() + budget\n",
        "tests/proxy/session/test_timers.py",
    ),
    Defect(
        "timers: idle timer fires one keepalive interval late (re-armed from the frame time)",
        "proxy/session/timers.py",
        "        idle = now - self.last_client_event",
        "        idle = now - max(self.last_client_event, self.last_client_frame)",
        "tests/proxy/session/test_timers.py",
    ),
    Defect(
        "timers: engine loss gets close_timeout instead of drain_timeout",
        "proxy/session/timers.py",
        "        budget = self._drain_timeout if code == CLOSE_ABNORMAL_ENGINE else self._close_timeout",
        "        budget = self._close_timeout",
        "tests/proxy/session/test_timers.py",
    ),
    Defect(
        "relay: engine loss is not told to the close deadline",
        "proxy/session/relay.py",
        "                self.timers.arm_close_deadline(close[0])",
        "                self.timers.arm_close_deadline()",
        "tests/proxy/session/test_relay.py",
    ),
    Defect(
        "relay: pings count as client activity for the idle timeout",
        "proxy/session/relay.py",
        "        self.timers.last_client_frame = self._clock()\n        writer = self.side.writer\n",
        "        self.timers.last_client_frame = self.timers.last_client_event = self._clock()\n"
        "        writer = self.side.writer\n",
        "tests/proxy/session/test_relay.py",
    ),
    Defect(
        "relay: client pings never answered",
        "proxy/session/relay.py",
        "        if writer.pong(payload):\n            return\n",
        "        if True:\n            return\n",
        "tests/proxy/session/test_relay.py",
    ),
    Defect(
        "relay: the engine link's unsent input is not counted",
        "proxy/session/relay.py",
        "upstream_backlog=upstream.input_backlog()",
        "upstream_backlog=0",
        "tests/proxy/session/test_relay.py",
    ),
    Defect(
        "core: unread input toward the engine not bounded",
        "proxy/core/session_core.py",
        "        if limit and upstream_backlog + sum(map(len, out)) + event.size > limit:",
        "        if False:",
        "tests/proxy/session/test_relay.py",
    ),
    Defect(
        "relay: keepalive loss does not drop the client",
        "proxy/session/relay.py",
        '        if side == "client":\n            self.side.writer.abort()',
        '        if side == "client":\n            pass',
        "tests/proxy/session/test_relay.py",
    ),
    Defect(
        "relay: a full upstream link does not pause reading the client",
        "proxy/session/relay.py",
        "        if upstream.write_paused:",
        "        if False:",
        "tests/proxy/session/test_relay.py",
    ),
    Defect(
        "relay: frames for the engine due at an engine frame are not sent with it",
        "proxy/session/relay.py",
        "        return self._after(now)\n",
        "        self._after(now)\n        return NOTHING\n",
        "tests/proxy/session/test_relay.py",
    ),
    Defect(
        "relay: a burst's end-of-tick write never happens",
        "proxy/session/relay.py",
        "        self._flush_soon = False\n        self._send(self._after(self._clock()))",
        "        self._flush_soon = False",
        "tests/proxy/session/test_relay.py",
    ),
    Defect(
        "relay: delivery stops after one room while more is queued",
        "proxy/session/relay.py",
        "                if self._took:\n",
        "                if False:\n",
        "tests/proxy/session/test_relay.py",
    ),
    Defect(
        "core: a streaming client's due ack does not ride along",
        "proxy/core/session_core.py",
        "        if self.playback.acking:\n            out.extend(self.playback.acks_due(now))",
        "        if False:\n            out.extend(self.playback.acks_due(now))",
        "tests/proxy/session/test_relay.py",
    ),
    Defect(
        "reader: a client over the frame rate keeps skipping aiohttp's queue",
        "proxy/session/client_reader.py",
        "        if self.pushing:\n            self._set_push(None)",
        "        if False:\n            self._set_push(None)",
        "tests/proxy/session/test_relay.py",
    ),
    Defect(
        "reader: client text frames never take the parser's hand-over",
        "proxy/session/client_reader.py",
        "        handler = frames.client_text if self._push is not None else None",
        "        handler = None",
        "tests/integration/test_client_read_path.py",
    ),
    Defect(
        "compat: text pushed while older messages are still queued",
        "proxy/compat/internals.py",
        "    if handler is not None and len(queue._buffer):",
        "    if False:",
        "tests/proxy/test_compat.py",
    ),
    Defect(
        "supervisor: restart backoff never waited",
        "engine_launcher/supervisor.py",
        "                await self._pause(delay)\n",
        "                await self._pause(0.0)\n",
        "tests/engine_launcher/test_supervisor_shell.py",
    ),
    Defect(
        "supervisor: one restart more than the budget allows",
        "engine_launcher/supervisor.py",
        "                if not self._budget.allows(now):",
        "                if not self._budget.allows(now) and self.restarts > self.config.max_restarts:",
        "tests/engine_launcher/test_supervisor_shell.py",
    ),
    Defect(
        "admission: one session over max_sessions",
        "proxy/edge/session_slots.py",
        "return self.max_sessions == 0 or self.active < self.max_sessions",
        "return self.max_sessions == 0 or self.active <= self.max_sessions",
        "tests/proxy/edge/test_admission.py",
    ),
    Defect(
        "admission: admission_timeout not waited",
        "proxy/edge/session_slots.py",
        "        if not self.has_slot() and self.admission_timeout > 0:",
        "        if False:",
        "tests/proxy/edge/test_admission.py",
    ),
]


def run(defect: Defect) -> tuple[bool, str, float]:
    with tempfile.TemporaryDirectory(prefix="shell-defect-") as tmp:
        archive = subprocess.run(
            ["git", "archive", "HEAD"], cwd=ROOT, capture_output=True, check=True
        ).stdout
        subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
        target = Path(tmp) / defect.path
        text = target.read_text()
        if text.count(defect.old) != 1:
            raise SystemExit(f"defect {defect.what!r}: the edit matches {text.count(defect.old)}x")
        target.write_text(text.replace(defect.old, defect.new))
        started = time.monotonic()
        result = subprocess.run(
            [sys.executable, "-m", "pytest", defect.test, "-x", "-q", "-p", "no:cacheprovider"],
            check=False,
            cwd=tmp,
            capture_output=True,
            text=True,
            timeout=300,
        )
        seconds = time.monotonic() - started
        failed = [
            line.split(" ")[1].split("::")[-1]
            for line in result.stdout.splitlines()
            if line.startswith("FAILED ")
        ]
        return result.returncode != 0, (failed[0] if failed else "-"), seconds


def main(argv: list[str]) -> int:
    chosen = [int(a) for a in argv] or list(range(1, len(DEFECTS) + 1))
    survived = 0
    print("| # | defect | caught by | test file | seconds |")
    print("|---|---|---|---|---|")
    for number in chosen:
        defect = DEFECTS[number - 1]
        caught, test, seconds = run(defect)
        survived += not caught
        verdict = test if caught else "**not caught**"
        print(
            f"| {number} | {defect.what} | {verdict} | {Path(defect.test).name} | {seconds:.1f} |"
        )
    return 1 if survived else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
