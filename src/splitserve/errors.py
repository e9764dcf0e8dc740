"""The root of splitserve's own exceptions: ``except SplitserveError`` catches every error splitserve raises on
purpose (each also keeps the built-in base its callers expect: a resource's ``EndpointError`` is a
``ValueError``, a PD ``WireError`` a ``ConnectionError``...)."""

from __future__ import annotations


class SplitserveError(Exception):
    """An error splitserve raises on purpose, with a message meant for the person who reads it."""
