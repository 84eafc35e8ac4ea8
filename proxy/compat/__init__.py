"""Every aiohttp internal the product touches, named once and checked at start-up.

The relay and the edge's guard need what aiohttp's public API cannot say or do
(docs/design.md, Relay shell), so the product reaches into aiohttp here and
nowhere else: :mod:`proxy.compat.internals` holds each reach, and
:mod:`proxy.compat.check` names each as a hook that ``serve`` checks before it
binds anything (exit 2, naming the aiohttp version and the missing hook).
"""

from proxy.compat.check import (
    AIOHTTP_VERSION,
    HOOKS,
    AiohttpHookMissing,
    Hook,
    missing_hooks,
    require_hooks,
)
from proxy.compat.internals import (
    UNMASKED_FRAME,
    HookedAppRunner,
    HookedRequestHandler,
    MaskWalk,
    bound_sockets,
    client_transport,
    closing,
    detach_transport,
    handler_kwargs,
    head_refused,
    install_client_writer,
    install_mask_check,
    install_text_push,
    on_writing_resumed,
    push_text,
    requests_parsed,
    set_upstream_write_limit,
    upgraded,
    upstream_backlog,
    upstream_protocol,
    upstream_transport,
    wait_writable,
    websocket_mask,
    writing_paused,
)

__all__ = [
    "AIOHTTP_VERSION",
    "HOOKS",
    "UNMASKED_FRAME",
    "AiohttpHookMissing",
    "Hook",
    "HookedAppRunner",
    "HookedRequestHandler",
    "MaskWalk",
    "bound_sockets",
    "client_transport",
    "closing",
    "detach_transport",
    "handler_kwargs",
    "head_refused",
    "install_client_writer",
    "install_mask_check",
    "install_text_push",
    "missing_hooks",
    "on_writing_resumed",
    "push_text",
    "requests_parsed",
    "require_hooks",
    "set_upstream_write_limit",
    "upgraded",
    "upstream_backlog",
    "upstream_protocol",
    "upstream_transport",
    "wait_writable",
    "websocket_mask",
    "writing_paused",
]
