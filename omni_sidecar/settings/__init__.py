"""Settings: one declaration per setting, loaded from file, environment and flags.

``proxy`` declares the sidecar's settings and loads them; ``engine`` declares
the engine section (``[engine]``: what to launch and how to supervise it),
which the engines layer reads without depending on the rest
(docs/design.md, Settings).
"""
