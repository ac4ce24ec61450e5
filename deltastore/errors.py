"""Typed errors.

Every error deltastore raises on purpose derives from :class:`DeltaStoreError`
and also from the builtin a caller would naturally catch (``FileNotFoundError``
for something missing, ``ValueError`` for bad content, ...), so code that does
not know deltastore still handles it sensibly.
"""

from __future__ import annotations


class DeltaStoreError(Exception):
    """Base class of every deltastore error."""


# -- missing things -----------------------------------------------------------
class KeyNotFoundError(DeltaStoreError, FileNotFoundError):
    """A backend key does not exist."""


class VersionNotFoundError(DeltaStoreError, FileNotFoundError):
    """No committed manifest exists for the requested step (or the store is empty)."""


class ObjectNotFoundError(DeltaStoreError, FileNotFoundError):
    """A manifest names an object that is not in the store."""


# -- conflicts -------------------------------------------------------------------
class KeyExistsError(DeltaStoreError, FileExistsError):
    """A create-only write found the key already present."""


class VersionExistsError(DeltaStoreError, FileExistsError):
    """A manifest for this step is already committed (by this or another writer)."""


# -- bad content -----------------------------------------------------------------
class CorruptObjectError(DeltaStoreError, ValueError):
    """An object's bytes do not match its digest, or cannot be decoded.

    ``digest`` names the object when known, so a reader can plan around it.
    """

    def __init__(self, message: str = "", *, digest: str | None = None):
        super().__init__(message)
        self.digest = digest

    def __reduce__(self):  # keep ``digest`` across pickling (multiprocessing, torch.distributed)
        return (_rebuild_corrupt, (str(self), self.digest))


class ManifestError(DeltaStoreError, ValueError):
    """A manifest is malformed: bad JSON, a missing or ill-typed field, a hostile value."""


class UnsupportedFormatError(DeltaStoreError, ValueError):
    """A manifest or object uses a format major version this library does not read."""


class ChecksumMismatchError(DeltaStoreError, ValueError):
    """A tensor's checksum after decoding does not match the manifest."""


class ParentMismatchError(DeltaStoreError, ValueError):
    """A delta's parent is not the version the target currently holds."""


class TargetMismatchError(DeltaStoreError, ValueError):
    """The target lacks a tensor, or one has the wrong shape, dtype or layout."""


class StepOrderError(DeltaStoreError, ValueError):
    """A step is not an integer above the last published step."""


class StaleVersionError(DeltaStoreError, ValueError):
    """The requested version is more versions behind the latest than the Subscriber's ``max_lag`` allows."""


class InvalidKeyError(DeltaStoreError, ValueError):
    """A backend key is empty, absolute, or escapes the store root."""


# -- plugins ---------------------------------------------------------------------
class UnknownPluginError(DeltaStoreError, LookupError):
    """No plugin (codec, backend, policy) is registered under this name."""


class UnknownCodecError(UnknownPluginError):
    """A manifest or a caller names a codec that is not registered."""


class UnknownBackendError(UnknownPluginError):
    """A URI uses a scheme no backend is registered for."""


class PluginConflictError(DeltaStoreError, ValueError):
    """A different plugin is already registered under this name (pass clobber=True)."""


class MissingDependencyError(DeltaStoreError, ImportError):
    """A plugin needs an optional package that is not installed; the message says what to install."""


# -- applying --------------------------------------------------------------------
class ApplyError(DeltaStoreError, RuntimeError):
    """Writing into the target failed midway.

    ``restored`` is True when every touched element was put back (the target
    holds its previous version); False when a restore failed too, in which
    case the target's version is unknown and the next pull starts from an anchor.
    """

    restored: bool = True


class BackendError(DeltaStoreError, OSError):
    """A transport failure the backend could not recover from."""


class BucketNotFoundError(BackendError, FileNotFoundError):
    """The bucket (or container, or HF bucket) a URI names does not exist."""


class AccessDeniedError(BackendError, PermissionError):
    """The service refused the credentials (wrong, expired, or without the needed permission)."""


def _rebuild_corrupt(message: str, digest: str | None) -> CorruptObjectError:
    return CorruptObjectError(message, digest=digest)


# -- added for issue 12 (publisher / subscriber) ------------------------------------
class PostCommitWarning(UserWarning):
    """Something after a version's commit point failed (the store marker, retention).

    The version is committed and pullable; :attr:`VersionInfo.warnings` lists the same messages.
    """


class InvalidStepError(DeltaStoreError, TypeError):
    """A step argument is not an integer (a string, a float, a bool).

    Derives from ``TypeError``, which is what such a call raised before it was typed.
    """


# -- store/backend failures (issue 12) ---------------------------------------------
class BackendUnavailableError(BackendError, ConnectionError):
    """The store could not be reached (refused, timed out, dropped) within the retry deadline."""


class ReadOnlyStoreError(BackendError):
    """The store is on a read-only file system (EROFS) or refuses writes as such."""


class StoreFullError(BackendError):
    """The store has no space left (ENOSPC, EDQUOT) for a write."""


class ValueTooLargeError(DeltaStoreError, ValueError):
    """A stored value is larger than the limit its reader allows (it was not read whole).

    ``size`` is the stored size when the backend knows it, else None.
    """

    def __init__(self, message: str = "", *, size: int | None = None):
        super().__init__(message)
        self.size = size

    def __reduce__(self):
        return (_rebuild_too_large, (str(self), self.size))


class UnknownOptionError(DeltaStoreError, ValueError):
    """A storage option (or a retry-policy field) is not one the backend knows; the message lists the valid ones."""


def _rebuild_too_large(message: str, size: int | None) -> ValueTooLargeError:
    return ValueTooLargeError(message, size=size)


class ReentrantCallError(DeltaStoreError, RuntimeError):
    """A call that would wait on itself: ``Publisher.publish`` (or ``flush``/``close``) from the Publisher's own
    background writer thread (a ``PendingVersionInfo`` done-callback, say), where it would deadlock."""


# -- signed versions (issue 51) -----------------------------------------------------
class SigningKeyError(DeltaStoreError, ValueError):
    """A signing or trusted key cannot be used: a missing or unreadable file, not an Ed25519 key, malformed text.

    The message names the file or the form given, never the key's bytes.
    """


class UntrustedVersionError(DeltaStoreError, ValueError):
    """A version (or the signed latest ref) fails the check of a Subscriber with ``trusted_keys``.

    Raised before any object of the version is fetched; the target keeps its version. ``what`` names the
    step (``"version 12"``, ``"refs/latest"``), ``step`` is the step when known, ``key_id`` the signer's key
    id when the document names one.
    """

    def __init__(self, message: str = "", *, what: str = "", step: int | None = None, key_id: str | None = None):
        super().__init__(message)
        self.what, self.step, self.key_id = what, step, key_id

    def __reduce__(self):  # keep the fields across pickling (vLLM workers, multiprocessing)
        return (_rebuild_untrusted, (type(self), str(self), self.what, self.step, self.key_id))


class UnsignedVersionError(UntrustedVersionError):
    """The version (or ``refs/latest``) carries no signature, and the Subscriber trusts only signed ones."""


class UntrustedKeyError(UntrustedVersionError):
    """The version is signed by a key that is not among the Subscriber's ``trusted_keys``."""


class SignatureError(UntrustedVersionError):
    """The signature does not verify: the signed bytes were changed (or the record is malformed)."""


class RollbackError(UntrustedVersionError):
    """The store offers an older latest version than one already seen or held: a replayed ``refs/latest``,
    hidden versions, or a pull that would move a follower backward without being asked for that step."""


class StaleLatestError(UntrustedVersionError, StaleVersionError):
    """The signed latest version is older than the Subscriber's ``max_latest_age``: the store or a relay may
    be withholding newer versions (a freeze), or the trainer stopped publishing."""


def _rebuild_untrusted(cls: type, message: str, what: str, step: int | None, key_id: str | None
                       ) -> UntrustedVersionError:
    return cls(message, what=what, step=step, key_id=key_id)


# -- an operator's first hour (issue 47) -------------------------------------------
class CredentialsError(AccessDeniedError):
    """No credentials for the store were found (or the named ones do not exist, such as an AWS profile):
    nothing was sent. The message names where the client looked and how to provide them."""


class DeviceUnavailableError(DeltaStoreError, ValueError):
    """A device argument (``mirror_device``) names a device this process does not have (``"cuda"`` on a
    machine or torch build without CUDA, ``"cuda:3"`` with two GPUs, a misspelt device type)."""


# -- the HTTP read path, the store index and the mirror (issue 51) ---------------------
class BadResponseError(BackendError):
    """An HTTP server answered what a correct one never would: a body shorter or longer than it declared, a
    ``Content-Range`` other than the one asked for, a redirect loop or too many redirects, a redirect from
    ``https`` to ``http``, a malformed status line. Nothing read from that answer is used."""


class TransferTooSlowError(BackendUnavailableError, TimeoutError):
    """An HTTP transfer stayed below the backend's ``min_speed`` (a server that trickles bytes) or sent
    nothing for ``read_timeout`` seconds; it was cut off, and is retried like any dropped connection."""


class ListingUnsupportedError(DeltaStoreError, NotImplementedError):
    """The backend cannot list keys (a plain HTTP server): versions are found through ``refs/index.json``."""


class StoreIndexError(ManifestError):
    """``refs/index.json`` is malformed, over its size bound, or names a version whose manifest has other
    bytes than the digest it gives (a stale or tampered index, or a step rewritten by another writer)."""


class MirrorConflictError(DeltaStoreError, FileExistsError):
    """The mirror's destination already holds a version under a step the source has too, with other
    manifest bytes: the destination is another store's, or another writer published into it. Nothing of
    that step is overwritten."""


# -- added for issue 48 --------------------------------------------------------------------------
class EngineUnavailableError(ApplyError, ConnectionError):
    """The inference engine (a vLLM server's LoRA routes) refused the connection, dropped it or did not
    answer within its timeout. The call that failed changed nothing the caller can see."""


class GraceTooShortError(DeltaStoreError, ValueError):
    """A GC grace period is shorter than the store's minimum (its refresh window plus its timestamp
    resolution): a concurrent publish that reuses an object could lose a committed version."""


class NonFiniteWeightError(DeltaStoreError, ValueError):
    """A tensor to be quantized holds NaN or infinity: its block's scale would turn every served value of
    the block into NaN. The message names the tensor and the block."""


class OutputWriteError(DeltaStoreError, OSError):
    """Writing a version's files to a local folder failed (no space left, a read-only or refused folder);
    ``errno`` is the system's. What the folder held before is kept."""


class VersionDroppedError(DeltaStoreError, RuntimeError):
    """A background version was not written because an earlier background publish failed; ``__cause__``
    is that failure. Publishing again starts a new chain with an anchor."""


class UnclosedPublisherWarning(UserWarning):
    """A background Publisher was still open at interpreter exit: its queued versions were committed then
    (call ``close()`` or use it as a context manager to commit them where the program expects)."""
