"""Pieces of the publish path used by :class:`deltastore.Publisher` and :class:`deltastore.ShardedPublisher`.

* :mod:`.mirror` — the last published bits (one flat buffer per element
  width), the compare against a new state, advance / revert, and the pending
  overlay that lets a background writer own the only copy;
* :mod:`.upload` — encode and upload object jobs with a bounded number in
  flight (anchors stream object by object).
"""
