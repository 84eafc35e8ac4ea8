"""The client listener: what a client meets before and around its session.

``guard`` bounds a connection before it has a request, ``handshake`` validates
the upgrade, ``auth`` and ``forwarded`` say who the client is, ``quota`` and
the admission in ``app`` decide whether it may start a session, and
``reverse_proxy`` streams plain HTTP to the engine (docs/design.md, Routes and
listeners; Admission and lifecycle).
"""
