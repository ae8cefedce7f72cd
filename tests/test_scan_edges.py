"""hops.scan at its edges: zero length, torch's dim=, xs with no leaves, a symbolic length
given as an int, and operands on different devices (shared by every HOP with a body)."""

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._dynamo.testing import CompileCounter
from torch.fx.experimental.proxy_tensor import make_fx

import hops
from hops import Replicate

# A parameter and a buffer the steps below read as globals (only frontends that lift
# globals, eager and torch.compile, may trace them).
GLOBAL_WEIGHT = torch.randn(3, dtype=torch.float64, requires_grad=True)
GLOBAL_BUFFER = torch.randn(3, dtype=torch.float64)


# --------------------------------------------------------------------------- zero length


@dataclasses.dataclass(frozen=True)
class ZeroLengthProgram:
    """A random valid scan of length 0 and what its step reads.

    ``xs_form``: ``"none"`` (``xs=None, length=0``), ``"tensor"``, ``"pair"`` (a tuple of
    two xs), ``"empty"`` (``xs=[]`` with ``length=0``). ``closures``: for each closed-over
    tensor, whether it is made inside the program from an input that requires grad, one
    that does not, is a global parameter or buffer, or a constant the step makes. ``uses``: per carry, which xs leaves and
    closures its update reads. ``y``: ``None``, one float y, or a float and an int y.
    """

    num_carry: int
    xs_form: str
    xs_grad: bool
    closures: tuple[str, ...]
    uses: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]
    y: str
    remat: bool
    reverse: bool
    unroll: object

    @property
    def num_xs(self) -> int:
        return {"none": 0, "empty": 0, "tensor": 1, "pair": 2}[self.xs_form]

    def inputs(self):
        """(init, xs leaves, closure sources) as fresh tensors."""
        torch.manual_seed(0)
        init = [torch.randn(3, dtype=torch.float64, requires_grad=True) for _ in range(self.num_carry)]
        xs = [torch.randn(0, 3, dtype=torch.float64, requires_grad=self.xs_grad) for _ in range(self.num_xs)]
        sources = [torch.randn(3, dtype=torch.float64, requires_grad=kind == "grad") for kind in self.closures if kind in ("grad", "no_grad")]
        return init, xs, sources

    def program(self, with_step_call=None):
        """``f(init, xs, sources) -> (carry, ys)``, the closures made inside it."""

        def f(init, xs, sources):
            sources = iter(sources)
            closed = [
                {"global": GLOBAL_WEIGHT, "buffer": GLOBAL_BUFFER}.get(kind) if kind in ("global", "buffer", "constant") else next(sources) * 2
                for kind in self.closures
            ]

            def step(carry, x):
                # A tensor made in the step from a literal: a constant of a traced body.
                read = [
                    torch.tensor([0.5, 1.0, 1.5], dtype=torch.float64) if kind == "constant" else w
                    for kind, w in zip(self.closures, closed)
                ]
                x_leaves = [] if x is None else (list(x) if isinstance(x, tuple) else [x])
                new = []
                for c, (x_uses, w_uses) in zip(carry, self.uses):
                    value = c * 0.5
                    for j in x_uses:
                        value = value + x_leaves[j]
                    for k in w_uses:
                        value = value * read[k]
                    new.append(value)
                if self.y == "none":
                    return new, None
                y = (new[0] * carry[-1]).sum(0, keepdim=True)
                if self.y == "float":
                    return new, y
                return new, (y, (new[-1] > 0).sum())

            xs_arg = {"none": None, "empty": [], "tensor": xs[0] if xs else None, "pair": tuple(xs)}[self.xs_form]
            length = 0 if self.xs_form in ("none", "empty") else None
            return (with_step_call or hops.scan)(
                step, list(init), xs_arg, length=length, reverse=self.reverse, unroll=self.unroll, remat=self.remat
            )

        return f

    def one_step(self, init, xs, sources):
        """The step's outputs for one slice of zeros: ys' shapes, and which inputs the
        differentiable outputs depend on (None gradients where they do not)."""
        f = self.program(with_step_call=lambda step, init, xs_arg, **_: step(init, _one_slice(xs_arg)))
        return f(init, xs, sources)


def _one_slice(xs_arg):
    if xs_arg is None or isinstance(xs_arg, list):
        return None
    if isinstance(xs_arg, tuple):
        return tuple(torch.zeros(x.shape[1:], dtype=x.dtype, requires_grad=x.requires_grad) for x in xs_arg)
    return torch.zeros(xs_arg.shape[1:], dtype=xs_arg.dtype, requires_grad=xs_arg.requires_grad)


@st.composite
def zero_length_programs(draw):
    num_carry = draw(st.integers(1, 2))
    xs_form = draw(st.sampled_from(["none", "tensor", "pair", "empty"]))
    num_xs = {"none": 0, "empty": 0, "tensor": 1, "pair": 2}[xs_form]
    closures = tuple(draw(st.lists(st.sampled_from(["grad", "no_grad", "global", "buffer", "constant"]), max_size=2)))
    uses = tuple(
        (
            tuple(draw(st.lists(st.integers(0, num_xs - 1), max_size=2, unique=True))) if num_xs else (),
            tuple(draw(st.lists(st.integers(0, len(closures) - 1), max_size=2, unique=True))) if closures else (),
        )
        for _ in range(num_carry)
    )
    return ZeroLengthProgram(
        num_carry=num_carry,
        xs_form=xs_form,
        xs_grad=draw(st.booleans()),
        closures=closures,
        uses=uses,
        y=draw(st.sampled_from(["none", "float", "float_and_int"])),
        remat=draw(st.booleans()),
        reverse=draw(st.booleans()),
        unroll=draw(st.sampled_from([1, 2, True])),
    )


def _expected(program):
    """The reference: the init itself, empty ys shaped as one step gives them, and the
    gradients of a loss over (carry, ys): the loss's weights for init, zeros (xs's shape for
    xs) for every other input a step's outputs depend on, None for the rest."""
    init, xs, sources = program.inputs()
    wanted = [*xs, *sources, *([GLOBAL_WEIGHT] if "global" in program.closures else [])]
    carry, y = program.one_step(init, xs, sources)
    ys = None if y is None else torch.utils._pytree.tree_map(lambda t: t.new_empty((0, *t.shape)), y)
    outputs = [o for o in torch.utils._pytree.tree_leaves((carry, y)) if isinstance(o, torch.Tensor) and o.requires_grad]
    differentiable = [t for t in wanted if t.requires_grad]
    step_grads = (
        torch.autograd.grad(outputs, differentiable, [torch.ones_like(o) for o in outputs], allow_unused=True)
        if outputs and differentiable
        else [None] * len(differentiable)
    )
    connected = dict(zip(map(id, differentiable), step_grads))
    grads = [None if connected.get(id(t)) is None else torch.zeros_like(t) for t in wanted]
    return [t.detach() for t in init], ys, grads


def _loss(carry, ys):
    loss = sum((c * (i + 1)).sum() for i, c in enumerate(carry))
    for y in torch.utils._pytree.tree_leaves(ys):
        if isinstance(y, torch.Tensor) and y.is_floating_point():
            loss = loss + y.sum()
    return loss


def _run_with_grads(program, frontend):
    """(carry, ys, grads of wanted inputs, grads of init) as ``frontend`` computes them."""
    init, xs, sources = program.inputs()
    f = program.program()
    wanted = [*xs, *sources, *([GLOBAL_WEIGHT] if "global" in program.closures else [])]

    def forward_and_grads(init, xs, sources):
        carry, ys = f(init, xs, sources)
        grads = torch.autograd.grad(_loss(carry, ys), [t for t in [*init, *xs, *sources] if t.requires_grad], allow_unused=True)
        return carry, ys, grads

    if frontend == "eager" or frontend == "compile":
        run = f if frontend == "eager" else torch.compile(f, backend="aot_eager", fullgraph=True)
        carry, ys = run(init, xs, sources)
        GLOBAL_WEIGHT.grad = None
        _loss(carry, ys).backward()
        grads = [t.grad for t in wanted]
        GLOBAL_WEIGHT.grad = None
        return carry, ys, grads, [t.grad for t in init]
    if frontend == "aot":
        from functorch.compile import aot_function, nop

        carry, ys = aot_function(f, nop)(init, xs, sources)
        _loss(carry, ys).backward()
        return carry, ys, [t.grad for t in wanted], [t.grad for t in init]
    # make_fx traces the forward and the backward (the traced autograd path).
    gm = make_fx(forward_and_grads, tracing_mode=frontend)(init, xs, sources)
    carry, ys, grads = gm(init, xs, sources)
    by_input = dict(zip(map(id, [t for t in [*init, *xs, *sources] if t.requires_grad]), grads))
    return carry, ys, [by_input.get(id(t)) for t in wanted], [by_input.get(id(t)) for t in init]


def _check_zero_length(program, frontend):
    if frontend not in ("eager", "compile") and {"global", "buffer"} & set(program.closures):
        return  # a real global in a fake-tensor trace is refused by design (see test_no_silent_wrong_results.py)
    expected_carry, expected_ys, expected_grads = _expected(program)
    carry, ys, grads, init_grads = _run_with_grads(program, frontend)
    torch.testing.assert_close([c.detach() for c in carry], expected_carry)
    if expected_ys is None:
        assert ys is None
    else:
        got, expected = torch.utils._pytree.tree_flatten(ys), torch.utils._pytree.tree_flatten(expected_ys)
        assert got[1] == expected[1]
        for g, e in zip(got[0], expected[0]):
            assert (g.shape, g.dtype) == (e.shape, e.dtype)
    for got, expected in zip(grads, expected_grads):
        if expected is None:
            assert got is None or not got.any()
        else:
            assert got is not None, "a zero-length scan gives zero gradients to what a step's outputs depend on"
            torch.testing.assert_close(got, expected)
    for i, got in enumerate(init_grads):  # the carry passes through: the loss's weight
        torch.testing.assert_close(got, torch.full((3,), float(i + 1), dtype=torch.float64))


@pytest.mark.parametrize("frontend", ["eager", "real", "fake", "symbolic", "aot"])
@settings(max_examples=8, deadline=None)
@given(program=zero_length_programs())
def test_zero_length_scan_is_init_and_empty_ys(frontend, program):
    """Any valid program's scan of length 0 returns its init and empty ys shaped as one step
    gives them, and zero gradients, under every frontend: closures with and without grad,
    remat, reverse and unroll included."""
    _check_zero_length(program, frontend)


@settings(max_examples=4, deadline=None)
@given(program=zero_length_programs())
def test_zero_length_scan_under_torch_compile(program):
    torch._dynamo.reset()
    _check_zero_length(program, "compile")


def test_zero_length_step_reading_a_closure_eagerly():
    """The reproducer: one step's shapes are learned on fakes, the closure included."""
    w = torch.randn(3, requires_grad=True)
    init = torch.randn(3, requires_grad=True)
    xs = torch.randn(0, 3, requires_grad=True)
    carry, ys = hops.scan(lambda c, x: (c * w + x, (c + w).sum(0, keepdim=True)), init, xs)
    assert torch.equal(carry, init) and ys.shape == (0, 1)
    (carry.sum() + ys.sum()).backward()
    # As torch's scan: identity for init, zeros of xs's shape, zeros for the closure.
    assert torch.equal(init.grad, torch.ones(3))
    assert xs.grad is not None and xs.grad.shape == (0, 3)
    assert torch.equal(w.grad, torch.zeros(3))


def test_zero_length_gradients_keep_special_values():
    """The zero gradient is carried by an exact zero: a carry holding nan, inf or -0.0 and
    no ys comes back unchanged."""
    w = torch.tensor([float("inf"), float("nan"), 1.0], requires_grad=True)
    init = torch.tensor([-0.0, float("nan"), float("-inf")], requires_grad=True)
    carry, ys = hops.scan(lambda c, x: (c * w, None), init, None, length=0)
    assert ys is None
    torch.testing.assert_close(carry, init, equal_nan=True)
    assert torch.signbit(carry[0])
    carry.sum().backward()
    assert torch.equal(w.grad, torch.zeros(3))


def test_zero_length_gradcheck():
    w = torch.randn(3, dtype=torch.float64, requires_grad=True)

    def f(init, xs, w):
        return hops.scan(lambda c, x: (c * w + x, (c * x).sum(0, keepdim=True)), init, xs)

    init = torch.randn(3, dtype=torch.float64, requires_grad=True)
    xs = torch.randn(0, 3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(f, (init, xs, w))


# --------------------------------------------------------------------------- dim=


def _torch_dim_reference(fn, init, xs, dim):
    """torch's scan along ``dim``: a Python loop over ``xs.select(dim, i)``, ys stacked along
    ``dim`` where the stacked leaf has it."""
    carry, ys = init, []
    for i in range(xs.shape[dim]):
        carry, y = fn(carry, xs.select(dim, i))
        ys.append(y)
    stacked = torch.stack(ys)
    return carry, (torch.movedim(stacked, 0, dim) if dim % xs.dim() < stacked.dim() else stacked)


def _step(c, x):
    return c * x.sin() + 1, c + x


@pytest.mark.parametrize("dim", [0, 1, 2, -1, -2, -3])
def test_dim_scans_along_it_and_stacks_ys_along_it(dim):
    torch.manual_seed(0)
    xs = torch.randn(2, 3, 4, dtype=torch.float64)
    slice_shape = torch.movedim(xs, dim, 0).shape[1:]
    init = torch.randn(slice_shape, dtype=torch.float64)
    for reverse in (False, True):
        carry, ys = hops.scan(_step, init, xs, dim=dim, reverse=reverse)
        if reverse:
            expected = _torch_dim_reference(_step, init, xs.flip(dim), dim)
            expected = (expected[0], expected[1].flip(dim))
        else:
            expected = _torch_dim_reference(_step, init, xs, dim)
        torch.testing.assert_close((carry, ys), expected)
        assert ys.shape == xs.shape


@settings(max_examples=20, deadline=None)
@given(
    shapes=st.lists(st.lists(st.integers(1, 3), min_size=1, max_size=3), min_size=1, max_size=2),
    data=st.data(),
    reverse=st.booleans(),
)
def test_dim_is_a_loop_over_select_along_it(shapes, data, reverse):
    """Random xs pytrees and dims (negative ones resolved against the first leaf): values
    and gradients equal a Python loop over ``select(dim, i)`` with ys stacked along dim."""
    rank = len(shapes[0])
    dim = data.draw(st.integers(-rank, rank - 1))
    resolved = dim % rank
    length = data.draw(st.integers(1, 3))
    # Every leaf has the resolved dim, with the same length along it.
    leaf_shapes = [s[:resolved] + [length] + s[resolved + 1 :] if len(s) > resolved else s + [1] * (resolved - len(s)) + [length] for s in shapes]
    xs = [torch.randn(s, dtype=torch.float64, requires_grad=True) for s in leaf_shapes]

    def step(c, x):
        total = sum(leaf.sum() for leaf in x)
        return c * 0.5 + total, [leaf * c for leaf in x]

    init = torch.randn((), dtype=torch.float64, requires_grad=True)
    carry, ys = hops.scan(step, init, xs, dim=dim, reverse=reverse)
    expected_carry, expected_ys = init, [[] for _ in xs]
    order = range(length - 1, -1, -1) if reverse else range(length)
    for i in order:
        expected_carry, y = step(expected_carry, [x.select(resolved, i) for x in xs])
        for j, leaf in enumerate(y):
            expected_ys[j].insert(0, leaf) if reverse else expected_ys[j].append(leaf)
    stacked = [torch.stack(y) for y in expected_ys]
    expected = [torch.movedim(y, 0, resolved) if resolved < y.dim() else y for y in stacked]
    torch.testing.assert_close((carry, ys), (expected_carry, expected))
    got = torch.autograd.grad(carry + sum(y.sum() for y in ys), [init, *xs])
    want = torch.autograd.grad(expected_carry + sum(y.sum() for y in expected), [init, *xs])
    torch.testing.assert_close(got, want)


def test_dim_stacks_a_lower_rank_y_along_dim_0_as_torch_does():
    xs = torch.randn(2, 5, 3)
    carry, ys = hops.scan(lambda c, x: (c + x, x.sum()), torch.zeros(2, 5), xs, dim=2)
    assert ys.shape == (3,)
    torch.testing.assert_close(ys, xs.sum((0, 1)))


def test_dim_gradcheck_and_pytree_xs():
    torch.manual_seed(0)
    xs = {"a": torch.randn(2, 4, 3, dtype=torch.float64, requires_grad=True), "b": torch.randn(3, 4, dtype=torch.float64, requires_grad=True)}
    init = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)

    def f(init, a, b):
        return hops.scan(lambda c, x: (c * x["a"].tanh() + x["b"], (c * x["b"]).sum(-1)), init, {"a": a, "b": b}, dim=1)

    carry, ys = f(init, xs["a"], xs["b"])
    assert ys.shape == (2, 4)
    assert torch.autograd.gradcheck(f, (init, xs["a"], xs["b"]))
    for remat in (False, True):
        gm = make_fx(lambda i, a, b: hops.scan(
            lambda c, x: (c * x["a"].tanh() + x["b"], (c * x["b"]).sum(-1)), i, {"a": a, "b": b}, dim=1, remat=remat
        ), tracing_mode="fake")(init, xs["a"], xs["b"])
        torch.testing.assert_close(gm(init, xs["a"], xs["b"]), (carry, ys))


def test_dim_under_torch_compile_and_torch_scan():
    xs = torch.randn(3, 6, 2)
    init = torch.zeros(3, 2)
    expected = _torch_dim_reference(_step, init, xs, 1)
    compiled = torch.compile(lambda i, x: hops.scan(_step, i, x, dim=-2), backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(init, xs), expected)
    from torch._higher_order_ops.scan import scan as torch_scan

    # torch's scan stacks ys along dim since 2.13 (2.9's stacked them along dim 0).
    if tuple(int(part) for part in torch.__version__.split(".")[:2]) >= (2, 13):
        torch.testing.assert_close(hops.scan(_step, init, xs, dim=1), torch_scan(_step, init, xs, dim=1))


@pytest.mark.parametrize(
    "dim, message",
    [
        (3, r"^scan\(\w*step\): dim=3 but xs\['b'\] has shape \(2, 3, 4\) \(3 dims\)"),
        (-5, r"dim=-5 but xs\['a'\] has shape \(2, 3, 4, 5\)"),
    ],
)
def test_dim_a_leaf_lacks_is_refused_naming_it(dim, message):
    """A negative dim counts from the first leaf's last dim (torch's scan); every leaf needs it."""
    xs = {"a": torch.zeros(2, 3, 4, 5), "b": torch.zeros(2, 3, 4)}
    for error in (ValueError, IndexError):  # IndexError: torch's for a dim out of range
        with pytest.raises(error, match=message):
            hops.scan(_step, torch.zeros(2, 3, 5), xs, dim=dim)


def test_bad_dims():
    xs = torch.zeros(2, 3)
    with pytest.raises(TypeError, match=r"dim must be an int, got 1.0"):
        hops.scan(_step, torch.zeros(2), xs, dim=1.0)
    with pytest.raises(ValueError, match=r"dim=1 but there are no xs"):
        hops.scan(lambda c, x: (c, c), torch.zeros(2), None, length=2, dim=1)
    with pytest.raises(ValueError, match=r"^scan\(lambda\): xs\[1\] has length 2 but xs\[0\] has 3 along dim 1"):
        hops.scan(lambda c, x: (c, c), torch.zeros(2), (torch.zeros(2, 3), torch.zeros(3, 2)), dim=1)


# --------------------------------------------------------------------------- xs with no leaves


def _counting_step(c, x):
    """Counts steps; adds 10 when it gets x=None, 1 otherwise."""
    return c + (10 if x is None else 1), c.clone()


@pytest.mark.parametrize("xs", [(), [], {}], ids=["tuple", "list", "dict"])
def test_empty_container_without_length_returns_init_and_no_ys(xs):
    """torch's scan(fn, init, []): no step runs; the init itself and []."""
    init = torch.ones(2)
    carry, ys = hops.scan(_counting_step, init, xs)
    assert carry is init and ys == []


@pytest.mark.parametrize("xs", [None, (), [], {}], ids=["none", "tuple", "list", "dict"])
def test_no_xs_with_length_gives_the_step_none(xs):
    carry, ys = hops.scan(_counting_step, torch.tensor(0.0), xs, length=3)
    torch.testing.assert_close(carry, torch.tensor(30.0))
    torch.testing.assert_close(ys, torch.tensor([0.0, 10.0, 20.0]))
    carry, ys = hops.scan(_counting_step, torch.tensor(0.0), xs, length=0)
    assert carry == 0 and ys.shape == (0,)


def test_none_without_length_is_refused():
    with pytest.raises(ValueError, match="no xs to scan over and no length: pass length="):
        hops.scan(_counting_step, torch.tensor(0.0), None)


# --------------------------------------------------------------------------- symbolic length


def test_length_as_int_argument_compiles_once_with_dynamic_shapes():
    counter = CompileCounter()

    def program(init, n):
        return hops.scan(lambda c, x: (c * 2 + 1, c.sum()), init, None, length=n)

    torch._dynamo.reset()
    compiled = torch.compile(program, backend=counter, dynamic=True, fullgraph=True)
    for n in (4, 6):
        init = torch.ones(3)
        torch.testing.assert_close(compiled(init, n), program(init, n))
    assert counter.frame_count == 1


def test_symbolic_length_with_aot_eager_and_gradients():
    def program(init, w, n):
        return hops.scan(lambda c, x: (torch.tanh(c * w), (c * w).sum()), init, None, length=n)

    torch._dynamo.reset()
    compiled = torch.compile(program, backend="aot_eager", dynamic=True, fullgraph=True)
    for n in (2, 5):
        init, w = torch.randn(3, requires_grad=True), torch.randn(3, requires_grad=True)
        carry, ys = compiled(init, w, n)
        expected = program(init, w, n)
        torch.testing.assert_close((carry, ys), expected)
        got = torch.autograd.grad(carry.sum() + ys.sum(), (init, w))
        want = torch.autograd.grad(expected[0].sum() + expected[1].sum(), (init, w))
        torch.testing.assert_close(got, want)


# --------------------------------------------------------------------------- devices


def test_scan_operands_on_two_devices_are_refused_naming_them():
    for error in (ValueError, RuntimeError):  # RuntimeError: torch's for a device mismatch
        with pytest.raises(error, match=r"^scan\(\w*step\): init is on cpu but xs is on meta; every tensor must be on one device"):
            hops.scan(_step, torch.zeros(3), torch.zeros(4, 3, device="meta"))
    with pytest.raises(hops.DeviceMismatchError):
        hops.scan(_step, torch.zeros(3, device="meta"), torch.zeros(4, 3))
    with pytest.raises(ValueError, match=r"init\['h'\] is on meta but additional_inputs\[0\] is on cpu"):
        hops.scan(lambda c, x, w: (c, x), {"h": torch.zeros(3, device="meta")}, torch.zeros(4, 3, device="meta"), additional_inputs=(torch.ones(3),))


def test_a_cpu_scalar_goes_with_any_device():
    carry, ys = hops.scan(lambda c, x: (c + x.sum(), x), 0.0, torch.zeros(4, 3, device="meta"))
    assert ys.device.type == "meta"


def test_named_scope_and_local_map_operands_on_two_devices_are_refused():
    @hops.named_scope("scope")
    def add(a, b):
        return a + b

    with pytest.raises(hops.DeviceMismatchError, match=r"^named_scope\(add\): args\[0\] is on cpu but args\[1\] is on meta"):
        add(torch.zeros(3), torch.zeros(3, device="meta"))
    region = hops.local_map(
        lambda a, b: a + b,
        out_placements=[Replicate()],
        in_placements=([Replicate()], [Replicate()]),
        device_mesh=hops.Mesh((2,), ("x",)),
    )
    with pytest.raises(ValueError, match=r"args\[0\] is on cpu but args\[1\] is on meta"):
        region(torch.zeros(3), torch.zeros(3, device="meta"))


def test_symbolic_length_whose_backward_stacks_nothing():
    """The backward scan of a step that saves nothing and has no y cotangent still needs the
    (symbolic) length: it gets an xs of empty slices for it."""

    def program(init, w, xs):
        return hops.scan(lambda c, x: (c + w * 2, None), init, xs)[0]

    torch._dynamo.reset()
    counter = CompileCounter()
    compiled = torch.compile(program, backend="aot_eager", dynamic=True, fullgraph=True)
    for n in (3, 5):
        init, w = torch.randn(2, requires_grad=True), torch.randn(2, requires_grad=True)
        xs = torch.randn(n, 2)
        got = torch.autograd.grad(compiled(init, w, xs).sum(), (init, w))
        torch.testing.assert_close(got, (torch.ones(2), torch.full((2,), 2.0 * n)))
    counting = torch.compile(program, backend=counter, dynamic=True, fullgraph=True)
    for n in (3, 5):
        counting(torch.randn(2), torch.randn(2), torch.randn(n, 2))
    assert counter.frame_count == 1


def test_zero_length_under_torch_func():
    w = torch.randn(3)

    def loss(init, xs, w):
        carry, ys = hops.scan(lambda c, x: (c * w + x, (c * w).sum(0, keepdim=True)), init, xs)
        return carry.sum() + ys.sum()

    grads = torch.func.grad(loss, argnums=(0, 1, 2))(torch.randn(3), torch.randn(0, 3), w)
    torch.testing.assert_close(grads, (torch.ones(3), torch.zeros(0, 3), torch.zeros(3)))
