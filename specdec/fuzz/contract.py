"""Hypothesis strategies derived from the protobuf contract (protos/specdec/v1).

`message(cls, overrides)` walks the message's descriptor and draws every field
from a strategy for its wire type: int32/int64/uint64 with their extremes,
float/double including NaN, +-inf, -0.0 and subnormals, strings of any
Unicode, bools, nested messages, repeated fields as lists, proto3 `optional`
fields and `oneof` members either set or unset. A field named in `overrides`
is drawn from the strategy given instead (the domain's sane values mixed with
wild ones, see `mostly`), so a generated message gets deep into a service
instead of failing its first check.
"""
from __future__ import annotations

from google.protobuf.descriptor import FieldDescriptor as FD
from hypothesis import strategies as st

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
INT32 = st.one_of(st.sampled_from([0, 1, -1, INT32_MAX, INT32_MIN, 2**16, 255, 256]),
                  st.integers(INT32_MIN, INT32_MAX))
INT64 = st.one_of(st.sampled_from([0, -1, 2**63 - 1, -(2**63)]), st.integers(-(2**63), 2**63 - 1))
UINT32 = st.integers(0, 2**32 - 1)
UINT64 = st.one_of(st.sampled_from([0, 1, 2**64 - 1, 2**63]), st.integers(0, 2**64 - 1))
FLOAT32 = st.one_of(st.sampled_from([0.0, -0.0, 1.0, -1.0, float("nan"), float("inf"), float("-inf"),
                                     1e-45, 1e-38, 3.4e38, 0.5, 1.0000001]),
                    st.floats(width=32, allow_nan=True, allow_infinity=True, allow_subnormal=True))
FLOAT64 = st.floats(allow_nan=True, allow_infinity=True)
TEXT = st.one_of(st.sampled_from(["", " ", "\x00", "\ud7ff", "🦄" * 3, "a" * 300]), st.text(max_size=40))

_SCALARS = {
    FD.TYPE_INT32: INT32, FD.TYPE_SINT32: INT32, FD.TYPE_SFIXED32: INT32,
    FD.TYPE_INT64: INT64, FD.TYPE_SINT64: INT64, FD.TYPE_SFIXED64: INT64,
    FD.TYPE_UINT32: UINT32, FD.TYPE_FIXED32: UINT32,
    FD.TYPE_UINT64: UINT64, FD.TYPE_FIXED64: UINT64,
    FD.TYPE_FLOAT: FLOAT32, FD.TYPE_DOUBLE: FLOAT64,
    FD.TYPE_BOOL: st.booleans(), FD.TYPE_STRING: TEXT, FD.TYPE_BYTES: st.binary(max_size=40),
}
MAX_LIST = 12


def mostly(sane: st.SearchStrategy, wild: st.SearchStrategy, wild_one_in: int = 4) -> st.SearchStrategy:
    """`sane` most of the time, `wild` one time in `wild_one_in`."""
    # The last value is wild: hypothesis leans to small integers, so sane stays the common case.
    return st.integers(0, wild_one_in - 1).flatmap(lambda i: wild if i == wild_one_in - 1 else sane)


def field_strategy(field, overrides: dict, depth: int) -> st.SearchStrategy:
    """The value of one field (a list for a repeated one) from its descriptor."""
    if field.name in overrides:
        return overrides[field.name]
    if field.type == FD.TYPE_MESSAGE:
        one = message(field.message_type._concrete_class, depth=depth + 1)
    elif field.type == FD.TYPE_ENUM:
        one = st.one_of(st.sampled_from([v.number for v in field.enum_type.values]), INT32)
    else:
        one = _SCALARS[field.type]
    if field.is_repeated:
        return st.lists(one, max_size=MAX_LIST if depth < 2 else 2)
    return one


def message(cls, overrides: dict | None = None, depth: int = 0, set_oneofs: bool = False) -> st.SearchStrategy:
    """Messages of type `cls`, every field drawn from `field_strategy`; an
    override may draw None to leave its (optional or oneof) field unset.
    set_oneofs: always set one member of each (real) oneof."""
    overrides = overrides or {}
    descriptor = cls.DESCRIPTOR

    @st.composite
    def build(draw):
        values = {}
        for oneof in descriptor.oneofs:
            members = list(oneof.fields)
            if _synthetic(oneof):
                continue
            chosen = draw(st.sampled_from(members if set_oneofs else [None, *members]))
            if chosen is not None:
                values[chosen.name] = draw(field_strategy(chosen, overrides, depth))
        for field in descriptor.fields:
            if field.containing_oneof is not None and not _synthetic(field.containing_oneof):
                continue  # drawn above
            if field.type == FD.TYPE_MESSAGE and not field.is_repeated and depth >= 3 \
                    and field.name not in overrides:
                continue
            optional = field.containing_oneof is not None  # proto3 `optional`
            if optional and field.name not in overrides and draw(st.booleans()):
                continue
            values[field.name] = draw(field_strategy(field, overrides, depth))
        return cls(**{name: value for name, value in values.items() if value is not None})

    return build()


def _synthetic(oneof) -> bool:
    """The hidden oneof protoc makes for a proto3 `optional` field."""
    return getattr(oneof, "is_synthetic", False) or (len(oneof.fields) == 1 and oneof.name == f"_{oneof.fields[0].name}")
