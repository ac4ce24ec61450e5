"""``deltastore keygen``, and the ``--trusted-key`` option that pull and verify share (``docs/security.md``)."""

from __future__ import annotations

import argparse
from typing import Any

from ._common import CliError, UsageError


def register(sub: Any, parents: list[argparse.ArgumentParser]) -> None:
    s = sub.add_parser("keygen", parents=parents, help="write a new Ed25519 signing key pair",
                       description="Write a new Ed25519 key pair for Publisher(signing_key=...): the private key as "
                                   "unencrypted PEM PKCS8 in a file created with mode 0600, the public key (PEM or "
                                   "OpenSSH) beside it for followers' --trusted-key. Prints the key id.")
    s.add_argument("private_key", metavar="PRIVATE_KEY", help="where to write the private key")
    s.add_argument("--public", metavar="PATH", default=None, help="the public key's path (default: PRIVATE_KEY.pub)")
    s.add_argument("--public-format", choices=("pem", "openssh"), default="pem",
                   help="PEM (SubjectPublicKeyInfo, default) or one OpenSSH line (ssh-ed25519 ...)")
    s.add_argument("--force", action="store_true", help="replace existing key files")
    s.set_defaults(func=cmd_keygen)


def cmd_keygen(args: argparse.Namespace) -> int:
    from ..signing import generate_key_files

    key, private, public = generate_key_files(args.private_key, args.public, public_format=args.public_format,
                                              overwrite=args.force)
    print(f"key id {key.key_id}: private key {private} (mode 0600, keep it secret), public key {public}")
    return 0


def add_trust_arguments(p: argparse.ArgumentParser) -> None:
    """``--trusted-key`` (repeatable) and ``--max-latest-age``."""
    p.add_argument("--trusted-key", dest="trusted_keys", metavar="KEY", action="append", default=None,
                   help="a public key file (PEM or OpenSSH) or OpenSSH line; repeatable (key rotation). Every "
                        "version read must be signed by one of them (default: $DELTASTORE_TRUSTED_KEYS)")
    p.add_argument("--max-latest-age", dest="max_latest_age", metavar="SECONDS", type=float, default=None,
                   help="with --trusted-key: refuse a signed latest older than this (a frozen store or relay)")


def trust_of(args: argparse.Namespace) -> Any:
    """The :class:`~deltastore.signing.Trust` the options give (None: no keys); a usage error for a bad one."""
    from ..errors import SigningKeyError
    from ..signing import Trust, keys_from_env

    keys = args.trusted_keys or keys_from_env()
    if args.max_latest_age is not None and not keys:
        raise UsageError(f"deltastore {args.command}: --max-latest-age needs --trusted-key")
    if not keys:
        return None
    try:
        return Trust(keys)
    except SigningKeyError as e:
        raise CliError(str(e)) from e


def latest_step(args: argparse.Namespace, store: Any) -> int:
    """The step a command without ``--step`` reads: the listing's latest, or with keys the signed latest
    (checked for rollback and, with ``--max-latest-age``, freeze). :class:`CliError` for an empty store."""
    from ..pull.subscriber import Subscriber

    step = Subscriber(store, max_latest_age=args.max_latest_age).latest()
    if step is None:
        raise CliError(f"{args.uri}: no versions")
    return step
