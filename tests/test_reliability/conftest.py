"""Fixtures for the reliability suite: the SeaweedFS S3 server of ``tests/test_backends`` (re-exported,
so a missing server fails these tests with its log, never skips them) and store locations."""

from __future__ import annotations

import pytest

from test_backends.conftest import seaweed_server  # noqa: F401 - re-exported fixture

from .scenarios import local_where, s3_where


@pytest.fixture(params=["local", "s3"])
def where(request, tmp_path):
    """A store location on the local backend and on SeaweedFS's S3 API."""
    if request.param == "local":
        return local_where(str(tmp_path))
    return s3_where(request.getfixturevalue("seaweed_server"))
