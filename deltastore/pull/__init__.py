"""Pieces of the pull path used by :class:`deltastore.Subscriber`.

* :mod:`.objects` — fetch a version's objects (bounded read-ahead), decode and
  validate one object against the manifest;
* :mod:`.anchor` — stream an anchor, object by object, into a live target
  (with an undo journal) or into new tensors.
"""
