"""``code_key``: equal exactly when two functions run the same code on equal Python state."""

import functools
import math
import types

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import hops
from hops._body_hop.code_key import code_key

SPEC = hops.ShardingSpec(hops.Mesh((2, 2), ("a", "b")), (hops.Shard(0), hops.Replicate()))
OFFSET = 1.0


def closing_over(value):
    def step(c, x):
        return c * value + x

    return step


def reads_offset(c, x):
    return c + x * OFFSET


def calls_reads_offset(c, x):
    return reads_offset(c, x) * 2


def test_new_function_objects_with_equal_state_have_equal_keys():
    first, second = closing_over((2.0, SPEC, "a")), closing_over((2.0, SPEC, "a"))
    assert first is not second
    assert code_key(first) == code_key(second) and hash(code_key(first)) == hash(code_key(second))
    assert code_key(first, "structure") != code_key(first, "other structure")


def test_a_changed_closure_default_attribute_or_global_changes_the_key():
    global OFFSET
    assert code_key(closing_over(2.0)) != code_key(closing_over(3.0))

    def with_default(c, scale=2.0):
        return c * scale

    before = code_key(with_default)
    with_default.__defaults__ = (3.0,)
    assert code_key(with_default) != before
    with_default.scale = 1.0  # an attribute its code could read (``with_default.scale``)
    assert code_key(with_default) != code_key(closing_over(3.0))
    keyed = code_key(with_default)
    with_default.scale = 2.0
    assert code_key(with_default) != keyed

    # A global read by the function, and by a function it calls.
    direct, indirect = code_key(reads_offset), code_key(calls_reads_offset)
    OFFSET = 2.0
    try:
        assert code_key(reads_offset) != direct
        assert code_key(calls_reads_offset) != indirect
    finally:
        OFFSET = 1.0
    assert code_key(reads_offset) == direct


def test_a_user_modules_attributes_are_keyed_and_library_modules_are_constant():
    config = types.ModuleType("user_config")
    config.scale = 2.0
    namespace = {"config": config, "torch": torch, "math": math}
    exec("def step(c):\n    return torch.tanh(c) * config.scale * math.pi", namespace)
    before = code_key(namespace["step"])
    assert before is not None
    config.scale = 3.0
    assert code_key(namespace["step"]) != before


def test_tensors_are_keyed_by_identity_and_metadata_not_by_value():
    w = torch.ones(3)
    key = code_key(closing_over(w))
    assert key.tensors == frozenset({id(w)})
    w.add_(1)  # a traced body reads a closed-over tensor as an input: its value is not traced
    assert code_key(closing_over(w)) == key
    assert code_key(closing_over(torch.ones(3))) != key
    w.requires_grad_()
    assert code_key(closing_over(w)) != key


def test_state_with_no_key_gives_none():
    class Scale:
        value = 2.0

        def double(self, c):
            return c * 2

    obj = Scale()
    assert code_key(closing_over(obj)) is None  # an object's attributes may change
    assert code_key(closing_over(torch.nn.Linear(2, 2))) is None
    assert code_key(Scale.double) is not None  # a plain function of a class: keyed
    assert code_key(obj.double) is None  # a bound method: its instance has no key
    assert code_key(torch.nn.Linear(2, 2).forward) is None  # a bound method's instance
    assert code_key(closing_over([1, object()])) is None


def test_library_code_partials_and_recursion_are_keyed():
    assert code_key(closing_over(torch.tanh)) == code_key(closing_over(torch.tanh))
    assert code_key(closing_over(torch.tanh)) != code_key(closing_over(torch.sin))
    assert code_key(closing_over(torch.nn.functional.gelu)) is not None
    partial = functools.partial(closing_over(2.0), x=1.0)
    assert code_key(partial) == code_key(functools.partial(closing_over(2.0), x=1.0))
    assert code_key(partial) != code_key(functools.partial(closing_over(2.0), x=2.0))

    def recursive(n):
        return 1 if n == 0 else n * recursive(n - 1)

    assert code_key(recursive) == code_key(recursive)


def test_grad_mode_and_default_dtype_are_part_of_the_key():
    step = closing_over(2.0)
    key = code_key(step)
    with torch.no_grad():
        assert code_key(step) != key
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        assert code_key(step) != key
    finally:
        torch.set_default_dtype(previous)


# --------------------------------------------------------------------------- property


def same(a, b):
    """Equal as a trace sees them: same types all the way down, floats bit for bit."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return math.copysign(1.0, a) == math.copysign(1.0, b) and (a == b or (math.isnan(a) and math.isnan(b)))
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return len(a) == len(b) and all(same(x, y) and same(a[x], b[y]) for x, y in zip(a, b))
    return a == b


scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 3),
    st.sampled_from([0.0, -0.0, 1.0, 1.5, float("nan"), float("inf")]),
    st.sampled_from(["a", "b"]),
    st.sampled_from([torch.float32, torch.int64]),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.tuples(inner, inner),
        st.lists(inner, max_size=3),
        st.dictionaries(st.sampled_from(["k", "l"]), inner, max_size=2),
    ),
    max_leaves=6,
)


@settings(max_examples=300, deadline=None)
@given(values, values)
def test_keys_are_equal_exactly_when_closed_over_values_are_the_same(a, b):
    assert (code_key(closing_over(a)) == code_key(closing_over(b))) == same(a, b)
