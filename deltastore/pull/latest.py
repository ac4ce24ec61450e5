"""Which version is the latest, for a follower that pins keys: the signed ``refs/latest``, checked against
rollback and freeze (the roles of TUF's timestamp and snapshot metadata, ``docs/security.md``).

Without trusted keys the latest is the highest step the listing shows, as always. With them:

* ``refs/latest`` must be signed by a trusted key (:meth:`deltastore.signing.Trust.check_latest`);
* it must not be older than one this follower saw before (its step and issue time never go down): a relay
  replaying an older signed ref is refused (:class:`RollbackError`);
* the latest is the higher of its step and the listing's highest (a newer manifest is signed too; the ref
  may lag a commit whose ref write failed); a listing that hides the signed step does not lower it;
* its age (now minus the later of the ref's issue time and the version's ``created``) is reported, and over
  ``max_age`` refused (:class:`StaleLatestError`): a relay holding followers on a stale version is noticed;
* a target that holds a newer version than that latest is not moved backward (:class:`RollbackError`);
  pulling an older step by number stays possible.
"""

from __future__ import annotations

import time

from ..errors import RollbackError, StaleLatestError, UnsignedVersionError, UntrustedVersionError
from ..manifest import VersionRef
from ..signing import LATEST_KEY, SignedLatest, Trust
from ..store import DeltaStore


class LatestCheck:
    """A follower's view of the store's latest version (one per Subscriber).

    trust: the pinned keys (None: the listing decides, nothing is checked).
    max_age: seconds past which a signed latest is refused (None: reported only, in :attr:`age`).
    """

    def __init__(self, trust: Trust | None, max_age: float | None = None):
        if max_age is not None:
            if trust is None:
                raise ValueError("max_latest_age needs trusted_keys: only a signed latest has a time to trust")
            if not isinstance(max_age, (int, float)) or isinstance(max_age, bool) or not max_age > 0:
                raise ValueError(f"max_latest_age must be a positive number of seconds, got {max_age!r}")
        self.trust = trust
        self.max_age = max_age
        #: the newest signed latest accepted (its step and issue time never go down); in memory: a restarted
        #: follower starts again from its target's version and the age bound
        self.seen: SignedLatest | None = None
        #: seconds between the last resolved latest's signature (or commit) and its check; None unsigned
        self.age: float | None = None

    def resolve(self, store: DeltaStore, versions: list[int], held: VersionRef | None = None) -> int | None:
        """The latest step (None: no versions), from the listing ``versions`` and, with trust, the signed ref.

        Raises the typed errors of the module docstring (subclasses of :class:`UntrustedVersionError`) and
        those of reading the version's manifest; nothing but ``refs/latest`` and that manifest is read.
        """
        listed = versions[-1] if versions else None
        if self.trust is None:
            return listed
        data = store.read_latest()
        if data is None:
            if listed is None:
                return None
            raise UnsignedVersionError(f"{LATEST_KEY} is missing while the store lists version {listed}: a follower "
                                       "with trusted keys needs the signed latest to tell a rollback or a freeze",
                                       what=LATEST_KEY, step=listed)
        signed = self.trust.check_latest(data)
        seen = self.seen
        if seen is not None and (signed.step < seen.step or signed.issued < seen.issued):
            raise RollbackError(f"{LATEST_KEY} (key {signed.key_id}) names version {signed.step} issued at "
                                f"{signed.issued:.3f}, older than version {seen.step} issued at {seen.issued:.3f} "
                                "seen before: a replayed latest is refused", what=LATEST_KEY, step=signed.step,
                                key_id=signed.key_id)
        step = signed.step if listed is None else max(signed.step, listed)
        manifest, digest = store.manifest_with_digest(step)  # checked against the trusted keys
        if step == signed.step and digest != signed.digest:
            raise UntrustedVersionError(f"{LATEST_KEY} (key {signed.key_id}) names version {step} with manifest "
                                        f"{signed.digest}, the store holds {digest} (signed by "
                                        f"{manifest.signed_by}): two signed versions claim one step",
                                        what=f"version {step}", step=step, key_id=signed.key_id)
        fresh = signed.issued if step == signed.step else max(signed.issued, manifest.created)
        self.age = age = max(0.0, time.time() - fresh)
        if self.max_age is not None and age > self.max_age:
            raise StaleLatestError(f"the signed latest, version {step} (key {manifest.signed_by}), is {age:.0f} s "
                                   f"old, over max_latest_age={self.max_age:g} s: the store or a relay may be "
                                   "withholding newer versions, or the trainer stopped publishing",
                                   what=f"version {step}", step=step, key_id=manifest.signed_by)
        if held is not None and step < held.step:
            raise RollbackError(f"the store's latest is version {step} (key {manifest.signed_by}), below version "
                                f"{held.step} the target holds: a follower does not move backward unless asked "
                                f"for that step (pull(step={step}))", what=f"version {step}", step=step,
                                key_id=manifest.signed_by)
        self.seen = signed  # remembered only once every check passed (a refused latest leaves no trace)
        return step
