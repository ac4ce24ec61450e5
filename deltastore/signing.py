"""Signed versions: Ed25519 keys, the signatures of manifests and of the latest ref, and a follower's trust.

A publisher with a signing key signs every manifest it commits (format 1.4) and
the ``refs/latest`` document it writes after each commit (a step, its manifest
digest and the time it was issued). A follower that pins public keys
(:class:`Trust`) checks each manifest's signature on its raw bytes, before the
manifest is parsed and so before any object (the layout object included) is
fetched. ``docs/format.md`` ("Signatures") is the byte-level reference,
``docs/security.md`` the threat model.

**The signed bytes.** A signed JSON document (a manifest, the latest ref) holds
``"signature": {"alg": "ed25519", "key_id": K, "sig": S}`` where ``S`` is 128
lowercase hex digits. The signature is over the document's bytes *as stored*
with those 128 digits written as ``0``: no re-serialisation, so a second
implementation checks it byte for byte. The pattern ``"sig":"<S>"`` must occur
exactly once in the bytes. ``K`` is :func:`key_id` of the public key.

``cryptography`` (the ``[sign]`` extra) is imported only when a key is used.
A :class:`SigningKey` never shows its private bytes (repr, logs) and cannot be
pickled.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .errors import (ManifestError, MissingDependencyError, SignatureError, SigningKeyError,
                     UnsignedVersionError, UntrustedKeyError)

if TYPE_CHECKING:
    from .manifest import Manifest

ALG = "ed25519"
#: the manifest format version of a signed manifest (a 1.3 manifest plus ``signature``)
SIGNED_FORMAT_VERSION = "1.4"
LATEST_FORMAT = "deltastore.latest"
LATEST_FORMAT_VERSION = "1.0"
LATEST_KEY = "refs/latest"
#: the most bytes a reader takes from ``refs/latest``
MAX_LATEST_BYTES = 64 << 10
#: what a signature's 128 hex digits are while its bytes are signed
ZERO_SIG = "0" * 128
_KEY_ID = re.compile(r"^[0-9a-f]{16}$")
_SIG = re.compile(r"^[0-9a-f]{128}$")
_INSTALL = "signed versions need the 'cryptography' package: pip install 'deltastore[sign]'"


def _crypto() -> tuple[Any, Any, Any]:
    """``(ed25519, serialization, InvalidSignature)`` from ``cryptography``, imported on first use."""
    try:
        from cryptography.exceptions import InvalidSignature
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import ed25519
    except ImportError as e:
        raise MissingDependencyError(_INSTALL) from e
    return ed25519, serialization, InvalidSignature


def key_id(raw_public: bytes) -> str:
    """The id of an Ed25519 public key: the first 16 hex digits of the sha256 of its 32 raw bytes."""
    return hashlib.sha256(raw_public).hexdigest()[:16]


class VerifyKey:
    """An Ed25519 public key and its :func:`key_id`."""

    def __init__(self, public: Any):
        _, serialization, _ = _crypto()
        self._key = public
        self.raw = public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        self.key_id = key_id(self.raw)

    def verify(self, signature: bytes, data: bytes) -> bool:
        """Whether ``signature`` is this key's signature of ``data``."""
        _, _, invalid = _crypto()
        try:
            self._key.verify(signature, data)
        except invalid:
            return False
        return True

    def pem(self) -> bytes:
        """The key as PEM (SubjectPublicKeyInfo)."""
        _, serialization, _ = _crypto()
        return self._key.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)

    def openssh(self) -> bytes:
        """The key as one OpenSSH line (``ssh-ed25519 AAAA... deltastore:<key id>``)."""
        _, serialization, _ = _crypto()
        line = self._key.public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
        return line + f" deltastore:{self.key_id}".encode()

    def __repr__(self) -> str:
        return f"VerifyKey({self.key_id})"


class SigningKey:
    """An Ed25519 private key that signs versions. Its repr shows the key id only; it cannot be pickled."""

    def __init__(self, private: Any):
        self._key = private
        self.public = VerifyKey(private.public_key())
        self.key_id = self.public.key_id

    def sign(self, data: bytes) -> bytes:
        return self._key.sign(data)

    def private_pem(self) -> bytes:
        """The key as unencrypted PEM PKCS8 (what :func:`generate_key_files` writes, mode 0600)."""
        _, serialization, _ = _crypto()
        return self._key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption())

    @classmethod
    def generate(cls) -> SigningKey:
        ed25519, _, _ = _crypto()
        return cls(ed25519.Ed25519PrivateKey.generate())

    def __repr__(self) -> str:
        return f"SigningKey({self.key_id})"

    def __reduce__(self) -> Any:
        raise TypeError("a SigningKey is not picklable: pass the key file's path to each process instead")


def load_signing_key(key: Any) -> SigningKey:
    """A :class:`SigningKey` from a path to a PEM file (PKCS8, or OpenSSH ``-----BEGIN OPENSSH PRIVATE KEY``),
    PEM bytes, a ``cryptography`` ``Ed25519PrivateKey`` or a :class:`SigningKey`.

    Raises :class:`SigningKeyError` (missing file, encrypted or malformed PEM, another key type) and
    :class:`MissingDependencyError` without ``cryptography``.
    """
    if isinstance(key, SigningKey):
        return key
    ed25519, serialization, _ = _crypto()
    if isinstance(key, ed25519.Ed25519PrivateKey):
        return SigningKey(key)
    data, where = _key_bytes(key, "signing key")
    try:
        if b"OPENSSH PRIVATE KEY" in data:
            private = serialization.load_ssh_private_key(data, password=None)
        else:
            private = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as e:
        raise SigningKeyError(f"{where} is not an unencrypted PEM private key ({type(e).__name__}); "
                              "write one with `deltastore keygen`") from None
    except Exception as e:  # cryptography's UnsupportedAlgorithm and kin: never echo the key
        raise SigningKeyError(f"{where} cannot be loaded as a private key ({type(e).__name__})") from None
    if not isinstance(private, ed25519.Ed25519PrivateKey):
        raise SigningKeyError(f"{where} holds a {type(private).__name__}, not an Ed25519 key")
    return SigningKey(private)


def load_verify_key(key: Any) -> VerifyKey:
    """A :class:`VerifyKey` from a path to a public key file, PEM text or bytes (``-----BEGIN PUBLIC KEY``),
    an OpenSSH line (``ssh-ed25519 AAAA...``), a ``cryptography`` ``Ed25519PublicKey``, or a
    :class:`VerifyKey` / :class:`SigningKey` (its public half).

    Raises :class:`SigningKeyError` and :class:`MissingDependencyError` like :func:`load_signing_key`.
    """
    if isinstance(key, VerifyKey):
        return key
    if isinstance(key, SigningKey):
        return key.public
    ed25519, serialization, _ = _crypto()
    if isinstance(key, ed25519.Ed25519PublicKey):
        return VerifyKey(key)
    data, where = _key_bytes(key, "trusted key")
    try:
        if data.lstrip().startswith(b"ssh-"):
            public = serialization.load_ssh_public_key(data.strip().split(b"\n")[0])
        else:
            public = serialization.load_pem_public_key(data)
    except Exception as e:  # noqa: BLE001 - malformed text of any kind
        hint = " (that is a private key: trust its public half)" if b"PRIVATE KEY" in data else ""
        raise SigningKeyError(f"{where} is not a PEM or OpenSSH public key ({type(e).__name__}){hint}") from None
    if not isinstance(public, ed25519.Ed25519PublicKey):
        raise SigningKeyError(f"{where} holds a {type(public).__name__}, not an Ed25519 key")
    return VerifyKey(public)


def _key_bytes(key: Any, what: str) -> tuple[bytes, str]:
    """The text of ``key`` (PEM/OpenSSH text as is, else the file it names) and how to name it in errors."""
    if isinstance(key, bytes):
        return key, f"the {what} bytes given"
    if isinstance(key, str) and (key.lstrip().startswith(("-----BEGIN", "ssh-"))):
        return key.encode(), f"the {what} text given"
    if isinstance(key, (str, os.PathLike)):
        path = os.fspath(key)
        try:
            with open(path, "rb") as f:
                return f.read(1 << 20), f"{what} file {path}"
        except OSError as e:
            raise SigningKeyError(f"{what} file {path}: {e.strerror or e}") from None
    raise SigningKeyError(f"a {what} is a path, PEM/OpenSSH text or a key object, not {type(key).__name__}")


# -- signing -------------------------------------------------------------------------------------
def _record(key: SigningKey, sig: str) -> dict[str, str]:
    return {"alg": ALG, "key_id": key.key_id, "sig": sig}


def _needle(sig: str) -> bytes:
    return b'"sig":"' + sig.encode() + b'"'


def sign_document(doc: dict[str, Any], key: SigningKey) -> bytes:
    """The canonical JSON bytes of ``doc`` (keys sorted, compact) with its ``signature`` by ``key``."""
    data = json.dumps({**doc, "signature": _record(key, ZERO_SIG)}, sort_keys=True, separators=(",", ":"),
                      allow_nan=False).encode()
    if data.count(_needle(ZERO_SIG)) != 1:
        raise ManifestError('a signed document may hold the pattern "sig":"<128 zeros>" only as its signature '
                            "(the metadata repeats it)")
    return data.replace(_needle(ZERO_SIG), _needle(key.sign(data).hex()))


def sign_manifest(manifest: Manifest, key: SigningKey) -> tuple[Manifest, bytes]:
    """``manifest`` as format 1.4 with its signature by ``key``, and its bytes (what is committed)."""
    import dataclasses

    from .manifest import LAYOUT_OBJECT_FORMAT_VERSION, names_layout

    if not names_layout(manifest.format_version):
        raise ManifestError(f"only format {LAYOUT_OBJECT_FORMAT_VERSION} manifests are signed, not "
                            f"{manifest.format_version}")
    unsigned = dataclasses.replace(manifest, format_version=SIGNED_FORMAT_VERSION, signature=None)
    data = sign_document(unsigned.to_dict(), key)
    record = json.loads(data)["signature"]
    signed = dataclasses.replace(unsigned, signature=record)
    signed.__dict__.update({k: v for k, v in manifest.__dict__.items() if k in _CACHED})
    return signed, data


_CACHED = ("layout_ref", "layout_bytes", "layout_key", "layout_columns", "checksum_values")


@dataclass(frozen=True)
class SignedLatest:
    """The signed ``refs/latest`` document: the latest ``step``, its manifest ``digest``, the wall-clock time
    (seconds since the epoch) it was ``issued`` at, and the ``key_id`` that signed it."""

    step: int
    digest: str
    issued: float
    key_id: str


def latest_bytes(step: int, digest: str, key: SigningKey, issued: float | None = None) -> bytes:
    """The signed ``refs/latest`` document naming version ``step`` (manifest ``digest``), issued now."""
    return sign_document({"format": LATEST_FORMAT, "format_version": LATEST_FORMAT_VERSION, "step": step,
                          "digest": digest, "issued": time.time() if issued is None else issued}, key)


# -- checking ------------------------------------------------------------------------------------
class Trust:
    """The public keys a follower accepts versions from (several: key rotation).

    :meth:`check` verifies a signed document on its raw bytes and returns the key id that signed it;
    :class:`DeltaStore` runs it on every manifest it reads before parsing it.
    """

    def __init__(self, keys: Iterable[Any]):
        if isinstance(keys, (str, bytes, os.PathLike)):
            keys = [keys]
        loaded = [load_verify_key(k) for k in keys]
        if not loaded:
            raise ValueError("trusted_keys is empty: give at least one public key (or None to trust any version)")
        self.keys: dict[str, list[VerifyKey]] = {}
        for k in loaded:
            same = self.keys.setdefault(k.key_id, [])
            if all(k.raw != o.raw for o in same):
                same.append(k)

    @property
    def key_ids(self) -> list[str]:
        return sorted(self.keys)

    def texts(self) -> list[str]:
        """The trusted keys as OpenSSH lines (what travels to vLLM workers; :func:`as_trust` reads them)."""
        return [k.openssh().decode() for ks in self.keys.values() for k in ks]

    def __repr__(self) -> str:
        return f"Trust({', '.join(self.key_ids)})"

    def check(self, data: bytes, doc: Any, what: str, step: int | None = None) -> str:
        """The key id whose signature ``doc`` (parsed from ``data``) carries, checked against the trusted keys.

        Raises :class:`UnsignedVersionError` (no signature), :class:`UntrustedKeyError` (a key not trusted)
        or :class:`SignatureError` (a malformed record, or bytes changed after signing), each naming ``what``
        and the key id.
        """
        record = doc.get("signature") if isinstance(doc, dict) else None
        trusted = ", ".join(self.key_ids)
        if record is None:
            raise UnsignedVersionError(f"{what} is unsigned; only versions signed by trusted key(s) {trusted} are "
                                       "accepted (refused before any object was fetched)", what=what, step=step)
        kid = record.get("key_id") if isinstance(record, dict) else None
        kid = kid if isinstance(kid, str) and _KEY_ID.match(kid) else None
        sig = record.get("sig") if isinstance(record, dict) else None
        if (kid is None or not isinstance(record, dict) or set(record) != {"alg", "key_id", "sig"}
                or record.get("alg") != ALG or not isinstance(sig, str) or not _SIG.match(sig)):
            raise SignatureError(f"{what} has a malformed signature record (want alg {ALG!r}, a 16-hex key_id and "
                                 "a 128-hex sig); refused before any object was fetched", what=what, step=step,
                                 key_id=kid)
        keys = self.keys.get(kid)
        if keys is None:
            raise UntrustedKeyError(f"{what} is signed by key {kid}, which is not trusted (trusted: {trusted}); "
                                    "refused before any object was fetched", what=what, step=step, key_id=kid)
        needle = _needle(sig)
        if data.count(needle) == 1:
            signed = data.replace(needle, _needle(ZERO_SIG))
            signature = bytes.fromhex(sig)
            if any(k.verify(signature, signed) for k in keys):
                return kid
        raise SignatureError(f"{what} fails its signature check with key {kid}: its bytes were changed after "
                             "signing; refused before any object was fetched", what=what, step=step, key_id=kid)

    def check_manifest(self, data: bytes, doc: Any) -> str:
        """:meth:`check` for manifest bytes (named by the step they claim)."""
        step = doc.get("step") if isinstance(doc, dict) else None
        step = step if isinstance(step, int) and not isinstance(step, bool) else None
        return self.check(data, doc, f"version {step}" if step is not None else "a manifest", step)

    def check_latest(self, data: bytes) -> SignedLatest:
        """The verified ``refs/latest`` document in ``data``.

        Raises :class:`UnsignedVersionError` for the unsigned form (ASCII digits) or anything unsigned,
        :class:`UntrustedKeyError`, :class:`SignatureError` (also for a malformed document).
        """
        what = LATEST_KEY
        try:
            doc = json.loads(data)
        except ValueError:
            doc = None
        if not isinstance(doc, dict):  # the unsigned form: ASCII digits
            raise UnsignedVersionError(f"{what} is unsigned (not a signed latest document); the publisher "
                                       "signs it when it has a signing key", what=what)
        kid = self.check(data, doc, what)
        step, digest, issued = doc.get("step"), doc.get("digest"), doc.get("issued")
        if (doc.get("format") != LATEST_FORMAT or not isinstance(doc.get("format_version"), str)
                or doc["format_version"].split(".")[0] != LATEST_FORMAT_VERSION.split(".")[0]
                or not isinstance(step, int) or isinstance(step, bool) or not 0 <= step < 10**12
                or not isinstance(digest, str) or not re.match(r"^sha256:[0-9a-f]{64}$", digest)
                or not isinstance(issued, (int, float)) or isinstance(issued, bool) or not math.isfinite(issued)):
            raise SignatureError(f"{what} is signed by key {kid} but is not a {LATEST_FORMAT} "
                                 f"{LATEST_FORMAT_VERSION.split('.')[0]}.x document", what=what, key_id=kid)
        return SignedLatest(step, digest, float(issued), kid)


def as_trust(trusted_keys: Any) -> Trust | None:
    """``trusted_keys`` as a :class:`Trust` (None stays None; a Trust is taken as is)."""
    if trusted_keys is None or isinstance(trusted_keys, Trust):
        return trusted_keys
    return Trust(trusted_keys)


def key_texts(trusted_keys: Any) -> list[str] | None:
    """``trusted_keys`` (anything :func:`as_trust` takes) as OpenSSH lines, for an RPC; None stays None."""
    trust = as_trust(trusted_keys)
    return None if trust is None else trust.texts()


def keys_from_env(name: str = "DELTASTORE_TRUSTED_KEYS") -> list[str] | None:
    """The trusted keys an environment variable lists (paths or OpenSSH lines, separated by ``;``, or by
    ``:`` between paths), or None when it is unset or empty."""
    value = os.environ.get(name, "").strip()
    if not value:
        return None
    parts = [p.strip() for p in value.split(";")]
    out: list[str] = []
    for p in parts:
        if p.startswith(("ssh-", "-----BEGIN")):
            out.append(p)
        else:
            out += [q for q in p.split(os.pathsep) if q.strip()]
    return [p for p in out if p]


def generate_key_files(private_path: str | os.PathLike[str], public_path: str | os.PathLike[str] | None = None,
                       *, public_format: str = "pem", overwrite: bool = False) -> tuple[SigningKey, str, str]:
    """Write a new Ed25519 key pair: the private key as unencrypted PEM PKCS8, its file created with mode 0600
    (never readable by others, not even for a moment), and the public key (``"pem"`` or ``"openssh"``) at
    ``public_path`` (default: the private path plus ``.pub``). Returns the key and the two paths.

    Raises :class:`SigningKeyError` when a file exists (unless ``overwrite``) or cannot be written.
    """
    if public_format not in ("pem", "openssh"):
        raise ValueError(f"public_format must be 'pem' or 'openssh', got {public_format!r}")
    private_path = os.fspath(private_path)
    public_path = os.fspath(public_path) if public_path is not None else private_path + ".pub"
    if os.path.abspath(private_path) == os.path.abspath(public_path):
        raise SigningKeyError("the private and public key paths are the same file")
    if not overwrite:
        for p in (private_path, public_path):
            if os.path.lexists(p):
                raise SigningKeyError(f"{p} exists; refusing to overwrite a key (pass overwrite=True / --force)")
    key = SigningKey.generate()
    public = key.public.pem() if public_format == "pem" else key.public.openssh() + b"\n"
    _write_new(private_path, key.private_pem(), 0o600, overwrite)
    _write_new(public_path, public, 0o644, overwrite)
    return key, private_path, public_path


def _write_new(path: str, data: bytes, mode: int, overwrite: bool) -> None:
    """Write ``data`` to ``path`` through a new file created with ``mode`` (O_EXCL), then moved into place:
    renamed over an existing file with ``overwrite``, else linked (which fails if ``path`` exists)."""
    folder = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(folder, f".{os.path.basename(path)}.{os.getpid()}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), mode)
    except OSError as e:
        raise SigningKeyError(f"cannot create {path}: {e.strerror or e}") from None
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if overwrite:
            os.replace(tmp, path)
        else:
            try:
                os.link(tmp, path)
            except FileExistsError:
                raise SigningKeyError(f"{path} exists; refusing to overwrite a key (pass overwrite=True / "
                                      "--force)") from None
            os.unlink(tmp)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


__all__ = ["ALG", "SignedLatest", "SigningKey", "Trust", "VerifyKey", "as_trust",
           "generate_key_files", "key_id", "keys_from_env", "latest_bytes", "load_signing_key", "load_verify_key",
           "sign_document", "sign_manifest"]
