"""KV records round-trip bit-exactly, and every kind of damage is a RecordError (a miss), never data."""

from __future__ import annotations

import struct

import pytest
import torch
import xxhash

from splitserve.keys import cache_key, kv_layout
from splitserve.kvcache import serde
from splitserve.kvcache.serde import RecordError, RecordFault, RecordSigner, decode, encode, read_header, verify

torch.set_num_threads(1)

NUM_LAYERS, NUM_TOKENS, NUM_KV_HEADS, HEAD_DIM = 3, 32, 2, 8
SHAPE = (NUM_LAYERS, 2, NUM_TOKENS, NUM_KV_HEADS, HEAD_DIM)


def layout_for(dtype: torch.dtype) -> str:
    return kv_layout(str(dtype).removeprefix("torch."), NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM, 16)


def make_kv(dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(SHAPE, generator=gen).to(dtype)


def damaged(record: bytes, offset: int, new: bytes) -> bytes:
    return record[:offset] + new + record[offset + len(new) :]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_round_trip_is_bit_exact(dtype: torch.dtype) -> None:
    kv = make_kv(dtype)
    record = encode(kv, NUM_TOKENS, layout_for(dtype))
    out = decode(record, layout_for(dtype), expected_shape=SHAPE, expected_dtype=dtype)
    assert out.dtype == dtype and tuple(out.shape) == SHAPE
    assert torch.equal(out.view(torch.uint8), kv.view(torch.uint8))


def test_header_describes_the_record_and_payload_is_aligned() -> None:
    layout = layout_for(torch.bfloat16)
    record = encode(make_kv(torch.bfloat16), NUM_TOKENS, layout)
    header = read_header(record)
    assert (header.dtype, header.shape, header.num_tokens, header.layout) == (torch.bfloat16, SHAPE, 32, layout)
    assert header.payload_offset % serde.PAYLOAD_ALIGN_BYTES == 0
    assert len(record) == header.payload_offset + 2 * NUM_LAYERS * 2 * NUM_TOKENS * NUM_KV_HEADS * HEAD_DIM


def test_decode_is_a_zero_copy_view_of_a_writable_buffer() -> None:
    record = bytearray(encode(make_kv(torch.float32), NUM_TOKENS, layout_for(torch.float32)))
    out = decode(record, layout_for(torch.float32))
    offset = read_header(record).payload_offset
    record[offset : offset + 4] = struct.pack("<f", 42.0)
    assert out[0, 0, 0, 0, 0].item() == 42.0


def test_non_contiguous_input_is_encoded_in_c_order() -> None:
    kv = make_kv(torch.float32).transpose(3, 4).contiguous().transpose(3, 4)  # same values, other strides
    assert not kv.is_contiguous()
    out = decode(encode(kv, NUM_TOKENS, layout_for(torch.float32)), layout_for(torch.float32))
    assert torch.equal(out, kv)


def test_a_record_written_in_place_is_the_one_encode_makes() -> None:
    kv, layout, key = make_kv(torch.bfloat16), layout_for(torch.bfloat16), cache_key("m", "l", 7)
    signer = RecordSigner.for_secret("secret", "m", layout)
    buffer = bytearray(serde.record_nbytes(SHAPE, kv.dtype, layout, "m") + 100)  # a reused, larger buffer
    record = serde.encode_into(buffer, SHAPE, kv.dtype, lambda out: out.copy_(kv), layout, model_id="m", key=key,
                               signer=signer)  # fmt: skip
    assert bytes(record) == encode(kv, NUM_TOKENS, layout, model_id="m", key=key, signer=signer)
    assert signer.verify(key, record).model_id == "m"
    with pytest.raises(ValueError, match="cannot hold"):
        serde.encode_into(bytearray(64), SHAPE, kv.dtype, lambda out: out.copy_(kv), layout)


class TestEncodeRejectsCallerBugs:
    def test_token_count_must_match_the_shape(self) -> None:
        with pytest.raises(ValueError, match="does not hold 31 tokens"):
            encode(make_kv(torch.float32), NUM_TOKENS - 1, "x")

    def test_shape_must_be_a_chunk(self) -> None:
        with pytest.raises(ValueError, match="not \\[num_layers, 2"):
            encode(torch.zeros(4, 4), 4, "x")

    def test_unsupported_dtype(self) -> None:
        with pytest.raises(ValueError, match="unsupported KV dtype"):
            encode(torch.zeros(SHAPE, dtype=torch.int32), NUM_TOKENS, "x")


class TestEveryCorruptionIsARecordError:
    layout = layout_for(torch.bfloat16)

    @pytest.fixture
    def record(self) -> bytes:
        return encode(make_kv(torch.bfloat16), NUM_TOKENS, self.layout)

    def check(self, data: bytes, fault: RecordFault, **kwargs: object) -> None:
        with pytest.raises(RecordError) as info:
            decode(data, self.layout, **kwargs)
        assert info.value.fault is fault
        assert isinstance(info.value, ValueError)

    def test_bad_magic(self, record: bytes) -> None:
        self.check(damaged(record, 0, b"XXXX"), RecordFault.MAGIC)

    def test_other_format_version(self, record: bytes) -> None:
        self.check(damaged(record, 4, struct.pack("<H", serde.FORMAT_VERSION + 1)), RecordFault.VERSION)

    def test_unknown_dtype_code(self, record: bytes) -> None:
        self.check(damaged(record, 6, bytes([99])), RecordFault.DTYPE)

    def test_unexpected_dtype(self, record: bytes) -> None:
        self.check(record, RecordFault.DTYPE, expected_dtype=torch.float32)

    def test_payload_bit_flip_fails_the_checksum(self, record: bytes) -> None:
        flipped = damaged(record, len(record) - 7, bytes([record[-7] ^ 0x01]))
        self.check(flipped, RecordFault.CHECKSUM)

    def test_foreign_layout(self, record: bytes) -> None:
        with pytest.raises(RecordError) as info:
            decode(record, layout_for(torch.float32))
        assert info.value.fault is RecordFault.LAYOUT
        with pytest.raises(RecordError):
            decode(record, self.layout.replace("L3", "L4"), verify_checksum=False)

    def test_unexpected_shape(self, record: bytes) -> None:
        self.check(record, RecordFault.SHAPE, expected_shape=(NUM_LAYERS, 2, 16, NUM_KV_HEADS, HEAD_DIM))

    def test_header_shape_inconsistent_with_token_count(self, record: bytes) -> None:
        self.check(damaged(record, 8, struct.pack("<I", NUM_TOKENS - 1)), RecordFault.SHAPE)

    def test_header_shape_inconsistent_with_payload_length(self, record: bytes) -> None:
        bigger = struct.pack("<Q", NUM_LAYERS + 1)
        self.check(damaged(record, serde._FIXED.size, bigger), RecordFault.SHAPE)

    @pytest.mark.parametrize("keep", [0, 10, 40, -1])
    def test_truncated(self, record: bytes, keep: int) -> None:
        self.check(record[:keep], RecordFault.TRUNCATED)

    def test_trailing_garbage(self, record: bytes) -> None:
        self.check(record + b"\0", RecordFault.TRUNCATED)

    def test_layout_not_utf8(self, record: bytes) -> None:
        layout_at = serde._FIXED.size + 8 * len(SHAPE)
        self.check(damaged(record, layout_at, b"\xff"), RecordFault.LAYOUT)

    def test_verify_checks_without_building_a_tensor(self, record: bytes) -> None:
        assert verify(record, self.layout).num_tokens == NUM_TOKENS
        with pytest.raises(RecordError):
            verify(damaged(record, len(record) - 1, bytes([record[-1] ^ 0x80])), self.layout)


class TestSignedRecords:
    """A shared tier serves a record only under the key it was signed for, by a holder of the same secret."""

    LAYOUT = layout_for(torch.float32)
    KEY = cache_key("model-a", layout_for(torch.float32), 0x1234ABCD)

    def signer(self, secret: str | None = "s3cret", model_id: str = "model-a") -> RecordSigner:
        return RecordSigner.for_secret(secret, model_id, self.LAYOUT)

    def signed(self, secret: str | None = "s3cret") -> bytes:
        return self.signer(secret).encode(make_kv(torch.float32), NUM_TOKENS, self.KEY)

    def fault_of(self, record: bytes, key: str | None = None, reader: RecordSigner | None = None) -> RecordFault:
        with pytest.raises(RecordError) as info:
            (reader or self.signer()).verify(key or self.KEY, record)
        return info.value.fault

    def test_a_signed_record_verifies_and_names_its_identity(self) -> None:
        header = self.signer().verify(self.KEY, self.signed())
        assert (header.model_id, header.token_hash, header.layout) == ("model-a", 0x1234ABCD, self.LAYOUT)
        assert torch.equal(decode(self.signed(), self.LAYOUT), make_kv(torch.float32))

    def test_copied_under_another_key_is_an_identity_miss(self) -> None:
        other = cache_key("model-a", self.LAYOUT, 0x1234ABCE)
        assert self.fault_of(self.signed(), key=other) == RecordFault.IDENTITY

    def test_another_model_is_an_identity_miss(self) -> None:
        assert self.fault_of(self.signed(), reader=self.signer(model_id="model-b")) == RecordFault.IDENTITY

    def test_another_secret_or_none_is_a_mac_miss(self) -> None:
        assert self.fault_of(self.signed("other")) == RecordFault.MAC
        assert self.fault_of(self.signed(None)) == RecordFault.MAC

    def test_without_a_secret_the_public_key_still_catches_damage(self) -> None:
        record = bytearray(self.signed(None))
        self.signer(None).verify(self.KEY, bytes(record))
        record[-1] ^= 1
        assert self.fault_of(bytes(record), reader=self.signer(None)) == RecordFault.MAC

    def test_an_unsigned_record_is_a_mac_miss(self) -> None:
        unsigned = encode(make_kv(torch.float32), NUM_TOKENS, self.LAYOUT, model_id="model-a", key=self.KEY)
        assert self.fault_of(unsigned) == RecordFault.MAC

    @pytest.mark.parametrize("where", ["payload", "checksum", "token_count_field", "shape"])
    def test_any_changed_byte_is_a_miss(self, where: str) -> None:
        record = bytearray(self.signed())
        offset = {"payload": len(record) - 1, "checksum": 24, "token_count_field": 8, "shape": 72}[where]
        record[offset] ^= 0x01
        with pytest.raises(RecordError):
            self.signer().verify(self.KEY, bytes(record))

    def test_a_forged_header_with_a_recomputed_checksum_is_still_a_mac_miss(self) -> None:
        """An attacker without the secret can fix the xxh3 of whatever payload it writes, not the MAC."""
        record = bytearray(self.signed())
        offset = read_header(bytes(record)).payload_offset
        record[offset:] = bytes(len(record) - offset)  # zeroed KV
        struct.pack_into("<Q", record, 24, xxhash.xxh3_64_intdigest(bytes(record[offset:])))
        verify(bytes(record), self.LAYOUT)  # the checksum alone is satisfied
        assert self.fault_of(bytes(record)) == RecordFault.MAC

    def test_signing_needs_the_key(self) -> None:
        with pytest.raises(ValueError, match="needs the key"):
            encode(make_kv(torch.float32), NUM_TOKENS, self.LAYOUT, signer=self.signer())
