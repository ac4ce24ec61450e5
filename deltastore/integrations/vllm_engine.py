"""Moved to :mod:`deltastore.integrations.vllm.engine` (this name keeps old imports working; imports vLLM)."""

import sys

from .vllm import engine as _engine

sys.modules[__name__] = _engine
