"""Moved to :mod:`deltastore.integrations.vllm.mapping` (this name keeps old imports working)."""

import sys

from .vllm import mapping as _mapping

sys.modules[__name__] = _mapping
