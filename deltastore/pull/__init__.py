"""The pull side: :class:`~deltastore.pull.subscriber.Subscriber` over a version reader and one transaction per pull.

* :mod:`.subscriber` — the facade (``Subscriber``, ``PullResult``): trust, lag, one lock, a transaction per pull;
* :mod:`.reader` — :class:`~.reader.VersionReader`: plan, fetch, verify, decode and stage a version's
  objects, usable alone on a store;
* :mod:`.transaction` — one pull into one target from begin to commit or abort: the checks once, the
  version tracked in one place, one undo log, one error rule, a named strategy per path;
* :mod:`.staging` — decoded versions staged on the host (``FullState``) or over a target (``SparseOverlay``);
* :mod:`.checks` — what a pull checks about its target before writing;
* :mod:`.apply` — an overlay written into a target, each write's undo noted first;
* :mod:`.undo` — the undo journal (a live target's old bits, before an anchor overwrites them);
* :mod:`.tracking` — which version a target holds; one pull at a time per target;
* :mod:`.planner` — the cheapest path to a version, from manifests alone;
* :mod:`.objects` — fetch a version's objects (bounded read-ahead), decode and validate one object
  against the manifest (a delta's as flat batches);
* :mod:`.decoded` — a version's decoded batches, read as updates by name;
* :mod:`.anchor` — stream an anchor, object by object, into a live target (with an undo journal) or
  into new tensors;
* :mod:`.checked_target`, :mod:`.writable`, :mod:`.latest` — the last target's checks, read-only
  memory, the signed latest;
* :mod:`.verify`, :mod:`.materialize` — a whole store verified, one version written as a checkpoint.
"""
