"""The backend conformance suite: what every :class:`~deltastore.backends.Backend` must do.

Use it from pytest by subclassing :class:`BackendConformance` and providing a
``backend`` fixture that returns a fresh, empty backend (and closes it
afterwards)::

    import pytest
    from deltastore.testing import BackendConformance

    class TestMyBackend(BackendConformance):
        @pytest.fixture
        def backend(self, tmp_path):
            b = MyBackend.from_uri(f"my://{tmp_path}")
            yield b
            b.close()

Optional fixtures a subclass may override: ``large_size`` (bytes of the
large-object test, default 64 MiB) and ``racers`` (threads in the create-only
race, default 8). The checks follow the contract in
:mod:`deltastore.backends.base`; the concurrent-create check demands exactly
one winner only when the backend declares ``capabilities.atomic_create``
(otherwise at least one winner, and every loser sees :class:`KeyExistsError`
or succeeds with the value that is finally stored). Each check is a plain
function too (``check_*``), for use outside pytest.
"""

from __future__ import annotations

import hashlib
import threading

import pytest

from ..backends.base import Backend, KeyInfo
from ..errors import InvalidKeyError, KeyExistsError, KeyNotFoundError, ValueTooLargeError

MiB = 1 << 20
ODD_KEYS = [
    "a b/c d.txt", "unicodé/ключ/键", "plus+sign/and=equals&amp", "percent%20/literal%2F",
    "tilde~/x", "dots.in.name/..x", "deep/" + "/".join(f"d{i}" for i in range(12)) + "/leaf",
    "quote'and\"/x", "colon:semicolon;/x", "k" * 200,
]
BAD_KEYS = ["", "/abs", "a//b", "a/../b", "..", "./a", "a/./b", "trailing/", "back\\slash", "nul\x00"]


def _blob(size: int, seed: int = 0) -> bytes:
    """Deterministic incompressible bytes."""
    out = bytearray()
    block = hashlib.sha256(f"{seed}".encode()).digest()
    while len(out) < size:
        block = hashlib.sha256(block).digest()
        out += block * 64  # 2 KiB per hash: fast, and not constant
    return bytes(out[:size])


# -- checks (plain functions) -------------------------------------------------------------
def check_roundtrip(b: Backend) -> None:
    b.put("a/b/c.bin", b"hello")
    assert b.get("a/b/c.bin") == b"hello"
    assert b.exists("a/b/c.bin")
    b.put("a/b/c.bin", b"replaced")  # overwrite is the default
    assert b.get("a/b/c.bin") == b"replaced"
    b.put("a/b/c.bin", b"again", mode="overwrite")
    assert b.get("a/b/c.bin") == b"again"


def check_missing(b: Backend) -> None:
    assert not b.exists("no/such/key")
    with pytest.raises(KeyNotFoundError):
        b.get("no/such/key")
    with pytest.raises(KeyNotFoundError):
        b.get_range("no/such/key", 0, 10)
    with pytest.raises(FileNotFoundError):  # typed, and also the builtin
        b.get("no/such/key")
    b.delete("no/such/key")  # deleting a missing key is not an error


def check_delete(b: Backend) -> None:
    b.put("d/x", b"1")
    b.put("d/y", b"2")
    b.delete("d/x")
    assert not b.exists("d/x")
    with pytest.raises(KeyNotFoundError):
        b.get("d/x")
    assert b.get("d/y") == b"2"
    assert sorted(b.list("d/")) == ["d/y"]


def check_create_only(b: Backend) -> None:
    b.put("versions/1.json", b"first", mode="create")
    with pytest.raises(KeyExistsError):
        b.put("versions/1.json", b"second", mode="create")
    with pytest.raises(FileExistsError):
        b.put("versions/1.json", b"third", mode="create")
    assert b.get("versions/1.json") == b"first"
    b.delete("versions/1.json")
    b.put("versions/1.json", b"after delete", mode="create")
    assert b.get("versions/1.json") == b"after delete"
    with pytest.raises(ValueError):
        b.put("versions/2.json", b"x", mode="append")  # type: ignore[arg-type]


def check_list(b: Backend) -> None:
    assert list(b.list()) == []
    keys = ["objects/sha256/ab/cdef", "objects/sha256/ab/cdff", "objects/sha256/ff/0000",
            "versions/000000000001.json", "versions/000000000002.json", "deltastore.json", "refs/latest"]
    for k in keys:
        b.put(k, k.encode())
    assert sorted(b.list()) == sorted(keys)
    assert sorted(b.list("")) == sorted(keys)
    assert sorted(b.list("objects/")) == sorted(k for k in keys if k.startswith("objects/"))
    assert sorted(b.list("objects/sha256/ab/")) == ["objects/sha256/ab/cdef", "objects/sha256/ab/cdff"]
    assert sorted(b.list("objects/sha256/ab/cd")) == ["objects/sha256/ab/cdef", "objects/sha256/ab/cdff"]
    assert sorted(b.list("versions/0000000000")) == ["versions/000000000001.json", "versions/000000000002.json"]
    assert sorted(b.list("vers")) == ["versions/000000000001.json", "versions/000000000002.json"]
    assert list(b.list("nothing/")) == []
    assert list(b.list("objects/sha256/zz/")) == []


def check_empty_value(b: Backend) -> None:
    b.put("empty", b"")
    assert b.exists("empty")
    assert b.get("empty") == b""
    assert "empty" in list(b.list())
    b.put("empty-create", b"", mode="create")
    with pytest.raises(KeyExistsError):
        b.put("empty-create", b"", mode="create")


def check_ranged_reads(b: Backend) -> None:
    data = _blob(100_000, seed=3)
    b.put("r/blob", data)
    for start, end in [(0, 10), (10, 20), (99_990, 100_000), (0, 100_000), (5, 5), (50_000, 50_001)]:
        assert b.get_range("r/blob", start, end) == data[start:end], (start, end)
    assert b.get_range("r/blob", 99_995, 200_000) == data[99_995:]


def check_large(b: Backend, size: int = 64 * MiB) -> None:
    data = _blob(size, seed=7)
    b.put("large/one", data, mode="create")
    got = b.get("large/one")
    assert len(got) == size and got == data
    if b.capabilities.ranged_reads:
        assert b.get_range("large/one", size - 1000, size) == data[-1000:]
    with pytest.raises(KeyExistsError):
        b.put("large/one", b"small", mode="create")
    assert b.get_range("large/one", 0, 16) == data[:16]


def check_odd_keys(b: Backend) -> None:
    for i, key in enumerate(ODD_KEYS):
        b.put(key, f"value {i}".encode())
    for i, key in enumerate(ODD_KEYS):
        assert b.exists(key), key
        assert b.get(key) == f"value {i}".encode(), key
    assert sorted(b.list()) == sorted(ODD_KEYS)
    for key in ODD_KEYS:
        b.delete(key)
    assert list(b.list()) == []


def check_bad_keys(b: Backend) -> None:
    for key in BAD_KEYS:
        for op in (lambda: b.get(key), lambda: b.put(key, b"x"), lambda: b.exists(key),
                   lambda: b.delete(key), lambda: b.put(key, b"x", mode="create")):
            with pytest.raises(InvalidKeyError):
                op()
    assert list(b.list()) == []


def check_concurrent_creates(b: Backend, racers: int = 8) -> None:
    barrier = threading.Barrier(racers)
    wins: list[int] = []
    losses: list[int] = []
    errors: list[BaseException] = []

    def race(i: int) -> None:
        payload = f"writer {i}".encode()
        barrier.wait()
        try:
            b.put("versions/race.json", payload, mode="create")
            wins.append(i)
        except KeyExistsError:
            losses.append(i)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=race, args=(i,)) for i in range(racers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert len(wins) + len(losses) == racers
    stored = b.get("versions/race.json")
    if b.capabilities.atomic_create:
        assert len(wins) == 1, f"atomic_create declared but {len(wins)} writers won"
        assert stored == f"writer {wins[0]}".encode()
    else:
        assert wins, "no writer won"
        assert stored in {f"writer {i}".encode() for i in wins}


def check_concurrent_writers(b: Backend, writers: int = 8, each: int = 6) -> None:
    """Threads writing distinct keys at once: every value lands intact."""
    def write(i: int) -> None:
        for j in range(each):
            b.put(f"par/{i}/{j}", _blob(1000 + j, seed=i * 100 + j))

    threads = [threading.Thread(target=write, args=(i,)) for i in range(writers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(list(b.list("par/"))) == writers * each
    for i in range(writers):
        for j in range(each):
            assert b.get(f"par/{i}/{j}") == _blob(1000 + j, seed=i * 100 + j)


def check_batch(b: Backend) -> None:
    """``get_many`` / ``put_many`` (every backend has them, the base class's defaults at least), with limits."""
    items = {f"batch/{i:03d}": _blob(500 + i, seed=i) for i in range(40)}
    b.put_many(items)
    assert b.get_many(list(items)) == items
    assert b.get_many(list(items), limits={k: len(v) for k, v in items.items()}) == items
    with pytest.raises(ValueTooLargeError):
        b.get_many(["batch/000", "batch/001"], limits={"batch/001": 10})
    with pytest.raises(KeyExistsError):
        b.put_many({"batch/000": b"other", "batch/new": b"new"}, mode="create")
    assert b.get("batch/000") == items["batch/000"] and b.get("batch/new") == b"new"
    with pytest.raises(KeyNotFoundError):
        b.get_many(["batch/001", "batch/missing"])


def check_bounded(b: Backend) -> None:
    """``get_bounded`` returns values up to the limit and refuses longer ones without reading them."""
    b.put("bounded/small", b"x" * 100)
    b.put("bounded/big", _blob(3 * MiB))
    b.put("bounded/empty", b"")
    assert b.get_bounded("bounded/small", 100) == b"x" * 100
    assert b.get_bounded("bounded/empty", 0) == b""
    assert b.get_bounded("bounded/big", 3 * MiB) == _blob(3 * MiB)
    for key, limit in (("bounded/small", 99), ("bounded/big", 2 * MiB), ("bounded/big", 10)):
        with pytest.raises(ValueTooLargeError):
            b.get_bounded(key, limit)
    with pytest.raises(KeyNotFoundError):
        b.get_bounded("bounded/missing", 10)
    with pytest.raises(ValueError):
        b.get_bounded("bounded/small", -1)


def check_bad_modes(b: Backend) -> None:
    for mode in ("append", "", None, "CREATE"):
        with pytest.raises(ValueError, match="mode must be"):
            b.put("modes/k", b"v", mode=mode)  # type: ignore[arg-type]
    assert not b.exists("modes/k")


def check_stat_touch(b: Backend) -> None:
    """``stat`` gives size and a modification time; ``touch`` keeps the bytes and does not move it back."""
    b.put("st/k", b"12345")
    info = b.stat("st/k")
    assert info.size == 5 and info.mtime > 0
    b.touch("st/k")
    assert b.get("st/k") == b"12345" and b.stat("st/k").mtime >= info.mtime
    with pytest.raises(KeyNotFoundError):
        b.stat("st/missing")
    with pytest.raises(KeyNotFoundError):
        b.touch("st/missing")
    assert not b.exists("st/missing")


def check_conditional_delete(b: Backend) -> None:
    """Where declared: ``delete_if_unmodified`` deletes only what is unchanged since the stat."""
    if not b.capabilities.conditional_delete:
        with pytest.raises(NotImplementedError):
            b.delete_if_unmodified("cd/k", KeyInfo(0, 0.0))
        return
    b.put("cd/k", b"v")
    seen = b.stat("cd/k")
    assert b.delete_if_unmodified("cd/k", seen) and not b.exists("cd/k")
    assert not b.delete_if_unmodified("cd/k", seen)  # gone already
    b.put("cd/k", b"v")
    stale = KeyInfo(seen.size, seen.mtime - 100)
    assert not b.delete_if_unmodified("cd/k", stale) and b.get("cd/k") == b"v"
    assert list(b.list("cd/")) == ["cd/k"]  # nothing left aside


class BackendConformance:
    """pytest mix-in: subclass it and provide a ``backend`` fixture (a fresh, empty backend)."""

    @pytest.fixture
    def backend(self) -> Backend:  # pragma: no cover - must be overridden
        raise NotImplementedError("subclasses provide a `backend` fixture returning a fresh, empty backend")

    @pytest.fixture
    def large_size(self) -> int:
        return 64 * MiB

    @pytest.fixture
    def racers(self) -> int:
        return 8

    def test_roundtrip(self, backend: Backend) -> None:
        check_roundtrip(backend)

    def test_missing_keys(self, backend: Backend) -> None:
        check_missing(backend)

    def test_delete(self, backend: Backend) -> None:
        check_delete(backend)

    def test_create_only(self, backend: Backend) -> None:
        check_create_only(backend)

    def test_list(self, backend: Backend) -> None:
        check_list(backend)

    def test_empty_value(self, backend: Backend) -> None:
        check_empty_value(backend)

    def test_ranged_reads(self, backend: Backend) -> None:
        check_ranged_reads(backend)

    def test_large_object(self, backend: Backend, large_size: int) -> None:
        check_large(backend, large_size)

    def test_odd_keys(self, backend: Backend) -> None:
        check_odd_keys(backend)

    def test_bad_keys(self, backend: Backend) -> None:
        check_bad_keys(backend)

    def test_concurrent_creates(self, backend: Backend, racers: int) -> None:
        check_concurrent_creates(backend, racers)

    def test_concurrent_writers(self, backend: Backend) -> None:
        check_concurrent_writers(backend)

    def test_batch_transfers(self, backend: Backend) -> None:
        check_batch(backend)

    def test_bounded_reads(self, backend: Backend) -> None:
        check_bounded(backend)

    def test_bad_modes(self, backend: Backend) -> None:
        check_bad_modes(backend)

    def test_stat_and_touch(self, backend: Backend) -> None:
        check_stat_touch(backend)

    def test_conditional_delete(self, backend: Backend) -> None:
        check_conditional_delete(backend)

    def test_capabilities(self, backend: Backend) -> None:
        caps = backend.capabilities
        assert isinstance(caps.atomic_create, bool) and isinstance(caps.ranged_reads, bool)
        assert caps.listing, "DeltaStore discovers versions by listing"


# -- read-only backends (http(s)://) ------------------------------------------------------------
def check_read_only(reader: Backend, writer: Backend) -> None:
    """What a writer stores, the reader reads back whole, by range and bounded; overwrites show (a mutable
    ``refs/`` key polled again, conditionally or not); missing keys are :class:`KeyNotFoundError`."""
    data = _blob(100_000, seed=11)
    writer.put("objects/sha256/ab/cd", data)
    writer.put("refs/latest", b"12")
    writer.put("empty", b"")
    assert reader.get("objects/sha256/ab/cd") == data and reader.exists("objects/sha256/ab/cd")
    assert reader.get_bounded("objects/sha256/ab/cd", len(data)) == data
    with pytest.raises(ValueTooLargeError):
        reader.get_bounded("objects/sha256/ab/cd", len(data) - 1)
    for start, end in [(0, 10), (99_990, 100_000), (5, 5), (99_995, 200_000), (100_000, 100_010)]:
        assert reader.get_range("objects/sha256/ab/cd", start, end) == data[start:end], (start, end)
    assert reader.get("empty") == b"" and reader.get_bounded("empty", 0) == b""
    assert reader.stat("objects/sha256/ab/cd").size == len(data)
    assert reader.get("refs/latest") == b"12"
    writer.put("refs/latest", b"13")  # same size, likely the same second: an mtime+size ETag would not change
    assert reader.get("refs/latest") == b"13"
    assert reader.get("refs/latest") == b"13"
    writer.put("refs/latest", b"140")
    assert reader.get_bounded("refs/latest", 100) == b"140"
    assert not reader.exists("no/such/key")
    for op in (lambda: reader.get("no/such/key"), lambda: reader.get_bounded("no/such/key", 10),
               lambda: reader.get_range("no/such/key", 0, 10), lambda: reader.get_range("no/such/key", 3, 3),
               lambda: reader.stat("no/such/key")):
        with pytest.raises(KeyNotFoundError):
            op()
    items = {f"batch/{i:03d}": _blob(500 + i, seed=i) for i in range(20)}
    writer.put_many(items)
    assert reader.get_many(list(items)) == items
    assert reader.get_many(list(items), limits={k: len(v) for k, v in items.items()}) == items
    with pytest.raises(KeyNotFoundError):
        reader.get_many(["batch/001", "batch/missing"])


def check_read_only_large(reader: Backend, writer: Backend, size: int = 64 * MiB) -> None:
    data = _blob(size, seed=7)
    writer.put("large/one", data)
    got = reader.get_bounded("large/one", size)
    assert len(got) == size and got == data
    assert reader.get_range("large/one", size - 1000, size) == data[-1000:]


def check_read_only_odd_keys(reader: Backend, writer: Backend) -> None:
    for i, key in enumerate(ODD_KEYS):
        writer.put(key, f"value {i}".encode())
    for i, key in enumerate(ODD_KEYS):
        assert reader.exists(key), key
        assert reader.get(key) == f"value {i}".encode(), key


def check_read_only_refusals(reader: Backend) -> None:
    """Writes are :class:`ReadOnlyStoreError` (also ``OSError``), listing :class:`ListingUnsupportedError`
    (also ``NotImplementedError``), bad keys :class:`InvalidKeyError`; nothing is sent for any of them."""
    from ..errors import ListingUnsupportedError, ReadOnlyStoreError

    assert not reader.capabilities.listing
    for op in (lambda: reader.put("refs/latest", b"1"), lambda: reader.put("k", b"1", mode="create"),
               lambda: reader.delete("k"), lambda: reader.touch("k"), lambda: reader.put_many({"k": b"1"})):
        with pytest.raises(ReadOnlyStoreError):
            op()
        with pytest.raises(OSError):
            op()
    with pytest.raises(ListingUnsupportedError):
        list(reader.list("versions/"))
    with pytest.raises(NotImplementedError):
        list(reader.list())
    for key in BAD_KEYS:
        with pytest.raises(InvalidKeyError):
            reader.get(key)


class ReadOnlyBackendConformance:
    """pytest mix-in for a backend that reads what another writes (``http(s)://`` in front of a folder or a
    bucket): provide a ``pair`` fixture returning ``(reader, writer)`` over the same, empty storage."""

    @pytest.fixture
    def pair(self) -> tuple[Backend, Backend]:  # pragma: no cover - must be overridden
        raise NotImplementedError("subclasses provide a `pair` fixture: (reader, writer) over the same storage")

    @pytest.fixture
    def large_size(self) -> int:
        return 64 * MiB

    def test_reads(self, pair: tuple[Backend, Backend]) -> None:
        check_read_only(*pair)

    def test_large_object(self, pair: tuple[Backend, Backend], large_size: int) -> None:
        check_read_only_large(*pair, size=large_size)

    def test_odd_keys(self, pair: tuple[Backend, Backend]) -> None:
        check_read_only_odd_keys(*pair)

    def test_refusals(self, pair: tuple[Backend, Backend]) -> None:
        check_read_only_refusals(pair[0])


__all__ = ["BackendConformance", "MiB", "ODD_KEYS", "BAD_KEYS", "check_batch", "check_bad_keys", "check_bad_modes",
           "check_bounded", "check_conditional_delete", "check_stat_touch",
           "check_concurrent_creates", "check_concurrent_writers", "check_create_only", "check_delete",
           "check_empty_value", "check_large", "check_list", "check_missing", "check_odd_keys",
           "check_ranged_reads", "check_roundtrip", "ReadOnlyBackendConformance", "check_read_only",
           "check_read_only_large", "check_read_only_odd_keys", "check_read_only_refusals"]
