"""Moved to :mod:`deltastore.integrations.vllm.stage` (this name keeps old imports working)."""

import sys

from .vllm import stage as _stage

sys.modules[__name__] = _stage
