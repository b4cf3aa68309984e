import json
import struct
import zlib

import numpy as np
import pytest
from trace_samples import POISONED, assert_same_trace, make_trace, poisoned_trace

from feedback.bus.codec import (
    CODEC_MAJOR,
    CODEC_MINOR,
    MAGIC,
    TraceDecodeError,
    UnsupportedTraceVersion,
    decode,
    encode,
)

PREFIX = struct.Struct("<4sBBHII")


def split(data: bytes) -> tuple[dict, bytes]:
    _, _, _, _, header_len, _ = PREFIX.unpack_from(data)
    return json.loads(data[16:16 + header_len]), data[16 + header_len:]


def join(header: dict, body: bytes, major=CODEC_MAJOR, minor=CODEC_MINOR, flags=0) -> bytes:
    """Re-frame a (possibly edited) header and body with a correct checksum."""
    raw = json.dumps(header).encode()
    payload = raw + body
    return PREFIX.pack(MAGIC, major, minor, flags, len(raw), zlib.crc32(payload)) + payload


@pytest.mark.parametrize("with_hidden", [False, True])
def test_round_trip_keeps_every_field_and_dtype(with_hidden):
    record = make_trace(num_steps=20, k=4, topk=8, with_hidden=with_hidden, seed=3)
    decoded = decode(encode(record))
    assert_same_trace(record, decoded)  # strict: values, shapes and dtypes
    assert decoded.steps.target_topk_logprobs.flags.writeable


def test_zero_step_trace_round_trips():
    record = make_trace(num_steps=0, k=2, topk=4, seed=1)
    assert len(record.output_ids) == 0
    assert_same_trace(record, decode(encode(record)))


def test_wide_input_dtypes_are_stored_canonically():
    record = make_trace(num_steps=6, seed=2)
    wide = record.model_copy(update={"prompt_ids": record.prompt_ids.astype(np.int64),
                                     "output_ids": record.output_ids.astype(np.int64)})
    decoded = decode(encode(wide))
    assert decoded.prompt_ids.dtype == np.int32 and decoded.output_ids.dtype == np.int32
    np.testing.assert_array_equal(decoded.output_ids, record.output_ids)


def test_bytes_per_trace_is_close_to_the_raw_arrays():
    # 70 verify steps, k=4, top-20: about a 96-token answer at the measured acceptance.
    record = make_trace(num_steps=70, k=4, topk=20, seed=0)
    data = encode(record)
    s = record.steps
    raw = sum(a.nbytes for a in (record.prompt_ids, record.output_ids, s.positions, s.num_drafted,
                                 s.num_accepted, s.source, s.draft_ids, s.draft_probs,
                                 s.target_topk_ids, s.target_topk_logprobs))
    assert raw < len(data) < raw + 1200  # header + prefix overhead only
    assert len(data) < 50_000


@pytest.mark.parametrize("garbage", [b"", b"SLTR", b"not a trace at all", bytes(64),
                                     b"SLTR" + bytes(200)])
def test_garbage_is_a_decode_error(garbage):
    with pytest.raises(TraceDecodeError):
        decode(garbage)


def test_every_truncation_and_a_bit_flip_are_detected():
    data = encode(make_trace(num_steps=5, seed=4))
    for cut in list(range(40)) + list(range(40, len(data), 97)) + [len(data) - 1]:
        with pytest.raises(TraceDecodeError):
            decode(data[:cut])
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 0x10
    with pytest.raises(TraceDecodeError, match="checksum"):
        decode(bytes(flipped))


def test_newer_major_is_refused_and_older_unknown_major_too():
    header, body = split(encode(make_trace(seed=5)))
    with pytest.raises(UnsupportedTraceVersion):
        decode(join(header, body, major=CODEC_MAJOR + 1))
    with pytest.raises(TraceDecodeError):
        decode(join(header, body, major=0))
    with pytest.raises(TraceDecodeError, match="flags"):
        decode(join(header, body, flags=1))


def test_newer_minor_with_added_fields_and_arrays_decodes():
    record = make_trace(seed=6)
    header, body = split(encode(record))
    header["fields"]["new_scalar"] = {"anything": [1, 2]}
    header["fields"]["target"]["new_target_field"] = "x"
    extra = np.arange(10, dtype="<f4")
    header["arrays"].insert(1, ["new_array", "<f4", [10]])
    n_prompt = record.prompt_ids.nbytes
    body = body[:n_prompt] + extra.tobytes() + body[n_prompt:]
    decoded = decode(join(header, body, minor=CODEC_MINOR + 1))
    assert_same_trace(record, decoded)


@pytest.mark.parametrize("edit, match", [
    (lambda h: h["fields"].pop("request_id"), "invalid trace content"),
    (lambda h: h["arrays"].pop(0), "truncated|trailing|missing"),
    (lambda h: h["arrays"][0].__setitem__(1, "<i8"), "dtype|truncated"),
    (lambda h: h.pop("arrays"), "bad header"),
])
def test_broken_header_is_a_decode_error(edit, match):
    header, body = split(encode(make_trace(seed=7)))
    edit(header)
    with pytest.raises(TraceDecodeError, match=match):
        decode(join(header, body))


def test_semantically_invalid_content_is_refused():
    record = make_trace(num_steps=8, seed=8)
    header, body = split(encode(record))
    # num_accepted > num_drafted: the step table lies about what was emitted.
    acc = record.steps.num_accepted.copy()
    drafted = record.steps.num_drafted
    acc[0] = drafted[0] + 1
    offsets, pos = {}, 0
    for name, dtype, shape in header["arrays"]:
        offsets[name] = pos
        pos += np.dtype(dtype).itemsize * int(np.prod(shape))
    start = offsets["steps.num_accepted"]
    bad = body[:start] + acc.astype("<i2").tobytes() + body[start + acc.nbytes:]
    with pytest.raises(TraceDecodeError, match="invalid trace content"):
        decode(join(header, bad))
    # token ids beyond the target's vocabulary
    out = record.output_ids.copy()
    out[0] = record.target.vocab_size
    start = offsets["output_ids"]
    bad = body[:start] + out.astype("<i4").tobytes() + body[start + out.nbytes:]
    with pytest.raises(TraceDecodeError, match="output_ids"):
        decode(join(header, bad))


def test_make_trace_is_valid_and_deterministic():
    a, b = make_trace(num_steps=12, k=3, topk=5, seed=9), make_trace(num_steps=12, k=3, topk=5, seed=9)
    assert_same_trace(a, b)
    s = a.steps
    for i in range(s.num_steps):
        acc, pos = int(s.num_accepted[i]), int(s.positions[i])
        np.testing.assert_array_equal(s.draft_ids[i, :acc], a.output_ids[pos:pos + acc])
        assert (s.target_topk_ids[i, int(s.num_drafted[i]) + 1:] == -1).all()
    assert make_trace(seed=10).request_id != a.request_id


# ---- token trees (codec 1.1) -------------------------------------------------------------------


def test_trace_written_by_codec_1_0_still_decodes():
    """tests/feedback/data/trace_v1_0.bin was encoded by the 1.0 codec (before tree arrays)."""
    from pathlib import Path

    from trace_samples import make_trace as _make

    from feedback.bus.codec import decode as _decode

    data = (Path(__file__).parent / "data" / "trace_v1_0.bin").read_bytes()
    assert data[4:6] == bytes([1, 0])
    record = _decode(data)
    assert record.steps.tree_ids is None and record.steps.tree_parents is None
    expected = _make(num_steps=6, k=3, topk=4, seed=11, with_hidden=True, hidden_dim=4)
    from trace_samples import assert_same_trace as _same

    _same(record, expected)


def test_tree_arrays_round_trip_and_are_validated():
    import numpy as _np
    import pytest as _pytest
    from trace_samples import assert_same_trace as _same
    from trace_samples import make_trace as _make

    from feedback.bus.codec import TraceDecodeError
    from feedback.bus.codec import decode as _decode
    from feedback.bus.codec import encode as _encode

    rec = _make(num_steps=5, k=3, topk=4, seed=3)
    steps = rec.steps.model_copy(update={
        "tree_ids": _np.array([[5, 6, 7, -1]] * 4 + [[-1] * 4], _np.int32),
        "tree_parents": _np.array([[-1, -1, 0, -1]] * 4 + [[-1] * 4], _np.int16),
    })
    tree_rec = rec.model_copy(update={"steps": steps})
    data = _encode(tree_rec)
    assert data[4:6] == bytes([1, 1])
    _same(_decode(data), tree_rec)
    with _pytest.raises(ValueError):  # a parent after its child
        type(rec.steps)(**{**dict(rec.steps), "tree_ids": steps.tree_ids,
                           "tree_parents": _np.array([[1, -1, 0, -1]] * 5, _np.int16)})
    bad = tree_rec.model_copy(update={"steps": steps.model_copy(update={
        "tree_ids": _np.full((5, 4), 10**6, _np.int32)})})
    with _pytest.raises(TraceDecodeError, match="tree_ids"):
        _decode(_encode(bad))


# ---- well-framed messages whose content would poison or crash the trainer ----------------------


@pytest.mark.parametrize("name", POISONED)
def test_well_framed_but_poisoned_content_is_a_decode_error(name):
    with pytest.raises(TraceDecodeError):
        decode(encode(poisoned_trace(name)))


def test_padding_logprobs_of_minus_inf_and_unknown_draft_probs_still_decode():
    record = make_trace(num_steps=8, k=4, topk=6, seed=21)
    assert np.isneginf(record.steps.target_topk_logprobs).any()  # rows past num_drafted
    unknown_q = record.steps.model_copy(update={"draft_probs": np.full_like(record.steps.draft_probs, np.nan)})
    record = record.model_copy(update={"steps": unknown_q})  # SGLang does not always keep q
    assert_same_trace(record, decode(encode(record)))


@pytest.mark.parametrize("shape", [[2**32, 2**32], [2**62, 4], [2**63 - 1, 2]])
def test_an_array_shape_that_overflows_int64_is_a_decode_error(shape):
    header, body = split(encode(make_trace(seed=12)))
    header["arrays"].append(["huge", "<i4", shape])  # unknown name: only its size is read
    with pytest.raises(TraceDecodeError, match="truncated"):
        decode(join(header, body))
