"""Whose address is this? Trusted proxies, ``X-Forwarded-For`` and the PROXY protocol.

Only from a TCP peer in ``trusted_proxies`` is a PROXY header (v1 or v2; parsed
in :mod:`proxy.edge.guard`) or ``X-Forwarded-For`` (right to left, the rightmost
untrusted hop) believed; with no trusted proxies the address is the TCP
peer's. The rules and why: docs/security.md, 3a (docs/design.md, Admission and
lifecycle). Pure functions, no I/O.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Final

__all__ = [
    "PROXY_V1_MAX_BYTES",
    "PROXY_V2_SIGNATURE",
    "ProxyHeader",
    "ProxyHeaderError",
    "TrustedProxies",
    "forwarded_client",
    "parse_proxy_header",
    "proxy_header_kind",
]

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

#: The v1 header is one line of at most 107 bytes, CRLF included (spec §2.1).
PROXY_V1_MAX_BYTES: Final = 107
PROXY_V2_SIGNATURE: Final = b"\r\n\r\n\x00\r\nQUIT\n"
_V1_PREFIX: Final = b"PROXY "
#: v2: signature (12) + version/command (1) + family (1) + length (2).
_V2_FIXED: Final = 16
#: Largest v2 address block we accept (addresses plus TLVs); nginx/HAProxy send far less.
PROXY_V2_MAX_BYTES: Final = 16 + 1024


class ProxyHeaderError(ValueError):
    """A PROXY protocol header that cannot be parsed; the connection is closed."""


@dataclass(frozen=True, slots=True)
class ProxyHeader:
    """A parsed PROXY header.

    Attributes:
        length: bytes it took at the start of the stream (HTTP starts after).
        source: the client address it carries; None for ``LOCAL``/``UNKNOWN``
            (a health check of the proxy itself: keep the TCP peer's address).
    """

    length: int
    source: str | None


class TrustedProxies:
    """The ``trusted_proxies`` networks, parsed once.

    Args:
        networks: CIDR strings (``10.0.0.0/8``, ``::1/128``); a bare address is a /32 or /128.

    Raises:
        ValueError: an entry is not a network.
    """

    def __init__(self, networks: Iterable[str] = ()) -> None:
        self.networks: tuple[IPNetwork, ...] = tuple(
            ipaddress.ip_network(n.strip(), strict=False) for n in networks if n.strip()
        )

    def __bool__(self) -> bool:
        return bool(self.networks)

    def trusts(self, address: str | None) -> bool:
        """True when ``address`` is inside a trusted network (IPv4-mapped IPv6 included)."""
        ip = _ip(address)
        if ip is None:
            return False
        return any(ip.version == net.version and ip in net for net in self.networks)


def _ip(address: str | None) -> IPAddress | None:
    if not address:
        return None
    try:
        ip = ipaddress.ip_address(address.strip().strip("[]"))
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def forwarded_client(peer: str, forwarded_for: Sequence[str], trusted: TrustedProxies) -> str:
    """The client's address, given the hop that connected to us and ``X-Forwarded-For``.

    Args:
        peer: the address of the hop that connected (TCP peer, or the PROXY header's source).
        forwarded_for: every ``X-Forwarded-For`` header value, in order.
        trusted: the trusted proxies; when empty, ``peer`` is the answer.

    Walks from ``peer`` leftwards through the listed hops while the current
    hop is trusted; stops at the first untrusted one (that is the client) or
    at an entry that is not an address (the trusted hop that passed it on is
    then the best we know).
    """
    if not trusted or not trusted.trusts(peer):
        return peer
    hops = [part.strip() for value in forwarded_for for part in value.split(",")]
    current = peer
    for hop in reversed(hops):
        ip = _ip(hop)
        if ip is None:
            return current
        current = str(ip)
        if not trusted.trusts(current):
            return current
    return current


def proxy_header_kind(prefix: bytes) -> str | None:
    """Which PROXY header ``prefix`` starts with: ``"v1"``, ``"v2"``, ``""`` (need more bytes)
    or None (not a PROXY header: plain HTTP)."""
    for kind, signature in (("v1", _V1_PREFIX), ("v2", PROXY_V2_SIGNATURE)):
        n = min(len(prefix), len(signature))
        if prefix[:n] == signature[:n]:
            return kind if len(prefix) >= len(signature) else ""
    return None


def parse_proxy_header(data: bytes) -> ProxyHeader | None:
    """Parse a complete PROXY header at the start of ``data``; None when more bytes are needed.

    Raises:
        ProxyHeaderError: not a valid header (or longer than the spec allows).
    """
    kind = proxy_header_kind(data)
    if kind == "":
        return None
    if kind == "v1":
        return _parse_v1(data)
    if kind == "v2":
        return _parse_v2(data)
    raise ProxyHeaderError("not a PROXY protocol header")


def _parse_v1(data: bytes) -> ProxyHeader | None:
    end = data.find(b"\r\n", 0, PROXY_V1_MAX_BYTES)
    if end < 0:
        if len(data) >= PROXY_V1_MAX_BYTES:
            raise ProxyHeaderError("PROXY v1 line longer than 107 bytes")
        return None
    fields = data[:end].decode("ascii", "replace").split(" ")
    if len(fields) >= 2 and fields[1] == "UNKNOWN":
        return ProxyHeader(end + 2, None)
    if len(fields) != 6 or fields[1] not in ("TCP4", "TCP6"):
        raise ProxyHeaderError(f"bad PROXY v1 line: {data[:end]!r}")
    source = _ip(fields[2])
    if source is None or _ip(fields[3]) is None:
        raise ProxyHeaderError(f"bad PROXY v1 address: {data[:end]!r}")
    if (source.version == 4) != (fields[1] == "TCP4"):
        raise ProxyHeaderError(f"PROXY v1 family does not match its address: {data[:end]!r}")
    if not (_port(fields[4]) and _port(fields[5])):
        raise ProxyHeaderError(f"bad PROXY v1 port: {data[:end]!r}")
    return ProxyHeader(end + 2, str(source))


def _port(text: str) -> bool:
    return text.isdigit() and 0 <= int(text) <= 65535 and (text == "0" or text[0] != "0")


def _parse_v2(data: bytes) -> ProxyHeader | None:
    if len(data) < _V2_FIXED:
        return None
    version_command, family = data[12], data[13]
    length = int.from_bytes(data[14:16], "big")
    if version_command >> 4 != 2:
        raise ProxyHeaderError(f"PROXY v2 header with version {version_command >> 4}")
    if _V2_FIXED + length > PROXY_V2_MAX_BYTES:
        raise ProxyHeaderError(f"PROXY v2 header of {length} bytes")
    if len(data) < _V2_FIXED + length:
        return None
    total = _V2_FIXED + length
    command = version_command & 0x0F
    if command == 0x0:  # LOCAL: the proxy's own connection (health check)
        return ProxyHeader(total, None)
    if command != 0x1:
        raise ProxyHeaderError(f"PROXY v2 command {command}")
    body = data[_V2_FIXED:total]
    address_family, transport = family >> 4, family & 0x0F
    if transport not in (0x1, 0x2) or address_family == 0x0:  # UNSPEC: keep the peer
        return ProxyHeader(total, None)
    if address_family == 0x1 and length >= 12:
        return ProxyHeader(total, str(ipaddress.IPv4Address(body[0:4])))
    if address_family == 0x2 and length >= 36:
        return ProxyHeader(total, str(_ip(str(ipaddress.IPv6Address(body[0:16])))))
    if address_family == 0x3:  # AF_UNIX: no address worth limiting by
        return ProxyHeader(total, None)
    raise ProxyHeaderError(f"PROXY v2 address block too short for family {address_family}")
