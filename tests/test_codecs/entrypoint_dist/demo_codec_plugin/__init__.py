"""A third-party codec found through the ``deltastore.codecs`` entry point (test fixture)."""

from deltastore.codecs.raw import RawCodec


class DemoCodec(RawCodec):
    codec_id = "demo-ep"
