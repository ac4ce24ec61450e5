"""A real vLLM engine (CPU build) that follows a signed store refuses an unsigned version and keeps serving
its previous one (``signed_check.py``, run in the vLLM virtualenv like ``engine_check.py``)."""

from __future__ import annotations

import pytest

from .test_engine import run_check


@pytest.mark.slow
def test_follower_refuses_unsigned_version_and_keeps_serving(tmp_path):
    checks = run_check("signed_check.py", tmp_path)["checks"]
    assert checks["follower_applied_3"]["result"]["step"] == 3
    assert checks["unsigned_latest_refused"].startswith("UnsignedVersionError: refs/latest")
    assert checks["unsigned_version_refused"].startswith("UnsignedVersionError: version 4 is unsigned")
    assert checks["follower_last_error"]["type"] == "UnsignedVersionError"
    assert checks["worker_refuses_without_keys"].startswith("UnsignedVersionError: version 4 is unsigned")
    assert checks["outputs_unchanged"]
