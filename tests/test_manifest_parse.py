"""The manifest parser's fast path for plain tensor records accepts exactly what the field-by-field check does."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deltastore import manifest as M
from deltastore.errors import ManifestError

N_OBJECTS = 3

_values = st.one_of(st.none(), st.booleans(), st.integers(-3, 2**49), st.floats(allow_nan=False),
                    st.text(max_size=6), st.lists(st.integers(-2, 5), max_size=3))
_names = st.one_of(st.sampled_from(["w", "a.b", "x..y", "a/b", "", "layer.0:q-k_v"]), _values)
_roles = st.one_of(st.none(), st.integers(-1, N_OBJECTS), st.booleans(), st.just([{"object": 0, "offset": 0, "numel": 2}]),
                   st.text(max_size=2))


_VALID = {"name": "layer.0.w", "dtype": "bfloat16", "shape": [4, 8], "changed": 3, "checksum": "0123456789abcdef",
          "delta": 1, "full": None, "diff": None, "diff_changed": 0}
_FIELDS = {
    "name": _names,
    "dtype": st.one_of(st.sampled_from(["bfloat16", "float32", "int8", "bf16"]), _values),
    "shape": st.one_of(st.lists(st.one_of(st.integers(-1, 9), st.just(2**48), st.booleans()), max_size=4), _values),
    "changed": st.one_of(st.integers(-1, 40), st.booleans(), _values),
    "checksum": st.one_of(st.just("645d45e12e2eb4b2"), st.just("645D45E12E2EB4B2"), _values),
    "delta": _roles, "full": _roles, "diff": _roles,
    "diff_changed": st.one_of(st.integers(-1, 40), st.booleans(), _values),
}


@st.composite
def records(draw):
    """A valid plain record with one to three fields replaced or removed (or no dict at all)."""
    rec = dict(_VALID)
    for key in draw(st.sets(st.sampled_from(sorted(_FIELDS)), min_size=1, max_size=3)):
        if draw(st.booleans()):
            rec[key] = draw(_FIELDS[key])
        else:
            del rec[key]
    return draw(st.one_of(st.just(rec), st.just(rec), st.just(rec), _values))


@settings(max_examples=1500, deadline=None)
@given(records())
def test_fast_path_agrees_with_the_field_by_field_check(t):
    fast = M._plain_record(t, N_OBJECTS)
    try:
        slow = M._record(t, 0, N_OBJECTS)
    except ManifestError:
        assert fast is None, f"fast path accepted what the full check refuses: {t!r}"
        return
    assert fast is None or fast == slow


def test_fast_path_takes_the_common_record():
    t = dict(_VALID)
    rec = M._plain_record(t, N_OBJECTS)
    assert rec is not None and rec == M._record(t, 0, N_OBJECTS)
    assert rec.delta == (M.Part(1, 0, 32),) and rec.numel == 32


@pytest.mark.parametrize("bad, message", [({"shape": [4, True]}, "invalid shape"), ({"changed": 99}, "changed"),
                                           ({"delta": 7}, "out of range"), ({"name": "a/b"}, "invalid tensor name")])
def test_a_bad_field_is_named_by_the_full_check(bad, message):
    t = {"name": "w", "dtype": "bfloat16", "shape": [4, 8], "changed": 3, "checksum": "0123456789abcdef",
         "delta": 1, "full": None, "diff": None, **bad}
    assert M._plain_record(t, N_OBJECTS) is None
    with pytest.raises(ManifestError, match=message):
        M._record(t, 0, N_OBJECTS)


@settings(max_examples=300, deadline=None)
@given(st.lists(records(), min_size=0, max_size=4), st.integers(0, 200), st.randoms(use_true_random=False))
def test_the_column_pass_agrees_with_the_record_by_record_fast_path(odd, plain, rnd):
    """Many valid records with a few odd ones mixed in (or none): the bulk pass gives what the per-record
    fast path gives, entry by entry (it falls back to it whenever a column is not plain)."""
    valid = [dict(_VALID, name=f"layer.{i}.w", shape=[i % 7 + 1, 3], changed=i % 3, delta=i % N_OBJECTS)
             for i in range(plain)]
    ts = valid + odd
    rnd.shuffle(ts)
    assert M._plain_records(ts, N_OBJECTS) == [M._plain_record(t, N_OBJECTS) for t in ts]


@pytest.mark.parametrize("field, value", [("name", "a\nb"), ("name", "w\n"), ("checksum", "0123456789abcdef\n"),
                                          ("name", "x..y"), ("shape", [2, True]), ("delta", True), ("dtype", ["x"])])
def test_the_column_pass_sees_a_value_that_only_looks_plain(field, value):
    ts = [dict(_VALID, name=f"layer.{i}.w") for i in range(100)]
    ts[37] = dict(ts[37], **{field: value})
    assert M._plain_records(ts, N_OBJECTS) == [M._plain_record(t, N_OBJECTS) for t in ts]


_part = st.sampled_from([(), (M.Part(0, 0, 4),)])


@st.composite
def role_cases(draw):
    n = draw(st.integers(0, 5))
    recs = [M.TensorRecord(draw(st.sampled_from(["a", "b", "c", "d", "e", "f"])), "bfloat16", (4,),
                           draw(st.integers(0, 2)), "0123456789abcdef", draw(_part), draw(_part), draw(_part),
                           draw(st.integers(0, 2))) for _ in range(n)]
    return (recs, draw(st.sampled_from(["anchor", "delta"])), draw(st.sampled_from([None, object()])),
            draw(st.sampled_from([None, object()])), draw(st.sampled_from([set(), {"a"}, {"a", "b", "c"}])))


@settings(max_examples=1500, deadline=None)
@given(role_cases())
def test_the_one_pass_role_rules_agree_with_the_record_by_record_check(case):
    """Where the C-level passes see no problem the per-record loop finds none either, and where they do it
    names one (a ManifestError, never the loop's internal assertion)."""
    recs, kind, parent, differential, new_names = case
    ok = len({r.name for r in recs}) == len(recs) and M._roles_hold(recs, kind, parent is not None,
                                                                    differential is not None, new_names)
    with pytest.raises(AssertionError if ok else ManifestError):
        M._check_roles(recs, kind, parent, differential, new_names)
