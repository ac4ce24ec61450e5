"""The stages of the publish path, composed by :class:`deltastore.Publisher` and, per rank, by
:class:`deltastore.ShardedPublisher`.

* :mod:`.mirror` — the last published bits (one flat buffer per element
  width), the compare against a new state, advance / revert, and the pending
  overlay that lets a background writer own the only copy;
* :mod:`.chain` — the committed head of the chain (parent, anchor, checksums,
  drift) and the anchor policy's decision for the next version;
* :mod:`.resume` — a chain picked up from the store: the mirror and the head rebuilt from the latest
  version, and the differential from the anchor measured exactly;
* :mod:`.anchor_copy` — the last anchor's bits in a local file (``anchor_copy_dir``), so a differential
  compares with it instead of reading the anchor back from the store;
* :mod:`.objects` — object planning: sparse or whole per tensor, grouping,
  anchors cut to stream;
* :mod:`.upload` — encode and upload object jobs with a bounded number in
  flight (anchors stream object by object);
* :mod:`.version` — writing one captured version: decide, encode, upload, commit, move the head;
* :mod:`.commit` — the version's manifest, its create-only commit and read-back, retention after it;
* :mod:`.stages` — the configuration checked once and the stages above opened for one writer (what both
  publishers compose);
* :mod:`.background` — the writer thread of ``background=True``: captured versions committed in order,
  a failure failing what is queued behind it;
* :mod:`.collective` — one code path for one rank or many;
* :mod:`.stream` — an iterator compared piece by piece as it arrives;
* :mod:`.info` — what ``publish()`` returns, committed or pending.
"""
