"""The I/O-free core: buffer, cancellation ledger, classification, session policy.

The same source runs as Python or compiled by mypyc (the default install);
:mod:`proxy.native` says which, and refuses a compiled module older than its
source.
"""
