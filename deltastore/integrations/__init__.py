"""Optional integrations (vLLM, ...). Each submodule imports its framework lazily.

``deltastore.integrations.vllm``: a vLLM worker extension, weight-transfer
backend and pull-only follower (extra ``deltastore[vllm]``).
"""
