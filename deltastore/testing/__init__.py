"""Test helpers for deltastore and for third-party plugins (needs pytest).

:class:`BackendConformance` is the backend conformance suite: subclass it in
a pytest module and provide a ``backend`` fixture (see
:mod:`deltastore.testing.conformance`); :class:`ReadOnlyBackendConformance` the one for
backends that read what another writes (``http(s)://``), with a ``pair`` fixture.
:class:`CodecConformance` is the codec conformance suite: subclass it and provide a
``codec`` fixture (see :mod:`deltastore.testing.codecs`). :func:`bits_equal` compares tensors (or
mappings of them) bit for bit.
"""

from .bits import bits_equal
from .codecs import CodecConformance
from .conformance import BackendConformance, ReadOnlyBackendConformance

__all__ = ["BackendConformance", "CodecConformance", "ReadOnlyBackendConformance", "bits_equal"]
