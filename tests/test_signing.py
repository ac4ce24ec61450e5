"""Signed versions: keys and keygen, the signed bytes as docs/format.md defines them, what old readers and the
store's tools do with them, the CLI, the verl adapter, and that a private key never reaches the store or a log.

The hostile-store cases (tampering, rollback, freeze, rotation; local disk and S3) are in
``tests/test_backends/test_signed.py``.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import pickle
import subprocess
import sys

import pytest
import torch

pytest.importorskip("cryptography")

import deltastore as ds  # noqa: E402
from deltastore.cli import main  # noqa: E402
from deltastore.errors import (ManifestError, MissingDependencyError, SigningKeyError,  # noqa: E402
                               UnsignedVersionError, UntrustedKeyError)
from deltastore.manifest import Manifest  # noqa: E402
from deltastore.signing import (SigningKey, Trust, generate_key_files, load_signing_key,  # noqa: E402
                                load_verify_key, sign_document)
from deltastore.store import version_key  # noqa: E402


def _states(n: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    st = {"w": torch.randn(32, 32, generator=g).bfloat16()}
    out = []
    for i in range(n):
        st = {"w": st["w"].clone()}
        st["w"][i % 32, :4] += 1
        out.append(st)
    return out


def _publish(uri: str, key, n: int = 4, **kw) -> list[dict[str, torch.Tensor]]:
    vs = _states(n)
    with ds.Publisher(uri, signing_key=key, anchor_every=3, **kw) as pub:
        for i, st in enumerate(vs):
            pub.publish(st, step=i)
    return vs


# -- keys ------------------------------------------------------------------------------------------------
def test_keygen_writes_0600_at_creation_and_loadable_keys(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(os, "chmod", lambda *a, **k: calls.append(a))
    monkeypatch.setattr(os, "fchmod", lambda *a, **k: calls.append(a))
    old = os.umask(0)  # the mode comes from the creating open() alone, whatever the umask lets through
    try:
        key, priv, pub = generate_key_files(tmp_path / "k")
        _, _, pub_ssh = generate_key_files(tmp_path / "k2", public_format="openssh")
    finally:
        os.umask(old)
    assert calls == []
    assert os.stat(priv).st_mode & 0o777 == 0o600
    assert os.stat(pub).st_mode & 0o777 == 0o644
    assert open(priv, "rb").read().startswith(b"-----BEGIN PRIVATE KEY-----")  # PEM PKCS8
    assert open(pub, "rb").read().startswith(b"-----BEGIN PUBLIC KEY-----")
    assert open(pub_ssh, "rb").read().startswith(b"ssh-ed25519 ")
    assert load_signing_key(priv).key_id == key.key_id == load_verify_key(pub).key_id
    assert load_verify_key(open(pub_ssh).read()).key_id == load_verify_key(tmp_path / "k2.pub").key_id
    with pytest.raises(SigningKeyError, match="exists"):
        generate_key_files(tmp_path / "k")
    assert load_signing_key(priv).key_id == key.key_id  # untouched by the refusal
    again, _, _ = generate_key_files(tmp_path / "k", overwrite=True)
    assert again.key_id != key.key_id and os.stat(priv).st_mode & 0o777 == 0o600


def test_bad_keys_are_typed(tmp_path):
    key = SigningKey.generate()
    (tmp_path / "priv").write_bytes(key.private_pem())
    (tmp_path / "junk").write_text("-----BEGIN PUBLIC KEY-----\nnot base64\n-----END PUBLIC KEY-----\n")
    with pytest.raises(SigningKeyError, match="private key"):
        load_verify_key(tmp_path / "priv")  # a private key given as trusted: the hint says so
    with pytest.raises(SigningKeyError, match="junk"):
        load_verify_key(tmp_path / "junk")
    with pytest.raises(SigningKeyError, match="missing"):
        load_signing_key(tmp_path / "missing")
    with pytest.raises(SigningKeyError):
        load_signing_key(tmp_path / "junk")
    with pytest.raises(ValueError, match="empty"):
        ds.Subscriber(str(tmp_path / "s"), trusted_keys=[])
    with pytest.raises(ValueError, match="needs trusted_keys"):
        ds.Subscriber(str(tmp_path / "s"), max_latest_age=60)
    with pytest.raises(TypeError, match="picklable"):
        pickle.dumps(key)
    assert key.key_id in repr(key) and "PRIVATE" not in repr(key)
    from cryptography.hazmat.primitives import serialization  # an ssh-keygen -t ed25519 key (no passphrase)
    (tmp_path / "id_ed25519").write_bytes(key._key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption()))
    assert load_signing_key(tmp_path / "id_ed25519").key_id == key.key_id


def test_missing_cryptography_is_typed(monkeypatch, tmp_path):
    for name in ("cryptography", "cryptography.hazmat.primitives", "cryptography.exceptions",
                 "cryptography.hazmat.primitives.asymmetric"):
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(MissingDependencyError, match=r"deltastore\[sign\]"):
        ds.Publisher(str(tmp_path / "s"), signing_key=str(tmp_path / "k"))
    out = subprocess.run([sys.executable, "-c", "import sys, deltastore, deltastore.cli, deltastore.signing; "
                          "print('cryptography' in sys.modules)"], capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=os.getcwd()))
    assert out.stdout.strip() == "False", out.stderr  # imported only when a key is used


# -- the signed bytes -------------------------------------------------------------------------------------
def test_signature_is_over_the_stored_bytes_with_zeroed_digits(tmp_path):
    """docs/format.md's rule, checked with cryptography directly: no re-serialisation involved."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    key = SigningKey.generate()
    uri = str(tmp_path / "s")
    _publish(uri, key)
    data = open(os.path.join(uri, version_key(3)), "rb").read()
    doc = json.loads(data)
    assert doc["format_version"] == "1.4" and doc["signature"]["alg"] == "ed25519"
    assert doc["signature"]["key_id"] == key.key_id
    sig = doc["signature"]["sig"]
    signed = data.replace(f'"sig":"{sig}"'.encode(), f'"sig":"{"0" * 128}"'.encode())
    Ed25519PublicKey.from_public_bytes(key.public.raw).verify(bytes.fromhex(sig), signed)  # raises if not
    # a reader that does not check signatures (a 1.3 reader ignores the field) reads it as before
    m = Manifest.from_json(data, layouts=ds.open_store(uri)._read_object)
    assert m.step == 3 and m.signed_by == key.key_id
    latest = json.loads(open(os.path.join(uri, "refs", "latest"), "rb").read())
    assert latest["format"] == "deltastore.latest" and latest["step"] == 3
    assert Trust([key.public]).check_latest(open(os.path.join(uri, "refs", "latest"), "rb").read()).step == 3


def test_signing_refuses_metadata_that_repeats_the_placeholder():
    key = SigningKey.generate()
    with pytest.raises(ManifestError, match="metadata repeats"):
        sign_document({"metadata": {"x": {"sig": "0" * 128}}}, key)


def test_moved_signature_is_refused():
    """The unique-pattern rule: a copy of the signature elsewhere makes the document unverifiable."""
    key = SigningKey.generate()
    data = sign_document({"step": 1, "metadata": {}}, key)
    sig = json.loads(data)["signature"]["sig"]
    forged = data.replace(b'"metadata":{}', b'"metadata":{"sig":"' + sig.encode() + b'"}')
    with pytest.raises(ds.errors.SignatureError):
        Trust([key.public]).check(forged, json.loads(forged), "version 1", 1)


def test_gc_ls_and_retention_work_on_a_signed_store(tmp_path, capsys, monkeypatch):
    key = SigningKey.generate()
    uri = str(tmp_path / "s")
    vs = _states(8)
    import deltastore.store

    monkeypatch.setattr(deltastore.store, "REFRESH_WINDOW", 0.0)  # so that a grace of 0 is allowed
    with ds.Publisher(uri, signing_key=key, anchor_every=3, retention=ds.gc.Retention(keep_last=3),
                      gc_grace=0) as pub:
        for i, st in enumerate(vs):
            pub.publish(st, step=i)
    assert main(["ls", uri]) == 0
    assert main(["gc", uri, "--keep-last", "2", "--grace", "0"]) == 0
    sub = ds.Subscriber(uri, trusted_keys=[key.public])
    res = sub.pull()
    assert res.step == 7 and torch.equal(res.state["w"].view(torch.int16), vs[7]["w"].view(torch.int16))
    capsys.readouterr()
    pub_path = tmp_path / "k.pub"
    pub_path.write_bytes(key.public.pem())
    assert main(["verify", uri, "--trusted-key", str(pub_path)]) == 0
    out = capsys.readouterr().out
    assert f"signed by key {key.key_id} (verified)" in out and "0 problems" in out


# -- CLI -----------------------------------------------------------------------------------------------------
def test_cli_keygen_pull_and_verify(tmp_path, capsys):
    priv, other = str(tmp_path / "k"), str(tmp_path / "o")
    assert main(["keygen", priv, "--public-format", "openssh"]) == 0
    assert main(["keygen", other]) == 0
    assert main(["keygen", priv]) == 1  # exists
    out = capsys.readouterr()
    assert "exists" in out.err and out.err.count("\n") == 1
    uri = str(tmp_path / "s")
    vs = _publish(uri, priv)
    assert main(["pull", uri, str(tmp_path / "out"), "--trusted-key", priv + ".pub"]) == 0
    from safetensors.torch import load_file
    assert torch.equal(load_file(str(tmp_path / "out" / "model.safetensors"))["w"].view(torch.int16),
                       vs[3]["w"].view(torch.int16))
    capsys.readouterr()
    assert main(["pull", uri, str(tmp_path / "out2"), "--trusted-key", other + ".pub"]) == 1
    err = capsys.readouterr().err
    assert "UntrustedKeyError" in err and load_verify_key(priv + ".pub").key_id in err and err.count("\n") == 1
    assert not (tmp_path / "out2").exists()
    assert main(["pull", uri, str(tmp_path / "out3"), "--max-latest-age", "5"]) == 2  # needs --trusted-key
    capsys.readouterr()
    assert main(["verify", uri, "--json", "--trusted-key", other + ".pub"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert not doc["ok"] and all("UntrustedKeyError" in p["message"] or "not trusted" in p["message"]
                                 for p in doc["problems"])
    assert main(["verify", uri, "--json", "--trusted-key", priv + ".pub", "--trusted-key", other + ".pub"]) == 0
    doc = json.loads(capsys.readouterr().out)
    kid = load_verify_key(priv + ".pub").key_id
    assert doc["ok"] and doc["signers"] == [{"step": s, "key_id": kid, "verified": True} for s in range(4)]


def test_private_key_never_stored_or_logged(tmp_path, caplog, capsys):
    from cryptography.hazmat.primitives import serialization

    priv = str(tmp_path / "k")
    assert main(["keygen", priv]) == 0
    key = load_signing_key(priv)
    raw = key._key.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                                 serialization.NoEncryption())
    pem = open(priv, "rb").read()
    secrets = [raw, raw.hex().encode(), base64.b64encode(raw), pem, pem.split(b"\n")[1]]
    uri = str(tmp_path / "s")
    caplog.set_level(logging.DEBUG, logger="deltastore")
    _publish(uri, priv)
    with ds.Publisher(uri, signing_key=priv, background=True) as pub:  # the background writer too
        pub.publish(_states(6)[5], step=4).wait()
        pub.refresh_latest()
    assert main(["-vv", "verify", uri, "--trusted-key", priv + ".pub"]) == 0
    assert main(["-vv", "pull", uri, str(tmp_path / "out"), "--trusted-key", priv + ".pub"]) == 0
    captured = capsys.readouterr()
    logged = (caplog.text + captured.out + captured.err).encode()
    stored = [p for p in (tmp_path / "s").rglob("*") if p.is_file()]
    assert any("versions" in str(p) for p in stored) and any("objects" in str(p) for p in stored)
    for s in secrets:
        assert s not in logged
        for p in stored:
            assert s not in p.read_bytes(), p


# -- adapters ------------------------------------------------------------------------------------------------
def test_trl_transfer_passes_keys_to_its_control(tmp_path):
    from deltastore.integrations.trl_transfer import DeltaStoreWeightTransfer

    key = SigningKey.generate()
    applied = []

    class Control:
        def pause(self): pass
        def resume(self): pass
        def reset_prefix_cache(self): pass
        def set_version(self, label): pass

        def apply(self, uri, step, storage_options, trusted_keys=None):
            applied.append(trusted_keys)
            sub = ds.Subscriber(uri, trusted_keys=trusted_keys)
            return sub.pull(step=step).step

    wt = DeltaStoreWeightTransfer(str(tmp_path / "s"), control=Control(), signing_key=key)
    wt.init_weight_transfer()
    wt.send_weights(iter(_states(1)[0].items()))
    assert len(applied) == 1 and load_verify_key(applied[0][0]).key_id == key.key_id
    other = SigningKey.generate()
    wt2 = DeltaStoreWeightTransfer(str(tmp_path / "s"), control=Control(), trusted_keys=[other.public])
    with pytest.raises(UnsignedVersionError):  # an unsigned publisher: the server's keys refuse its version
        wt2.send_weights(iter(_states(2)[1].items()))
    assert load_verify_key(applied[-1][0]).key_id == other.key_id
