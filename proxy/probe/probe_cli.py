"""The ``omni-sidecar probe`` subcommand: its arguments, its output, its exit status.

:func:`add_probe_arguments` and :func:`options_from_args` turn the command
line into :class:`~proxy.probe.options.ProbeOptions`;
:func:`format_result` renders a result for a person or as JSON;
:func:`main_probe` runs the probe and maps the outcome to an exit status.
``proxy/cli.py`` wires them into the ``omni-sidecar`` command.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import sys
from pathlib import Path
from typing import Final

import orjson

from proxy.errors import ConfigError
from proxy.probe.measured_session import run_probe
from proxy.probe.options import ProbeError, ProbeOptions, ProbeResult, ProbeTimeout

__all__ = ["add_probe_arguments", "format_result", "main_probe", "options_from_args"]

_PROG: Final = "omni-sidecar probe"


def _ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1000.0:.1f} ms"


def _stale_audio_line(result: ProbeResult) -> str:
    prefix = "audio of the cancelled response received after the cancel"
    if not result.cancels_sent:
        return f"{prefix}: n/a (no cancel sent)"
    frames = "frame" if result.stale_audio_frames == 1 else "frames"
    return (
        f"{prefix}: {result.stale_audio_frames} {frames}, "
        f"{result.stale_audio_seconds * 1000.0:.1f} ms of audio"
    )


def _heard_after_barge_in_line(result: ProbeResult) -> str:
    prefix = "old answer heard after barge-in"
    heard = result.old_answer_heard_after_barge_in_ms
    if heard is None:
        return f"{prefix}: n/a (no cancel sent)"
    return f"{prefix}: {heard:.1f} ms"


def format_result(result: ProbeResult, *, as_json: bool) -> str:
    """Render a result for a person (one line per figure) or as JSON.

    Args:
        result: What :func:`run_probe` returned.
        as_json: Return a JSON object with every field instead of text.

    Returns:
        The text, without a trailing newline.
    """
    if as_json:
        return orjson.dumps(dataclasses.asdict(result), option=orjson.OPT_INDENT_2).decode()
    lines = [
        f"session.created after {_ms(result.session_created_seconds)}",
        f"first audio after {_ms(result.first_audio_seconds)}",
    ]
    if len(result.response_first_audio_seconds) > 1:
        each = ", ".join(_ms(s) for s in result.response_first_audio_seconds)
        lines.append(f"first audio per response: {each}")
    lines += [
        f"audio received: {result.audio_seconds:.3f} s in {result.audio_frames} frames",
        f"response.done statuses: {', '.join(result.response_statuses) or 'none'}",
        _stale_audio_line(result),
        _heard_after_barge_in_line(result),
        f"errors: {', '.join(result.errors) or 'none'}",
        f"session.closed reason: {result.session_closed_reason or 'n/a'}",
        f"close code: {result.close_code if result.close_code is not None else 'n/a'}",
        f"events received: {len(result.event_types)}",
        f"completed: {'yes' if result.completed else 'no'}",
    ]
    return "\n".join(lines)


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive: {text}")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must not be negative: {text}")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1: {text}")
    return value


def _header(text: str) -> tuple[str, str]:
    name, sep, value = text.partition(":")
    if not sep or not name.strip():
        raise argparse.ArgumentTypeError(f"expected NAME:VALUE, got {text!r}")
    return name.strip(), value.strip()


def add_probe_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``probe`` subcommand's arguments to ``parser``.

    Args:
        parser: The (sub)parser; :func:`options_from_args` reads its namespace.
    """
    defaults = ProbeOptions()
    parser.add_argument("url", nargs="?", default=defaults.url, help=f"default {defaults.url}")
    parser.add_argument("--wav", type=Path, default=None, help="PCM16 mono WAV to stream")
    parser.add_argument(
        "--input-seconds",
        type=_positive_float,
        default=defaults.input_seconds,
        metavar="S",
        help="audio streamed before each commit (default %(default)s)",
    )
    parser.add_argument(
        "--append-ms",
        type=_positive_float,
        default=defaults.append_ms,
        metavar="MS",
        help="audio per input_audio_buffer.append (default %(default)s)",
    )
    parser.add_argument(
        "--no-realtime", dest="realtime", action="store_false", help="send input unpaced"
    )
    parser.add_argument(
        "--cancel-after-ms",
        type=_non_negative_float,
        default=None,
        metavar="MS",
        help="cancel each response after this much received audio",
    )
    parser.add_argument(
        "--timeout",
        type=_positive_float,
        default=defaults.timeout,
        metavar="S",
        help="overall deadline (default %(default)s)",
    )
    parser.add_argument(
        "--header",
        dest="headers",
        type=_header,
        action="append",
        default=None,
        metavar="NAME:VALUE",
        help="extra upgrade header (repeatable)",
    )
    parser.add_argument("--event-ack", action="store_true", help="ack server_event_seq")
    parser.add_argument(
        "--responses",
        type=_positive_int,
        default=defaults.responses,
        metavar="N",
        help="responses to request in sequence (default %(default)s)",
    )
    parser.add_argument("--json", action="store_true", help="print the result as JSON")


def options_from_args(ns: argparse.Namespace) -> ProbeOptions:
    """Build :class:`ProbeOptions` from a namespace parsed with :func:`add_probe_arguments`.

    Raises:
        ConfigError: A value is out of range.
    """
    return ProbeOptions(
        url=ns.url,
        wav=ns.wav,
        input_seconds=ns.input_seconds,
        append_ms=ns.append_ms,
        realtime=ns.realtime,
        cancel_after_ms=ns.cancel_after_ms,
        timeout=ns.timeout,
        headers=tuple(ns.headers or ()),
        event_ack=ns.event_ack,
        responses=ns.responses,
    )


def _error(message: str) -> None:
    print(f"{_PROG}: error: {' '.join(message.split())}", file=sys.stderr)


def main_probe(ns: argparse.Namespace) -> int:
    """Run the probe for the CLI and print its result.

    Args:
        ns: Namespace parsed with :func:`add_probe_arguments`.

    Returns:
        0 when the session completed; 1 on a connect failure, a timeout (the
        partial result is printed first) or an incomplete session; 2 for an
        invalid option; 130 on Ctrl-C. Errors are one line on stderr.
    """
    try:
        options = options_from_args(ns)
    except ConfigError as exc:
        _error(str(exc))
        return 2
    try:
        result = asyncio.run(run_probe(options))
    except ProbeTimeout as exc:
        print(format_result(exc.result, as_json=ns.json))
        _error(str(exc))
        return 1
    except ProbeError as exc:
        _error(str(exc))
        return 1
    except KeyboardInterrupt:
        return 130
    print(format_result(result, as_json=ns.json))
    if not result.completed:
        code = result.close_code if result.close_code is not None else "none"
        _error(f"session did not complete (close code {code}, errors: {result.errors or 'none'})")
        return 1
    return 0
