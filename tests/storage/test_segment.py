"""Segment headers: derivation from tensors, validation, token-id hashing, JSON round trip."""

from __future__ import annotations

import hashlib
import struct
from dataclasses import replace

import pytest
import torch

from phloem.storage import Segment, SegmentLayout, SegmentMeta, hash_token_ids


def test_hash_token_ids_is_sha256_of_little_endian_int64() -> None:
    ids = [0, 1, 151_642, 2**40]
    want = hashlib.sha256(struct.pack("<4q", *ids)).hexdigest()
    assert hash_token_ids(ids) == want
    assert hash_token_ids(torch.tensor(ids)) == want
    assert hash_token_ids(torch.tensor(ids[:3], dtype=torch.int32)) == hash_token_ids(ids[:3])
    assert hash_token_ids([]) == hashlib.sha256(b"").hexdigest()
    with pytest.raises(ValueError, match="integers"):
        hash_token_ids(torch.tensor([1.0]))


def test_from_tensors_derives_header(make_segment, fingerprint) -> None:
    seg = make_segment(num_tokens=10, dtype=torch.bfloat16, created_at=123.5)
    meta = seg.meta
    assert (meta.session_id, meta.segment_id) == ("sess-A", "seg-1")
    assert meta.model_fingerprint == fingerprint
    assert (meta.num_tokens, meta.page_size, meta.num_pages) == (10, 4, 3)
    assert meta.kv_dtype == "bfloat16"
    assert meta.layout == SegmentLayout(
        num_attn_layers=2, num_kv_heads=2, head_dim=8, num_gdn_layers=3, conv_dim=12,
        conv_kernel_size=4, num_v_heads=2, key_head_dim=8, value_head_dim=6,
    )
    assert meta.token_ids_hash == hash_token_ids(seg.tensors["token_ids"])
    assert meta.created_at == 123.5
    assert seg.problems() == []


def test_fp8_kv_beside_a_bf16_conv_state_round_trips(make_segment, fingerprint) -> None:
    """An fp8 KV cache's segment: fp8 pages, the model's conv dtype recorded apart; a header
    written before ``conv_dtype`` existed implies the KV dtype for the conv state."""
    seg = make_segment(num_tokens=10, dtype=torch.bfloat16)
    tensors = dict(seg.tensors, kv=seg.tensors["kv"].to(torch.float8_e4m3fn))
    fp8 = Segment.from_tensors(session_id="sess-A", segment_id="seg-2", model_fingerprint=fingerprint, tensors=tensors)
    assert (fp8.meta.kv_dtype, fp8.meta.conv_dtype) == ("float8_e4m3fn", "bfloat16")
    assert SegmentMeta.from_json(fp8.meta.to_json()) == fp8.meta and fp8.problems() == []
    assert fp8.nbytes == seg.nbytes - tensors["kv"].numel()
    old = replace(seg.meta, conv_dtype=None)
    assert old.expected_dtypes()["conv"] == torch.bfloat16
    assert "conv has dtype" in Segment(replace(fp8.meta, conv_dtype=None), tensors).problems()[0]


def test_nbytes_is_exact(make_segment) -> None:
    seg = make_segment(num_tokens=10, dtype=torch.bfloat16)
    kv = 2 * 3 * 2 * 4 * 2 * 8 * 2
    conv = 3 * 12 * 3 * 2
    ssm = 3 * 2 * 8 * 6 * 4
    assert seg.nbytes == kv + conv + ssm + 10 * 8


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        pytest.param(lambda t: t.pop("ssm"), "exactly", id="missing-tensor"),
        pytest.param(lambda t: t.update(kv=t["kv"][:, :2]), "kv has shape", id="too-few-pages"),
        pytest.param(lambda t: t.update(ssm=t["ssm"].half()), "ssm has dtype", id="ssm-dtype"),
        pytest.param(lambda t: t.update(ssm=t["ssm"].bfloat16()), "ssm has dtype", id="ssm-bf16"),
        pytest.param(lambda t: t.update(token_ids=t["token_ids"].int()), "token_ids", id="ids-i32"),
        pytest.param(lambda t: t.update(conv=t["conv"][:2]), "ssm has shape", id="gdn-layers"),
        pytest.param(lambda t: t.update(kv=t["kv"][0]), "6 dims", id="kv-rank"),
    ],
)
def test_from_tensors_rejects_inconsistent_tensors(
    make_tensors, fingerprint, edit, message
) -> None:
    tensors = make_tensors(10, torch.bfloat16, 0)
    edit(tensors)
    with pytest.raises(ValueError, match=message):
        Segment.from_tensors(
            session_id="s", segment_id="g", model_fingerprint=fingerprint, tensors=tensors
        )


def test_meta_json_round_trip(make_segment) -> None:
    meta = make_segment(dtype=torch.float32).meta
    assert SegmentMeta.from_json(meta.to_json()) == meta


@pytest.mark.parametrize(
    ("change", "message"),
    [
        pytest.param({"page_size": 0}, "page_size", id="page-size-zero"),
        pytest.param({"num_tokens": -1}, "num_tokens", id="negative-tokens"),
        pytest.param({"token_ids_hash": "xyz"}, "token_ids_hash", id="hash-not-hex"),
        pytest.param({"kv_dtype": "int8"}, "kv_dtype", id="dtype"),
        pytest.param({"model_fingerprint": ""}, "model_fingerprint", id="no-fingerprint"),
        pytest.param({"session_id": "../x"}, "session_id", id="unsafe-session-id"),
        pytest.param({"segment_id": "a/b"}, "segment_id", id="unsafe-segment-id"),
    ],
)
def test_meta_rejects_bad_fields(make_segment, change, message) -> None:
    meta = make_segment().meta
    with pytest.raises(ValueError, match=message):
        replace(meta, **change)


@pytest.mark.parametrize(
    "text",
    ["", "[]", "{}", '{"session_id": "s"}', "not json"],
    ids=["empty", "list", "empty-object", "missing-fields", "garbage"],
)
def test_meta_from_json_rejects_garbage(text) -> None:
    with pytest.raises(ValueError, match="SegmentMeta"):
        SegmentMeta.from_json(text)
