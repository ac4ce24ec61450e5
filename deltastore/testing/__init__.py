"""Test helpers for deltastore and for third-party plugins (needs pytest).

:class:`BackendConformance` is the backend conformance suite: subclass it in
a pytest module and provide a ``backend`` fixture (see
:mod:`deltastore.testing.conformance`). :class:`CodecConformance` is the codec
conformance suite: subclass it and provide a ``codec`` fixture (see
:mod:`deltastore.testing.codecs`).
"""

from .codecs import CodecConformance
from .conformance import BackendConformance

__all__ = ["BackendConformance", "CodecConformance"]
