"""Every backend passes the conformance suite: local, memory, S3 (SeaweedFS, moto), GCS (fake-gcs-server), HF (stand-in)."""

from __future__ import annotations

import pytest

from deltastore.testing import BackendConformance

from .conftest import ALL_KINDS, target_for


class TestConformance(BackendConformance):
    @pytest.fixture(params=ALL_KINDS)
    def backend(self, request, tmp_path):
        b = target_for(request.param, request, tmp_path).open()
        yield b
        b.close()

    @pytest.mark.slow
    def test_large_object(self, backend, large_size):
        super().test_large_object(backend, large_size)
