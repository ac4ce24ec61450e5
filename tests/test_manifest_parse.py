"""The manifest parser's fast path for plain tensor records accepts exactly what the field-by-field check does."""

from __future__ import annotations

import copy

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
                                          ("name", "x..y"), ("shape", [2, True]), ("delta", True), ("dtype", ["x"]),
                                          ("checksum", "0123456789ABCDEF"), ("checksum", "0123456789abcde "),
                                          ("checksum", "01234567\t9abcdef"), ("checksum", "01234567 \tabcdef"), ("checksum", "0123456789abcdeg"),
                                          ("checksum", "0123456789abcde"), ("checksum", "0123456789abcdef0"),
                                          ("checksum", "0123456789abcde\u00e9"), ("checksum", "\uff10123456789abcdef"),
                                          ("checksum", 81985529216486895)])
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
    # the same rules over the plain columns (each role one whole object, index 0, or none)
    roles = [[0 if getattr(r, k) else None for r in recs] for k in ("delta", "full", "diff")]
    on_columns = M._columns_hold_roles([r.changed for r in recs], *roles, [r.diff_changed for r in recs],
                                       [r.name for r in recs], kind, parent is not None, differential is not None,
                                       new_names)
    assert on_columns == M._roles_hold(recs, kind, parent is not None, differential is not None, new_names)


# -- the 1.2 tensor columns -------------------------------------------------------------------
def _doc(rows: list, version: str = "1.0") -> dict:
    """A delta manifest's document with ``rows`` as its tensors (row form) and three objects."""
    objects = tuple(M.ObjectRecord("sha256:" + f"{i}" * 64, 10, {"id": "raw"}) for i in range(N_OBJECTS))
    m = M.Manifest(step=1, kind="delta", parent=M.VersionRef(0, "sha256:" + "0" * 64), tensors=(),
                   objects=objects, created=1.0, format_version=version)
    return dict(m.to_dict(), tensors=rows)


def _as_columns(doc: dict) -> dict:
    rows = doc["tensors"]
    return dict(doc, format_version=M.COLUMNS_FORMAT_VERSION,
                tensors={k: [r[k] for r in rows] for k in M.TENSOR_FIELDS})


def _parsed(doc: dict):
    try:
        return M._parse(doc)
    except ManifestError as e:
        return f"ManifestError: {e}"


@settings(max_examples=300, deadline=None)
@given(st.lists(records(), min_size=0, max_size=3), st.integers(0, 120), st.randoms(use_true_random=False))
def test_a_columnar_section_parses_to_what_its_rows_parse_to(odd, plain, rnd):
    """The same records as rows (1.0) and as columns (1.2): the same tensors, or the same error naming
    the same record (a record lacking a field has no column form and is left out)."""
    valid = [dict(_VALID, name=f"layer.{i}.w", shape=[i % 7 + 1, 3], changed=i % 3, delta=i % N_OBJECTS)
             for i in range(plain)]
    rows = valid + [t for t in odd if isinstance(t, dict) and set(t) == set(M.TENSOR_FIELDS)]
    rnd.shuffle(rows)
    as_rows, as_columns = _parsed(_doc(rows)), _parsed(_as_columns(_doc(rows)))
    if isinstance(as_rows, str):
        assert as_columns == as_rows
    else:
        assert not isinstance(as_columns, str), as_columns
        assert as_columns.tensors == as_rows.tensors and as_columns.format_version == M.COLUMNS_FORMAT_VERSION


def test_a_columnar_manifest_round_trips_and_is_smaller_than_its_rows():
    rows = [dict(_VALID, name=f"model.layers.{i}.mlp.experts.{i % 64}.w", delta=i % N_OBJECTS) for i in range(300)]
    m = M._parse(_as_columns(_doc(rows)))
    data = m.to_json()
    assert M.Manifest.from_json(data) == m and isinstance(M.json.loads(data)["tensors"], dict)
    as_rows = M._parse(_doc(rows))
    assert as_rows.tensors == m.tensors and isinstance(M.json.loads(as_rows.to_json())["tensors"], list)
    assert len(data) < 0.75 * len(as_rows.to_json())


def test_an_empty_columnar_section_is_an_empty_version():
    m = M.Manifest(step=0, kind="anchor", parent=None, tensors=(), objects=(), created=1.0,
                   format_version=M.COLUMNS_FORMAT_VERSION)
    assert M.Manifest.from_json(m.to_json()).tensors == ()


_ROWS = [dict(_VALID, name=f"t{i}", delta=i % N_OBJECTS) for i in range(70)]


@pytest.mark.parametrize("change, message", [
    (lambda c: c.pop("diff_changed"), r"tensor columns are \["),
    (lambda c: c.update(extra=[0] * 70), r"tensor columns are \["),
    (lambda c: c.update(shape="4,8"), "tensor column 'shape' is not a list"),
    (lambda c: c["checksum"].pop(), "tensor column 'checksum' has 69 entries, 'name' has 70"),
    (lambda c: c["name"].append("t70"), "tensor column 'dtype' has 70 entries, 'name' has 71"),
    (lambda c: c["name"].__setitem__(5, "t4"), "tensor 't4' listed twice"),
    (lambda c: c["changed"].__setitem__(9, 33), r"tensors\[9\] field .changed. = 33 outside"),
    (lambda c: c["delta"].__setitem__(3, 7), r"tensors\[3\] delta.*out of range"),
])
def test_a_bad_column_is_named(change, message):
    doc = _as_columns(_doc(_ROWS))
    change(doc["tensors"])
    with pytest.raises(ManifestError, match=message):
        M._parse(doc)


def test_each_form_is_read_only_under_its_own_version():
    with pytest.raises(ManifestError, match="tensors"):  # columns in a 1.0 manifest
        M._parse(dict(_as_columns(_doc(_ROWS)), format_version="1.0"))
    with pytest.raises(ManifestError, match="tensors"):  # rows in a 1.2 one
        M._parse(_doc(_ROWS, version=M.COLUMNS_FORMAT_VERSION) | {"tensors": _ROWS})


# -- a layout seen before (manifest._LAYOUTS) ---------------------------------------------------------
_LAYOUT_ROWS = [dict(_VALID, name=f"layer.{i}.w", shape=[i % 3 + 1, 4], changed=i % 3, delta=i % N_OBJECTS)
                for i in range(40)]


def _lookalike_shapes(shape):
    """Shapes equal to ``shape`` under ``==`` that the check must still refuse (floats, booleans)."""
    out = [[float(d) for d in shape]]
    if 1 in shape:
        out.append([True if d == 1 else d for d in shape])
    return st.sampled_from(out)


@settings(max_examples=400, deadline=None)
@given(st.data())
def test_a_layout_seen_before_changes_nothing_the_parse_decides(data):
    """A manifest parsed right after one of the same layout gives exactly what it gives parsed first: the
    same records and layout key, or the same error. Mutations keep most of the layout so that the known
    layout's columns are compared, and include shapes that only look equal (2.0 for 2, True for 1)."""
    rows = [dict(r) for r in _LAYOUT_ROWS]
    for _ in range(data.draw(st.integers(0, 2))):
        i = data.draw(st.integers(0, len(rows) - 1))
        field = data.draw(st.sampled_from(sorted(_FIELDS)))
        shape = rows[i]["shape"]  # an earlier mutation of this row may have left no list of ints there
        lookalike = field == "shape" and type(shape) is list and all(type(d) is int for d in shape)
        value = data.draw(_lookalike_shapes(shape) if lookalike and data.draw(st.booleans()) else _FIELDS[field])
        rows[i] = dict(rows[i], **{field: value})
    doc = _as_columns(_doc(rows))
    M._LAYOUTS.clear()
    first = _parsed(doc)
    M._LAYOUTS.clear()
    M._parse(_as_columns(_doc(_LAYOUT_ROWS)))  # the layout is known now
    again = _parsed(doc)
    if isinstance(first, str):
        assert again == first
    else:
        assert not isinstance(again, str), again
        assert again.tensors == first.tensors and again.layout_key == first.layout_key
        assert again.layout_columns == first.layout_columns
        assert [t.spec for t in again.tensors] == [t.spec for t in first.tensors]
        assert again.checksum_values == first.checksum_values == {t.name: int(t.checksum, 16) for t in first.tensors}
        for role in ("delta", "full", "diff"):
            assert again.objects_for(role) == {p.object for t in first.tensors for p in getattr(t, role)}


def test_manifests_of_one_layout_share_what_follows_from_it():
    a = M._parse(_as_columns(_doc(_LAYOUT_ROWS)))
    rows = [dict(r, changed=0, checksum="fedcba9876543210") for r in _LAYOUT_ROWS]
    b = M._parse(_as_columns(_doc(rows)))
    assert b.layout_key is a.layout_key and b.layout_columns is a.layout_columns
    assert all(x.spec is y.spec and x.shape is y.shape for x, y in zip(a.tensors, b.tensors))
    assert [t.checksum for t in b.tensors] == ["fedcba9876543210"] * len(rows)  # the content is b's own


@pytest.mark.parametrize("field, index, value, message", [("name", 5, "a/b", "invalid tensor name"),
                                                      ("shape", 1, [2**60, 4], "invalid shape")])
def test_a_known_layout_is_compared_with_its_own_copy_of_the_columns(field, index, value, message):
    M._LAYOUTS.clear()
    doc = copy.deepcopy(_as_columns(_doc(_LAYOUT_ROWS)))
    M._parse(doc)
    doc["tensors"][field][index] = value  # the caller changes its document afterwards ...
    other = copy.deepcopy(_as_columns(_doc(_LAYOUT_ROWS)))
    other["tensors"][field][index] = value  # ... and a later manifest holding the same is still refused
    with pytest.raises(ManifestError, match=message):
        M._parse(other)


def test_a_parsed_manifests_checksum_values_are_its_checksums_read_as_hex():
    rows = [dict(r, checksum=f"{(i * 0x9E3779B97F4A7C15) % 2**64:016x}") for i, r in enumerate(_LAYOUT_ROWS)]
    for doc in (_doc(rows), _as_columns(_doc(rows))):  # rows (a record at a time) and columns (one pass)
        m = M._parse(doc)
        assert m.checksum_values == {t.name: int(t.checksum, 16) for t in m.tensors}
        assert len(set(m.checksum_values.values())) == len(rows)
