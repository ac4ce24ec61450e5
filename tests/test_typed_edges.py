"""Bad inputs at the edges of publish and pull (issue 48): each a typed error naming the problem, the
target's bits unchanged (integer views), nothing stored lost.

* ``publish()`` of malformed ``(name, tensor)`` items and of meta tensors (mapping, iterator, background);
* FP8 quantizing a weight with a NaN or infinity in a 128x128 block;
* pulling into a tensor over a read-only memory mapping (in a child process: without the check the write
  would be a SIGSEGV);
* a full disk while ``materialize`` / ``deltastore pull`` write the folder (a real tmpfs of a few hundred
  KiB, mounted in a child's own mount namespace).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

import deltastore as ds
from deltastore.testing import bits_equal
from deltastore.errors import NonFiniteWeightError, TargetMismatchError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _state(seed: int, n: int = 4096) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"a.weight": torch.randn(n, generator=g).bfloat16(), "b.weight": torch.randn(64, generator=g).bfloat16()}


def _stored(uri: str) -> tuple[list[int], list[str]]:
    store = ds.open_store(uri)
    return store.versions(), sorted(store.list_objects())


_T = torch.zeros(4096, dtype=torch.bfloat16)
_MALFORMED = {
    "a one-item tuple": ([("a.weight",)], r"must be a \(name, tensor\) pair, got \('a.weight',\)"),
    "a three-item tuple": ([("a.weight", _T, 1)], r"must be a \(name, tensor\) pair, got \('a.weight', tensor"),
    "a bare tensor": ([_T], r"must be a \(name, tensor\) pair, got tensor\("),
    "an int": ([5], r"must be a \(name, tensor\) pair, got 5"),
    "a name that is not a string": ([(7, _T)], "tensor names must be strings, got 7"),
    "a value that is not a tensor": ([("a.weight", [1.0])], "'a.weight' is a list, not a tensor"),
    "a meta tensor": ([("a.weight", torch.empty(4096, dtype=torch.bfloat16, device="meta"))],
                      r"'a.weight' is a meta tensor \(no data\): materialize the model"),
}
MODES = ["list", "iterator", "mapping", "background"]
#: every case through every way in, but a mapping, which always gives pairs, only with pairs
MALFORMED_CASES = [(c, m) for c in sorted(_MALFORMED) for m in MODES
                   if m != "mapping" or all(isinstance(i, tuple) and len(i) == 2 for i in _MALFORMED[c][0])]


@pytest.mark.parametrize("case,mode", MALFORMED_CASES)
def test_a_malformed_item_or_a_meta_tensor_is_a_typed_error(tmp_path, case, mode):
    items, message = _MALFORMED[case]
    if mode == "mapping":
        items = dict(items)
    uri = str(tmp_path / "s")
    before = _state(0)
    pub = ds.Publisher(uri, background=mode == "background")
    first = pub.publish(before, step=0)
    if mode == "background":
        first.wait()
    stored = _stored(uri)
    # the whole model, the bad item among good ones (the streamed compare takes an iterator one by one)
    state = [("b.weight", before["b.weight"]), *items] if mode != "mapping" else {"b.weight": before["b.weight"],
                                                                                   **items}
    with pytest.raises(TargetMismatchError, match=message) as e:
        pub.publish(iter(state) if mode == "iterator" else state, step=1)
    assert isinstance(e.value, ValueError)
    pub.close()
    assert _stored(uri) == stored  # nothing committed, nothing lost
    assert bits_equal(ds.Subscriber(uri).pull(step=0).state, before)
    with ds.Publisher(uri) as again:  # the same step publishes once the input is right
        again.publish(_state(1), step=1)
    assert bits_equal(ds.Subscriber(uri).pull(step=1).state, _state(1))


@pytest.mark.parametrize("bad", ["nan", "inf", "-inf"])
@pytest.mark.parametrize("background", [False, True])
def test_fp8_refuses_a_non_finite_weight_naming_the_tensor_and_block(tmp_path, bad, background):
    g = torch.Generator().manual_seed(3)
    ok = {"layer.weight": (torch.randn(300, 260, generator=g) * 0.05).bfloat16(),
          "norm.weight": torch.ones(260, dtype=torch.bfloat16)}
    uri = str(tmp_path / "s")
    pub = ds.Publisher(uri, quantize="fp8_block128", background=background)
    first = pub.publish(ok, step=0)
    if background:
        first.wait()
    stored = _stored(uri)
    hostile = {k: v.clone() for k, v in ok.items()}
    hostile["layer.weight"][200, 130] = float(bad)  # block (1, 1): rows 128-255, columns 128-255
    with pytest.raises(NonFiniteWeightError, match=r"'layer.weight' holds non-finite values: block \(1, 1\) "
                                                   r"\(rows 128-255, columns 128-255\) has "
                                                   + ("1 NaN and 0 infinite" if bad == "nan" else "0 NaN and 1 infinite")
                                                   + r" value\(s\) \(1 of 9 blocks") as e:
        pub.publish(hostile, step=1)
    assert isinstance(e.value, ValueError) and "nothing is published" in str(e.value)
    pub.close()
    assert _stored(uri) == stored
    served = ds.Subscriber(uri).pull(step=0).state
    assert torch.isfinite(served["layer.weight_scale_inv"]).all()
    assert bits_equal(ds.Subscriber(uri).pull(step=0).state, served)


_READ_ONLY_CHILD = r"""
import json, mmap, os, sys, warnings
import numpy as np, torch
import deltastore as ds
from deltastore.errors import TargetMismatchError

uri, kind = sys.argv[1], sys.argv[2]
sub = ds.Subscriber(uri)
want0, want1 = sub.pull(step=0).state, sub.pull(step=1).state
path = os.path.join(os.path.dirname(uri), "weights.bin")
want0["a.weight"].view(torch.int16).numpy().tofile(path)
with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # torch warns that the array is not writable: that is the point
    if kind == "numpy-memmap":
        arr = np.memmap(path, dtype=np.int16, mode="r")
    else:
        f = open(path, "rb")
        arr = np.frombuffer(mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ), dtype=np.int16)
    mapped = torch.from_numpy(arr).view(torch.bfloat16)
target = {"a.weight": mapped, "b.weight": want0["b.weight"].clone()}
before = {k: v.view(torch.int16).clone() for k, v in target.items()}
out = {}
for step in (1, 0):  # a delta's worth of changes, and an anchor into an untracked target
    try:
        sub.pull(target, step=step)
        out[str(step)] = "pulled"
    except TargetMismatchError as e:
        out[str(step)] = str(e)
out["unchanged"] = all(torch.equal(target[k].view(torch.int16), before[k]) for k in before)
copy = {k: v.clone() for k, v in target.items()}
sub.pull(copy, step=1)
out["copy_pulled"] = all(torch.equal(copy[k].view(torch.int16), want1[k].view(torch.int16)) for k in copy)
print(json.dumps(out))
"""


@pytest.mark.parametrize("kind", ["numpy-memmap", "mmap-prot-read"])
def test_pulling_into_a_read_only_mapping_is_refused_before_writing(tmp_path, kind):
    uri = str(tmp_path / "s")
    with ds.Publisher(uri) as pub:
        pub.publish(_state(0), step=0)
        pub.publish(_state(1), step=1)
    stored = _stored(uri)
    proc = subprocess.run([sys.executable, "-c", _READ_ONLY_CHILD, uri, kind], capture_output=True, text=True,
                          timeout=120, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 0, f"child died (status {proc.returncode}): {proc.stderr[-2000:]}"
    out = json.loads(proc.stdout)
    for step in ("1", "0"):
        assert out[step].startswith("target tensor 'a.weight' lies in read-only memory"), out
        assert f"writing version {step} into it would crash the process" in out[step]
    assert out["unchanged"] and out["copy_pulled"], out
    assert _stored(uri) == stored


_FULL_DISK_CHILD = r"""
set -e
mount -t tmpfs -o size={size}k tmpfs "{mnt}"
exec "{python}" - <<'EOF'
import json, os, shutil, sys
import torch
import deltastore as ds
from deltastore.cli import main
from deltastore.errors import OutputWriteError
from deltastore.pull.materialize import materialize
from safetensors.torch import load_file

uri, mnt = {uri!r}, {mnt!r}
store = ds.open_store(uri)
out = {{}}
for how in ("materialize", "cli"):
    folder = os.path.join(mnt, how)
    materialize(store, 0, folder)  # version 0 fits
    before = {{f: open(os.path.join(folder, f), "rb").read() for f in sorted(os.listdir(folder))}}
    if how == "materialize":
        try:
            materialize(store, 1, folder)  # version 1 does not fit beside it
            out[how] = "written"
        except OutputWriteError as e:
            out[how] = [type(e).__name__, e.errno, str(e), isinstance(e, OSError)]
    else:
        rc = main(["pull", uri, folder, "--step", "1"])
        out[how] = ["exit", rc]
    after = {{f: open(os.path.join(folder, f), "rb").read() for f in sorted(os.listdir(folder))}}
    out[how + "_kept"] = before == after
    out[how + "_left"] = sorted(os.listdir(mnt))
    out[how + "_bits"] = {{k: int(v.view(torch.int16).sum())
                          for k, v in load_file(os.path.join(folder, "model.safetensors")).items()}}
    shutil.rmtree(folder)  # (nothing maps it any more: the space is free for the next round)
print(json.dumps(out))
EOF
"""


def test_a_full_disk_while_writing_a_folder_is_typed_and_keeps_the_old_one(tmp_path):
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare (util-linux) to mount a small tmpfs in a mount namespace of its own")
    probe = subprocess.run(["unshare", "-rm", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"user and mount namespaces are not available here: {probe.stderr.decode()[-200:]}")
    uri = str(tmp_path / "s")
    states = [_state(0, n=60_000), _state(1, n=60_000)]  # 120 KB of weights each
    with ds.Publisher(uri) as pub:
        for k, s in enumerate(states):
            pub.publish(s, step=k)
    stored = _stored(uri)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    script = _FULL_DISK_CHILD.format(size=200, mnt=str(mnt), python=sys.executable, uri=uri)
    proc = subprocess.run(["unshare", "-rm", "sh", "-c", script], capture_output=True, text=True, timeout=300,
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    kind, code, message, is_os_error = out["materialize"]
    assert kind == "OutputWriteError" and code == 28 and is_os_error, out
    assert "writing version 1 to" in message and "No space left on device" in message
    assert "the folder keeps the files it held" in message
    assert out["cli"] == ["exit", 1] and "OutputWriteError" in proc.stderr and "No space left" in proc.stderr
    for how in ("materialize", "cli"):
        assert out[how + "_kept"] and out[how + "_left"] == [how], out  # the old folder, nothing half-written
        assert out[how + "_bits"] == {k: int(v.view(torch.int16).sum()) for k, v in states[0].items()}
    assert _stored(uri) == stored
