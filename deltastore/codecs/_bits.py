"""Vectorised integer coding shared by the built-in sparse codecs.

Everything here works on whole numpy arrays: no Python loop runs per element.

* ``ordered`` / ``unordered``: a bijection between raw bits and integers that
  preserves the order of float values (sign-magnitude to two's complement), so
  a change of one ulp is a difference of one.
* ``uvarint`` helpers: unsigned LEB128 (7 bits per byte, low group first,
  high bit = "more bytes follow").
* ``BitWriter`` / ``BitReader``: two bit streams, a *unary* stream U and a
  *raw* stream R, both packed most-significant bit first with zero padding.
  An integer sequence is coded with one of three kinds:

  - RICE(k): ``q = v >> k`` as ``q`` zero bits then a one bit in U; the low
    ``k`` bits of ``v`` in R.
  - EG(k) (Exp-Golomb of order k): ``u = v + 2**k``, ``L = bit_length(u) - 1``;
    ``L - k`` zero bits then a one bit in U; the low ``L`` bits of ``u`` in R.
  - FIXED(w): nothing in U; ``v`` as ``w`` bits in R.

All decoding errors raise :class:`CorruptObjectError`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import CorruptObjectError
from ..kernels import bitstream as K

RICE, EG, FIXED = 0, 1, 2
MAX_WIDTH = 64
_U64 = np.uint64


# -- ordered integers ------------------------------------------------------------------
def signed_view(bits: np.ndarray) -> np.ndarray:
    """The same bits as a signed integer array of the same width."""
    return bits.view({1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}[bits.dtype.itemsize])


def ordered(bits: np.ndarray, is_float: bool) -> np.ndarray:
    """int64 order-preserving image of raw bits (floats: sign-magnitude -> two's complement).

    For floats ``x >= 0`` maps to itself and a negative pattern ``x`` (sign bit
    set, magnitude ``m``) maps to ``-m - 1``, so ``-0.0 -> -1`` and ``+0.0 -> 0``.
    Integers map to their signed value (``uint8``/``bool`` bits to 0..255); 8-bit floats
    (``float8_e4m3fn``, as ``uint8`` bits) take the float mapping.
    """
    if bits.dtype == np.uint8 and not is_float:
        return bits.astype(np.int64)
    x = signed_view(bits).astype(np.int64)
    if not is_float:
        return x
    width = bits.dtype.itemsize * 8
    if width == 64:
        return np.where(x < 0, ~(x & np.int64(0x7FFFFFFFFFFFFFFF)), x)
    mag = x & ((1 << (width - 1)) - 1)
    return np.where(x < 0, ~mag, mag)


def unordered(o: np.ndarray, bits_dtype: np.dtype, is_float: bool) -> np.ndarray:
    """Inverse of :func:`ordered`; raises :class:`CorruptObjectError` when ``o`` is out of range."""
    bits_dtype = np.dtype(bits_dtype)
    width = bits_dtype.itemsize * 8
    if bits_dtype == np.uint8 and not is_float:
        if o.size and (int(o.min()) < 0 or int(o.max()) > 255):
            raise CorruptObjectError("decoded value out of range for an 8-bit dtype")
        return o.astype(np.uint8)
    if width < 64 and o.size:
        lo, hi = -(1 << (width - 1)), (1 << (width - 1)) - 1
        if int(o.min()) < lo or int(o.max()) > hi:
            raise CorruptObjectError(f"decoded value out of range for a {width}-bit dtype")
    if is_float:
        if width == 64:
            x = np.where(o < 0, (~o) | np.int64(-0x8000000000000000), o)
        else:
            x = np.where(o < 0, (~o) | np.int64(-(1 << (width - 1))), o)
    else:
        x = o
    return x.astype(signed_view(np.empty(0, bits_dtype)).dtype).view(bits_dtype)


# -- LEB128 -----------------------------------------------------------------------------
def uvarint_encode(values: np.ndarray) -> bytes:
    """Concatenated unsigned LEB128 of ``values`` (uint64-convertible)."""
    return K.uvarint_encode(np.asarray(values, dtype=np.uint64))


def uvarint_decode(data: bytes | np.ndarray, count: int) -> tuple[np.ndarray, int]:
    """First ``count`` LEB128 values of ``data`` as uint64, and the bytes they used.

    Raises :class:`CorruptObjectError` if ``data`` holds fewer values or a value
    is longer than 10 bytes.
    """
    if count == 0:
        return np.zeros(0, dtype=np.uint64), 0
    values, decoded, used = K.uvarint_decode(data, count)
    if decoded < 0:
        raise CorruptObjectError("varint longer than 10 bytes")
    if decoded < count:
        raise CorruptObjectError(f"varint stream holds {decoded} values, {count} expected")
    return values, used


# -- unary + raw bit streams -------------------------------------------------------------
def bit_length(v: np.ndarray) -> np.ndarray:
    """Bit length of each uint64 (0 -> 0), int64 result."""
    v = v.astype(np.uint64)
    out = np.zeros(v.shape, dtype=np.int64)
    hi = (v >> _U64(32)).astype(np.uint64)
    big = hi != 0
    lo32 = np.where(big, hi, v & _U64(0xFFFFFFFF))
    # float64 holds 32-bit integers exactly: frexp gives the bit length
    _, exp = np.frexp(lo32.astype(np.float64))
    out = exp.astype(np.int64) + np.where(big, 32, 0)
    return np.where(v == 0, 0, out)


@dataclass(frozen=True)
class Kind:
    """How one integer sequence is coded: ``kind`` (RICE, EG, FIXED) and parameter ``k``."""

    kind: int
    k: int

    def code(self) -> int:
        return self.k * 4 + self.kind

    @staticmethod
    def parse(code: int) -> Kind:
        kind, k = code % 4, code // 4
        if kind > FIXED or k > MAX_WIDTH:
            raise CorruptObjectError(f"bad sequence kind code {code}")
        return Kind(kind, k)


def best_kind(v: np.ndarray) -> tuple[Kind, int]:
    """The cheapest RICE/EG kind for ``v`` (uint64) and its exact cost in bits.

    Ties go to the first kind tried (RICE by increasing ``k``, then EG by increasing ``k``).
    """
    if v.size == 0:
        return Kind(RICE, 0), 0
    v = np.ascontiguousarray(v, dtype=np.uint64)
    n = v.size
    maxbits = int(v.max()).bit_length()
    kr = min(maxbits, 63)
    ke = min(maxbits, 40) if maxbits < 62 else -1
    rice, rice_f, eg = K.kind_sums(v, kr, ke)
    best: tuple[Kind, int | None] = (Kind(EG, 0), None)
    for k in range(kr + 1):
        if float(rice_f[k]) > 2.0**40:
            continue  # absurd unary length: never the cheapest
        cost = int(rice[k]) + n * (k + 1)
        if best[1] is None or cost < best[1]:
            best = (Kind(RICE, k), cost)
    for k in range(ke + 1):  # cost of EG(k): sum over values of 2 * L - k + 1
        cost = 2 * int(eg[k]) - n * (k - 1)
        if best[1] is None or cost < best[1]:
            best = (Kind(EG, k), cost)
    assert best[1] is not None
    return best  # type: ignore[return-value]


def split(v: np.ndarray, kind: Kind) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(unary quotients, raw widths, raw values) of ``v`` under ``kind``; quotients -1 = no unary part."""
    v = v.astype(np.uint64)
    if kind.kind == RICE:
        return ((v >> _U64(kind.k)).astype(np.int64), np.full(v.size, kind.k, np.int64),
                v & _U64((1 << kind.k) - 1))
    if kind.kind == EG:
        u = v + _U64(1 << kind.k)
        L = bit_length(u) - 1
        return L - kind.k, L, u - (_U64(1) << L.astype(np.uint64))
    return np.full(v.size, -1, np.int64), np.full(v.size, kind.k, np.int64), v


def join(q: np.ndarray, r: np.ndarray, kind: Kind) -> np.ndarray:
    """Inverse of :func:`split` (uint64)."""
    if kind.kind == RICE:
        return (q.astype(np.uint64) << _U64(kind.k)) | r
    if kind.kind == EG:
        L = (q + kind.k).astype(np.uint64)
        return ((_U64(1) << L) + r) - _U64(1 << kind.k)
    return r


def widths(q: np.ndarray, kind: Kind) -> np.ndarray:
    """Raw widths of a sequence given its decoded quotients."""
    if kind.kind == EG:
        return q + kind.k
    return np.full(q.size, kind.k, np.int64)


def pack_unary(q: np.ndarray) -> bytes:
    """U stream: each q as q zero bits then a one bit, MSB first."""
    return K.pack_unary(q)


def unpack_unary(data: bytes, count: int) -> np.ndarray:
    """First ``count`` quotients of a U stream (int64)."""
    q, found = K.unpack_unary(data, count)
    if found < count:
        raise CorruptObjectError(f"unary stream holds {found} codes, {count} expected")
    return q


def pack_raw(w: np.ndarray, r: np.ndarray) -> bytes:
    """R stream: each r as w bits, MSB first (w <= 64)."""
    return K.pack_raw(w, r)


def unpack_raw(data: bytes, w: np.ndarray) -> np.ndarray:
    """Values of widths ``w`` read in order from an R stream (uint64)."""
    w = w.astype(np.int64)
    if w.size == 0:
        return np.zeros(0, np.uint64)
    if int(w.min()) < 0 or int(w.max()) > MAX_WIDTH:
        raise CorruptObjectError("raw field width out of range")
    total = int(w.sum())
    if total > len(data) * 8:
        raise CorruptObjectError(f"raw stream holds {len(data) * 8} bits, {total} needed")
    return K.unpack_raw(data, w)
