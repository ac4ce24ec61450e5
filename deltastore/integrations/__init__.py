"""Optional integrations. Each submodule imports its framework lazily (or, for verl, only when imported).

* ``deltastore.integrations.vllm``: worker extension, weight-transfer backend, followers (extra ``deltastore[vllm]``);
* ``deltastore.integrations.trl``: ``DeltaStoreWeightTransfer`` (TRL's ``AsyncGRPOTrainer``) and
  ``DeltaStoreCallback`` (any ``transformers.Trainer``);
* ``deltastore.integrations.verl``: the ``"deltastore"`` verl checkpoint-engine backend (imports verl).
"""
