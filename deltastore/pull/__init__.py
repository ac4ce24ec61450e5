"""Pieces of the pull path used by :class:`deltastore.Subscriber`.

* :mod:`.objects` — fetch a version's objects (bounded read-ahead), decode and
  validate one object against the manifest (a delta's as flat batches);
* :mod:`.decoded` — a version's decoded batches, read as updates by name;
* :mod:`.planner` — the cheapest path to a version, from manifests alone;
* :mod:`.anchor` — stream an anchor, object by object, into a live target
  (with an undo journal) or into new tensors.
"""
