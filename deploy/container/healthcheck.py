"""The image's HEALTHCHECK: exit 0 when GET /readyz on the client listener answers 200.

The listener is read from OMNI_SIDECAR_LISTEN (the image's default
127.0.0.1:8000); a wildcard host (0.0.0.0, ::) is asked on loopback. Set the
address in the environment, not only in a config file, for this check to find it.
Standard library only: it runs in the image's venv without the sidecar's imports.
"""

import os
import sys
import urllib.request

listen = os.environ.get("OMNI_SIDECAR_LISTEN") or "127.0.0.1:8000"
host, _, port = listen.rpartition(":")
host = host.strip("[]")
if host in ("", "0.0.0.0"):
    host = "127.0.0.1"
elif host == "::":
    host = "::1"
if ":" in host:
    host = f"[{host}]"
# No proxy from the environment: the listener is in this container.
opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
try:
    with opener.open(f"http://{host}:{port}/readyz", timeout=3) as response:
        sys.exit(0 if response.status == 200 else 1)
except OSError as exc:  # HTTPError (503 while not ready), refused, timeout
    print(f"readyz: {exc}", file=sys.stderr)
    sys.exit(1)
