"""TraceRecord wire format: a fixed prefix, a small JSON header, then raw little-endian array bytes.

Layout (all integers little-endian)::

    offset  size  field
    0       4     magic            b"SLTR"
    4       1     major            schema version (TraceRecord.schema_version)
    5       1     minor            additive revision within the major
    6       2     flags            must be 0 in v1
    8       4     header_len       bytes of the JSON header
    12      4     crc32            zlib.crc32 of everything after this 16-byte prefix
    16      H     header           UTF-8 JSON: {"fields": {...scalars...}, "arrays": [[name, dtype, shape], ...]}
    16+H    ...   body             the arrays' bytes, concatenated in table order, C order

No codec-level compression: float16 logprobs barely compress and Kafka compresses batches anyway.

Version rule (what a consumer with codec ``MAJOR.MINOR`` does with a message ``m.n``):

* ``m < MAJOR``: decoded through an upgrader to the current model (none exist yet: v1 is the first).
* ``m == MAJOR``: decoded. If ``n > MINOR`` the writer is newer but, by the rule below, only *added*
  things: unknown header fields and unknown arrays are ignored.
* ``m > MAJOR``: refused with :class:`UnsupportedTraceVersion` (the source dead-letters it; it can
  be replayed from the dead-letter topic once the consumer is upgraded).

A writer bumps MINOR when it only adds optional header fields or optional arrays that an older
reader may safely ignore. Anything else (a removed or renamed field, a changed dtype, shape or
meaning, a new required field, a new flag bit) bumps MAJOR.
"""

from __future__ import annotations

import json
import math
import struct
import zlib
from typing import Any

import numpy as np
from pydantic import ValidationError

from feedback.bus.trace import TRACE_SCHEMA_VERSION, StepArrays, TraceRecord
from feedback.target.fingerprint import TargetFingerprint

MAGIC = b"SLTR"
CODEC_MAJOR = TRACE_SCHEMA_VERSION
CODEC_MINOR = 1
"""1.1 added the optional token-tree arrays ``steps.tree_ids``/``steps.tree_parents``."""
_PREFIX = struct.Struct("<4sBBHII")

_SCALAR_FIELDS = (
    "request_id", "tenant", "domain", "created_at", "finished_at", "drafter_kind",
    "drafter_version", "temperature", "top_p", "top_k", "finish_reason",
)
# Canonical little-endian dtype of every v1 array (see feedback/bus/trace.py for shapes).
_RECORD_ARRAYS = {"prompt_ids": "<i4", "output_ids": "<i4", "hidden_states": "<u2"}
_STEP_ARRAYS = {
    "positions": "<i4",
    "num_drafted": "<i2",
    "num_accepted": "<i2",
    "source": "|u1",
    "draft_ids": "<i4",
    "draft_probs": "<f4",
    "target_topk_ids": "<i4",
    "target_topk_logprobs": "<f2",
    "tree_ids": "<i4",
    "tree_parents": "<i2",
}
_OPTIONAL_STEP_ARRAYS = ("tree_ids", "tree_parents")
_ARRAY_DTYPES = {**_RECORD_ARRAYS, **{f"steps.{k}": v for k, v in _STEP_ARRAYS.items()}}
_REQUIRED_ARRAYS = set(_ARRAY_DTYPES) - {"hidden_states"} - {
    f"steps.{k}" for k in _OPTIONAL_STEP_ARRAYS
}


class TraceDecodeError(ValueError):
    """The bytes are not a valid trace: garbage, truncated, corrupted or failing validation."""


class UnsupportedTraceVersion(TraceDecodeError):
    """The message was written with a newer major schema version than this consumer knows."""


def encode(record: TraceRecord) -> bytes:
    """Serialise a record. Arrays are cast to their canonical dtype (e.g. int64 ids -> int32)."""
    fields: dict[str, Any] = {name: getattr(record, name) for name in _SCALAR_FIELDS}
    fields["target"] = record.target.model_dump()
    fields["hidden_layers"] = list(record.hidden_layers)

    arrays: list[tuple[str, np.ndarray]] = [
        ("prompt_ids", record.prompt_ids),
        ("output_ids", record.output_ids),
    ]
    arrays += [
        (f"steps.{name}", getattr(record.steps, name))
        for name in _STEP_ARRAYS
        if getattr(record.steps, name) is not None
    ]
    if record.hidden_states is not None:
        arrays.append(("hidden_states", record.hidden_states))

    table, chunks = [], []
    for name, arr in arrays:
        canonical = np.ascontiguousarray(arr, dtype=np.dtype(_ARRAY_DTYPES[name]))
        table.append([name, canonical.dtype.str, list(canonical.shape)])
        chunks.append(canonical.tobytes())

    header = json.dumps({"fields": fields, "arrays": table}, separators=(",", ":")).encode()
    payload = header + b"".join(chunks)
    prefix = _PREFIX.pack(MAGIC, CODEC_MAJOR, CODEC_MINOR, 0, len(header), zlib.crc32(payload))
    return prefix + payload


def decode(data: bytes | bytearray | memoryview) -> TraceRecord:
    """Parse and validate one message; raises :class:`TraceDecodeError` on anything invalid."""
    data = memoryview(data).cast("B")
    if len(data) < _PREFIX.size:
        raise TraceDecodeError(f"message too short ({len(data)} bytes) for a trace prefix")
    magic, major, minor, flags, header_len, crc = _PREFIX.unpack_from(data)
    if magic != MAGIC:
        raise TraceDecodeError(f"bad magic {bytes(magic)!r}, expected {MAGIC!r}")
    if major > CODEC_MAJOR:
        raise UnsupportedTraceVersion(
            f"trace schema v{major}.{minor} is newer than this consumer's v{CODEC_MAJOR}.{CODEC_MINOR}"
        )
    if major < 1:
        raise TraceDecodeError(f"unknown trace schema version {major}")
    if flags != 0:
        raise TraceDecodeError(f"unknown flags 0x{flags:04x}")
    payload = data[_PREFIX.size:]
    if header_len > len(payload):
        raise TraceDecodeError(f"truncated: header needs {header_len} bytes, {len(payload)} left")
    if zlib.crc32(payload) != crc:
        raise TraceDecodeError("checksum mismatch (truncated or corrupted message)")
    try:
        header = json.loads(bytes(payload[:header_len]))
        fields, table = header["fields"], header["arrays"]
        if not isinstance(fields, dict) or not isinstance(table, list):
            raise TypeError("fields must be an object and arrays a list")
    except (ValueError, KeyError, TypeError) as e:
        raise TraceDecodeError(f"bad header: {e}") from e
    arrays = _read_arrays(payload[header_len:], table)
    return _build(fields, arrays)


def _read_arrays(body: memoryview, table: list) -> dict[str, np.ndarray]:
    arrays: dict[str, np.ndarray] = {}
    offset = 0
    for entry in table:
        try:
            name, dtype_str, shape = entry
            dtype = np.dtype(dtype_str)
            shape = tuple(int(d) for d in shape)
        except (ValueError, TypeError) as e:
            raise TraceDecodeError(f"bad array table entry {entry!r}: {e}") from e
        if any(d < 0 for d in shape) or dtype.hasobject:
            raise TraceDecodeError(f"bad array {name!r}: shape {shape}, dtype {dtype}")
        nbytes = dtype.itemsize * math.prod(shape)  # Python ints: a huge shape cannot wrap around
        if offset + nbytes > len(body):
            raise TraceDecodeError(f"truncated: array {name!r} needs {nbytes} bytes at {offset}")
        if name in _ARRAY_DTYPES:  # unknown arrays (a newer minor) are skipped
            if dtype != np.dtype(_ARRAY_DTYPES[name]):
                raise TraceDecodeError(f"array {name!r} has dtype {dtype}, expected {_ARRAY_DTYPES[name]}")
            arr = np.frombuffer(body, dtype=dtype, count=nbytes // dtype.itemsize, offset=offset)
            arrays[name] = arr.reshape(shape).astype(dtype.newbyteorder("="), copy=True)
        offset += nbytes
    if offset != len(body):
        raise TraceDecodeError(f"{len(body) - offset} trailing bytes after the arrays")
    missing = _REQUIRED_ARRAYS - set(arrays)
    if missing:
        raise TraceDecodeError(f"missing arrays: {sorted(missing)}")
    return arrays


def _build(fields: dict[str, Any], arrays: dict[str, np.ndarray]) -> TraceRecord:
    try:
        steps = StepArrays(**{name: arrays.get(f"steps.{name}") for name in _STEP_ARRAYS})
        known = {name: fields[name] for name in _SCALAR_FIELDS if name in fields}
        record = TraceRecord(
            **known,
            schema_version=CODEC_MAJOR,
            target=TargetFingerprint(**fields["target"]),
            hidden_layers=tuple(fields.get("hidden_layers", ())),
            prompt_ids=arrays["prompt_ids"],
            output_ids=arrays["output_ids"],
            steps=steps,
            hidden_states=arrays.get("hidden_states"),
        )
    except (ValidationError, KeyError, TypeError, ValueError) as e:
        raise TraceDecodeError(f"invalid trace content: {e}") from e
    _check_consistency(record)
    return record


def _check_consistency(record: TraceRecord) -> None:
    """Checks the pydantic model leaves to producers: ranges that would poison training."""
    s = record.steps
    k = s.draft_ids.shape[1]
    if np.any(s.num_drafted < 0) or np.any(s.num_drafted > k) or np.any(s.num_accepted < 0):
        raise TraceDecodeError(f"num_drafted/num_accepted outside [0, {k}]")
    emitted = s.num_accepted.astype(np.int64) + 1  # [S]
    if not np.array_equal(s.positions, np.cumsum(emitted) - emitted):
        raise TraceDecodeError("step positions are not where each step's tokens start in the output")
    if s.num_steps and len(record.prompt_ids) == 0:
        raise TraceDecodeError("steps without a prompt token: their first row has no context")
    drafted = np.arange(k)[None, :] < s.num_drafted[:, None]  # [S, K]
    if np.any(s.draft_ids[drafted] < 0):
        raise TraceDecodeError("a drafted token id is padding (-1)")
    if np.isnan(s.target_topk_logprobs).any() or np.isposinf(s.target_topk_logprobs).any():
        raise TraceDecodeError("target_topk_logprobs holds NaN or +inf (-inf is padding)")
    vocab = record.target.vocab_size
    for name, ids, low in (
        ("prompt_ids", record.prompt_ids, 0),
        ("output_ids", record.output_ids, 0),
        ("draft_ids", s.draft_ids, -1),
        ("target_topk_ids", s.target_topk_ids, -1),
        ("tree_ids", s.tree_ids if s.tree_ids is not None else np.zeros(0, np.int32), -1),
    ):
        if ids.size and (ids.min() < low or ids.max() >= vocab):
            raise TraceDecodeError(f"{name} outside [{low}, {vocab})")
