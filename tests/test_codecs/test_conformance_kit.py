"""The codec conformance kit fails codecs that break the contract, each check with a message naming the break."""

from __future__ import annotations

import time

import pytest
import torch
import zstandard
from safetensors.torch import load

from deltastore.codecs import register_codec
from deltastore.codecs._safetensors import pack_sorted
from deltastore.codecs.ctx import CtxCodec
from deltastore.codecs.raw import RawCodec
from deltastore.errors import CorruptObjectError
from deltastore.registry import codecs as codec_registry
from deltastore.testing import codecs as kit

FAILED = (AssertionError, pytest.fail.Exception)


def _with_metadata(data: bytes, **extra: str) -> bytes:
    """The object with more metadata, its bytes depending on its contents alone (safetensors' own ``save``
    orders the header at random)."""
    return pack_sorted(load(data), {"deltastore.codec": "raw", "deltastore.codec_version": "1.0", **extra})


class QuietsNaNs(RawCodec):
    """Decodes bf16 through float32: NaN payloads come back as the canonical NaN."""

    codec_id = "kit-quiets-nans"

    def decode(self, data, specs, old=None):
        out = super().decode(data, specs, old)
        for s in specs:
            if s.dtype == torch.bfloat16:
                out[s.name].bits = out[s.name].bits.view(torch.bfloat16).float().to(torch.bfloat16).view(torch.int16)
        return out


class AsksForOldBits(RawCodec):
    """Declares that it needs nothing from the receiver, and asks for the old bits."""

    codec_id = "kit-asks"

    def decode(self, data, specs, old=None):
        out = super().decode(data, specs, old)
        for s in specs:
            old(s.name, out[s.name].positions)
        return out


class WritesIntoTheOldTensor(CtxCodec):
    codec_id = "kit-writes-old"

    def decode(self, data, specs, old=None):
        out = super().decode(data, specs, old)
        for s in specs:
            if s.numel:
                old(s.name, None)[0] ^= 1
        return out


class WritesIntoItsInput(RawCodec):
    codec_id = "kit-writes-input"

    def encode(self, updates):
        data = super().encode(updates)
        for u in updates:
            u.bits[:1] ^= 1
        return data


class BatchDropsATensor(RawCodec):
    codec_id = "kit-drops"

    def decode_batch(self, data, specs, old=None):
        return super().decode_batch(data, list(specs)[:-1], old) if len(specs) > 1 else \
            super().decode_batch(data, specs, old)


class BatchWritesOtherBytes(RawCodec):
    codec_id = "kit-batch-bytes"

    def encode_batch(self, batch):
        return _with_metadata(super().encode_batch(batch), path="batch")


class Unstable(RawCodec):
    codec_id = "kit-unstable"

    def encode(self, updates):
        return _with_metadata(super().encode(updates), made=str(time.perf_counter_ns()))


class HashSeedDependent(RawCodec):
    """Writes the tensor names in set order, which follows the interpreter's hash seed."""

    codec_id = "kit-hash-seed"

    def encode(self, updates):
        return _with_metadata(super().encode(updates), names=",".join({u.spec.name for u in updates}))


class Overestimates(RawCodec):
    codec_id = "kit-over"

    def estimate_size(self, spec, changed):
        return 10 * super().estimate_size(spec, changed)


class NegativeEstimate(RawCodec):
    codec_id = "kit-negative"

    def estimate_size(self, spec, changed):
        return super().estimate_size(spec, changed) if changed else -1


class TupleConfig(RawCodec):
    codec_id = "kit-tuple"

    def __init__(self, levels=(1, 2)):
        self.levels = levels

    def get_config(self):
        return {"levels": self.levels}


class IgnoresUnknownOptions(RawCodec):
    codec_id = "kit-lax"

    @classmethod
    def from_config(cls, config):
        return cls()


class UntypedOnShortInput(RawCodec):
    codec_id = "kit-untyped"

    def decode(self, data, specs, old=None):
        if len(data) < 64:
            raise IndexError("short input")
        return super().decode(data, specs, old)


class HangsOnBadInput(RawCodec):
    codec_id = "kit-hangs"

    def decode(self, data, specs, old=None):
        try:
            return super().decode(data, specs, old)
        except CorruptObjectError:
            time.sleep(2)
            raise


class InflatesWithoutLimit(RawCodec):
    """Stores the raw object as one zstd frame, and decompresses whatever frame it meets, however large."""

    codec_id = "kit-inflates"

    def encode(self, updates):
        z = zstandard.ZstdCompressor().compress(super().encode(updates))
        return pack_sorted({"z": torch.frombuffer(bytearray(z), dtype=torch.uint8)}, {})

    def decode(self, data, specs, old=None):
        try:
            z = load(data)["z"].numpy().tobytes()
            inner = zstandard.ZstdDecompressor().decompressobj().decompress(z)
        except Exception as e:
            raise CorruptObjectError(str(e)) from e
        return super().decode(inner, specs, old)


class SkipsTensorsItLacks(RawCodec):
    """Decodes the tensors of the specs the object holds, and silently leaves out the others."""

    codec_id = "kit-skips"

    def decode(self, data, specs, old=None):
        try:
            held = {k.rsplit(".", 1)[0] for k in load(data)}
        except Exception as e:
            raise CorruptObjectError(str(e)) from e
        return super().decode(data, [s for s in specs if s.name in held], old)


class NotSafetensors(RawCodec):
    codec_id = "kit-not-safetensors"

    def encode(self, updates):
        return b"MYFORMAT" + super().encode(updates)

    def decode(self, data, specs, old=None):
        return super().decode(data[8:], specs, old)


@pytest.fixture
def registered(request):
    cls = request.param
    register_codec(cls.codec_id, cls)
    yield cls()
    codec_registry.unregister(cls.codec_id)


def _fails(check, match):
    with pytest.raises(FAILED, match=match):
        check()


def test_lost_nan_payloads_fail_the_round_trip():
    _fails(lambda: kit.check_edge_values(QuietsNaNs(), torch.bfloat16), "bfloat16 transitions: decode: 'edges'")
    kit.check_edge_values(QuietsNaNs(), torch.float32)  # other dtypes untouched


def test_asking_more_than_receiver_needs_fails():
    _fails(lambda: kit.check_mixed_object(AsksForOldBits()), "asked for old bits .* receiver_needs='nothing'")


def test_writing_into_the_old_tensor_or_the_input_fails():
    _fails(lambda: kit.check_mixed_object(WritesIntoTheOldTensor()), "modified the receiver's old")
    _fails(lambda: kit.check_mixed_object(WritesIntoItsInput()), "encode modified the input's bits")


def test_batch_paths_that_disagree_fail():
    _fails(lambda: kit.check_random(BatchDropsATensor(), torch.bfloat16), "did not return every tensor")
    _fails(lambda: kit.check_random(BatchWritesOtherBytes(), torch.bfloat16), "encode_batch wrote other bytes")


@pytest.mark.parametrize("registered", [Unstable], indirect=True)
def test_unstable_bytes_fail(registered):
    _fails(lambda: kit.check_byte_stable(registered, fresh_process=False), "two encodes of one input differ")


@pytest.mark.parametrize("registered", [HashSeedDependent], indirect=True)
def test_bytes_that_follow_the_hash_seed_fail_in_a_fresh_process(registered):
    kit.check_byte_stable(registered, fresh_process=False)  # one interpreter cannot tell
    _fails(lambda: kit.check_fresh_process([registered]), "other bytes in a fresh interpreter")


def test_bad_estimates_fail():
    _fails(lambda: kit.check_estimate(Overestimates(), kit.representative_changes()), "not within 2.0x")
    _fails(lambda: kit.check_estimate(NegativeEstimate(), kit.representative_changes()), "= -1")


@pytest.mark.parametrize("registered", [TupleConfig], indirect=True)
def test_a_config_that_is_not_json_fails(registered):
    _fails(lambda: kit.check_config(registered), "not plain JSON")


@pytest.mark.parametrize("registered", [IgnoresUnknownOptions], indirect=True)
def test_a_config_reader_that_ignores_unknown_options_fails(registered):
    _fails(lambda: kit.check_config(registered), "DID NOT RAISE")


def test_untyped_errors_and_hangs_fail():
    _fails(lambda: kit.check_refuses_bad_objects(UntypedOnShortInput()), "untyped IndexError")
    _fails(lambda: kit.check_refuses_bad_objects(HangsOnBadInput(), deadline=0.5), "did not finish within 0.5 s")


def test_a_decompression_bomb_fails_on_memory():
    _fails(lambda: kit.check_hostile_objects(InflatesWithoutLimit()), "zstd bomb .* grew memory by 6[0-9].[0-9] MiB")


def test_leaving_out_a_tensor_the_manifest_names_fails():
    kit.check_mixed_object(SkipsTensorsItLacks())
    _fails(lambda: kit.check_hostile_objects(SkipsTensorsItLacks()), "with one tensor renamed: returned")


def test_objects_that_are_not_safetensors_fail():
    kit.check_roundtrip(NotSafetensors(), kit.mixed_case())
    _fails(lambda: kit.check_safetensors(NotSafetensors()), "not a safetensors file")


def test_unregistered_codecs_and_missing_entry_points_fail():
    _fails(lambda: kit.check_registered(Unstable()), "'kit-unstable' is not registered")
    _fails(lambda: kit.check_registered(RawCodec(), entry_point=True), "0 entry points named 'raw'")
