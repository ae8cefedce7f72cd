"""torch.func over every HOP: each transform (and compositions) of a program using a HOP
equals the same transform of the plain-Python reference, or is refused naming what has no
rule. The HOPs run their eager semantics at the transform's level, so these also cover
closures, random draws and transforms nested inside bodies."""

import pytest
import torch
import torch.autograd.forward_ad as fwAD
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.func import functionalize, grad, hessian, jacfwd, jacrev, jvp, linearize, vjp, vmap
from torch.fx.experimental.proxy_tensor import make_fx

import hops
from hops import Mesh, Replicate, Shard, ShardingSpec

DT = torch.float64
LINE = Mesh((2,), ("x",))
GRID = Mesh((2, 2), ("data", "model"))
W = torch.randn(3, 3, dtype=DT, generator=torch.Generator().manual_seed(1))


def step(c, x):
    c = torch.tanh(c @ W + x)  # W is closed over
    return c, (c * x).sin()


def scan_program(x):
    c, ys = hops.scan(step, torch.ones(3, dtype=x.dtype), x)
    return c * ys.sum(0)


def scan_reference(x):
    c, ys = torch.ones(3, dtype=x.dtype), []
    for i in range(x.shape[0]):
        c, y = step(c, x[i])
        ys.append(y)
    return c * torch.stack(ys).sum(0)


def scan_remat_program(x):
    c, ys = hops.scan(step, torch.ones(3, dtype=x.dtype), x, remat=True)
    return c * ys.sum(0)


def region(x):
    return (x.sin() * x) @ W


local_map_program = hops.local_map(region, mesh=GRID, in_placements=((Shard(0), Replicate()),), out_placements=((Shard(0), Replicate()),))


def scope_program(x):
    return hops.named_scope("block")(region)(x)


def annotate_program(x):
    return hops.annotate_sharding(x.sin(), ShardingSpec(GRID, (Shard(0), Shard(1)))) * x


def annotate_reference(x):
    return x.sin() * x


def einsum_program(x):
    return hops.einsum("ij,jk->ik", x, W).sin() + hops.einsum_linear(x, W, W[0])


def einsum_reference(x):
    return torch.einsum("ij,jk->ik", x, W).sin() + torch.nn.functional.linear(x, W, W[0])


@hops.kernel(
    abstract=lambda x: torch.empty_like(x),
    backward=lambda x, out, g: (g * torch.cos(x),),
    jvp=lambda x, t: t * torch.cos(x),
)
def sine(x):
    return torch.sin(x)


@hops.kernel(abstract=lambda x: torch.empty_like(x), backward=lambda x, out, g: (g * torch.cos(x),))
def sine_reverse_only(x):
    return torch.sin(x)


def kernel_program(x):
    return sine(x) * x


def region_in_scan_program(x):
    def body(c, xi):
        c = local_map_program(c + xi)
        return c, c.sum(-1)

    c, ys = hops.scan(body, torch.ones(2, 3, dtype=x.dtype), x.reshape(2, 2, 3))
    return c.sum(0) + ys.sum()


def region_in_scan_reference(x):
    c, ys = torch.ones(2, 3, dtype=x.dtype), []
    for xi in x.reshape(2, 2, 3):
        c = region(c + xi)
        ys.append(c.sum(-1))
    return c.sum(0) + torch.stack(ys).sum()


def grad_in_body_program(x):
    # torch.func inside a body: the step takes the gradient of an energy.
    def body(c, xi):
        return c - 0.1 * grad(lambda c: (c * xi).sin().sum())(c), c.sum()

    return hops.scan(body, torch.ones(3, dtype=x.dtype), x)[0]


def grad_in_body_reference(x):
    c = torch.ones(3, dtype=x.dtype)
    for xi in x:
        c = c - 0.1 * torch.cos(c * xi) * xi
    return c


PROGRAMS = {
    "scan": (scan_program, scan_reference),
    "scan_remat": (scan_remat_program, scan_reference),
    "local_map": (local_map_program, region),
    "named_scope": (scope_program, region),
    "annotate_sharding": (annotate_program, annotate_reference),
    "einsum": (einsum_program, einsum_reference),
    "kernel": (kernel_program, lambda x: torch.sin(x) * x),
    "local_map_in_scan": (region_in_scan_program, region_in_scan_reference),
    "grad_in_scan_body": (grad_in_body_program, grad_in_body_reference),
}


def forward_ad(f, x, t):
    with fwAD.dual_level():
        return fwAD.unpack_dual(f(fwAD.make_dual(x, t))).tangent


def double_backward(f, x):
    x = x.clone().requires_grad_()
    (g,) = torch.autograd.grad(f(x).pow(2).sum(), x, create_graph=True)
    return torch.autograd.grad(g.sin().sum(), x)


def traced(transformed):
    def run(x):
        return make_fx(transformed)(x)(x)

    return run


def transforms(f, x, t, batch):
    loss = lambda x: f(x).pow(2).sum()  # noqa: E731
    return {
        "vmap": lambda: vmap(f)(batch),
        "vmap in_dims=1": lambda: vmap(f, in_dims=1)(batch.movedim(0, 1)),
        "grad": lambda: grad(loss)(x),
        "vjp called after return": lambda: vjp(f, x)[1](torch.ones_like(f(x))),
        "jvp": lambda: jvp(f, (x,), (t,)),
        "forward_ad dual": lambda: forward_ad(f, x, t),
        "linearize": lambda: linearize(f, x)[1](t),
        "jacrev": lambda: jacrev(f)(x),
        "jacfwd": lambda: jacfwd(f)(x),
        "hessian": lambda: hessian(loss)(x),
        "vmap(grad)": lambda: vmap(grad(loss))(batch),
        "grad(vmap)": lambda: grad(lambda b: vmap(f)(b).pow(2).sum())(batch),
        "double backward": lambda: double_backward(f, x),
        "functionalize(grad)": lambda: functionalize(grad(loss))(x),
        "make_fx(grad)": lambda: traced(grad(loss))(x),
        "make_fx(vmap)": lambda: traced(vmap(f))(batch),
    }


TRANSFORMS = list(transforms(None, None, None, None))


def inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(4, 3, dtype=DT, generator=g), torch.randn(4, 3, dtype=DT, generator=g), torch.randn(2, 4, 3, dtype=DT, generator=g))


# torch.func.functionalize(grad(f)) cannot reach a kernel's backward or a local_map's
# gradient assembly (torch has no functionalize rule for autograd Functions): refused by
# name, see test_refused_under_functionalize_of_grad.
REFUSED = {("einsum", "functionalize(grad)"), ("kernel", "functionalize(grad)"), ("local_map", "functionalize(grad)"), ("local_map_in_scan", "functionalize(grad)")}
CASES = [(program, transform) for program in PROGRAMS for transform in TRANSFORMS if (program, transform) not in REFUSED]


@pytest.mark.parametrize(("program", "transform"), CASES)
def test_transform_matches_reference(program, transform):
    f, reference = PROGRAMS[program]
    x, t, batch = inputs()
    got = transforms(f, x, t, batch)[transform]()
    expected = transforms(reference, x, t, batch)[transform]()
    torch.testing.assert_close(got, expected)


FORWARD_MODE = ["jvp", "forward_ad dual", "linearize", "jacfwd", "hessian"]


@pytest.mark.parametrize("transform", FORWARD_MODE)
def test_kernel_without_jvp_refuses_forward_mode_by_name(transform):
    x, t, batch = inputs()
    with pytest.raises(NotImplementedError, match=r"^kernel\(sine_reverse_only\): no forward-mode derivative.*jvp="):
        transforms(lambda x: sine_reverse_only(x) * x, x, t, batch)[transform]()


@pytest.mark.parametrize("transform", ["grad", "jacrev", "vmap", "vmap(grad)", "vjp called after return"])
def test_kernel_without_jvp_runs_reverse_mode_and_vmap(transform):
    x, t, batch = inputs()
    got = transforms(lambda x: sine_reverse_only(x) * x, x, t, batch)[transform]()
    expected = transforms(lambda x: torch.sin(x) * x, x, t, batch)[transform]()
    torch.testing.assert_close(got, expected)


@pytest.mark.parametrize(("program", "transform"), sorted(REFUSED))
def test_refused_under_functionalize_of_grad(program, transform):
    f, reference = PROGRAMS[program]
    x, t, batch = inputs()
    with pytest.raises(NotImplementedError, match=r"torch.func cannot differentiate .* under torch.func.functionalize"):
        transforms(f, x, t, batch)[transform]()
    # The other order works.
    got = grad(functionalize(lambda x: f(x).pow(2).sum()))(x)
    torch.testing.assert_close(got, grad(lambda x: reference(x).pow(2).sum())(x))


def test_kernel_backward_is_what_grad_uses():
    # A straight-through kernel: its backward is not the derivative of its implementation.
    # torch.func.grad must use the kernel's backward, as autograd does.
    @hops.kernel(abstract=lambda x: torch.empty_like(x), backward=lambda x, out, g: (g,))
    def straight_through_round(x):
        return torch.round(x)

    x = inputs()[0]
    leaf = x.clone().requires_grad_()
    (expected,) = torch.autograd.grad((straight_through_round(leaf) * x).sum(), leaf)
    got = grad(lambda v: (straight_through_round(v) * x).sum())(x)
    torch.testing.assert_close(expected, x)  # the kernel's backward, not round's zero derivative
    torch.testing.assert_close(got, expected)


def test_vmap_randomness_follows_torch():
    def noisy_body(c, x):
        return c + torch.nn.functional.dropout(x, 0.5), c.sum()

    def program(x):
        return hops.scan(noisy_body, torch.zeros(3, dtype=x.dtype), x)[0]

    batch = inputs()[2]
    with pytest.raises(RuntimeError, match="randomness"):
        vmap(program)(batch)
    torch.manual_seed(3)
    got = vmap(program, randomness="different")(batch)
    torch.manual_seed(3)

    def reference(x):
        c = torch.zeros(3, dtype=x.dtype)
        for xi in x:
            c = c + torch.nn.functional.dropout(xi, 0.5)
        return c

    expected = vmap(reference, randomness="different")(batch)
    torch.testing.assert_close(got, expected)


# --------------------------------------------------------------------------- property


UNARY = {
    "sin": torch.sin,
    "tanh": torch.tanh,
    "square": lambda v: v * v,
    "closure matmul": lambda v: v @ W,
    "closure add": lambda v: v + W[0],
    "factory": lambda v: v + torch.ones(v.shape[-1], dtype=v.dtype),
    "softmax": lambda v: v.softmax(-1),
    "einsum": lambda v: hops.einsum("...j,jk->...k", v, W),
}


def compose(names):
    def body(v):
        for name in names:
            v = UNARY[name](v)
        return v

    return body


def wrapped(kind, body):
    if kind == "scan":

        def program(x):
            # tanh bounds the carry: a body composed of squares, applied step after step,
            # would otherwise overflow (x ** 8 ** length) and compare inf with inf.
            c, ys = hops.scan(lambda c, xi: (torch.tanh(body(c + xi)), body(xi) * c), torch.zeros(3, dtype=x.dtype), x)
            return ys.sum(0) + c

        def reference(x):
            c, ys = torch.zeros(3, dtype=x.dtype), []
            for xi in x:
                c, y = torch.tanh(body(c + xi)), body(xi) * c
                ys.append(y)
            return torch.stack(ys).sum(0) + c

        return program, reference
    if kind == "local_map":
        return hops.local_map(body, mesh=LINE, in_placements=((Shard(0),),), out_placements=((Shard(0),),)), body
    return (lambda x: hops.named_scope("random")(body)(x)), body


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    kind=st.sampled_from(["scan", "local_map", "named_scope"]),
    names=st.lists(st.sampled_from(sorted(UNARY)), min_size=1, max_size=4),
    transform=st.sampled_from(["vmap", "grad", "jvp", "jacrev", "hessian", "vmap(grad)", "linearize"]),
    seed=st.integers(0, 2**16),
)
def test_random_bodies_under_random_transforms(kind, names, transform, seed):
    # Every op acts row by row, so a body on rows sharded over the mesh means the same.
    program, reference = wrapped(kind, compose(names))
    x, t, batch = inputs(seed)
    got = transforms(program, x, t, batch)[transform]()
    expected = transforms(reference, x, t, batch)[transform]()
    torch.testing.assert_close(got, expected)


# A body may itself call torch.func, on a function that closes over a tensor requiring grad
# (a parameter): the HOP reads that tensor while the inner transform is active, and the
# outer autograd still differentiates through it.
P = torch.randn(3, dtype=DT, generator=torch.Generator().manual_seed(2)).requires_grad_()

INNER = {  # each row-wise in v, as local_map's per-shard run needs
    "grad": lambda f, v: grad(lambda v: f(v).sum())(v),
    "vjp": lambda f, v: vjp(f, v)[1](torch.ones_like(v))[0],
    "jacrev": lambda f, v: jacrev(lambda v: f(v).sum())(v),
    "jvp": lambda f, v: jvp(f, (v,), (torch.ones_like(v),))[1],
    "vmap(grad)": lambda f, v: vmap(grad(lambda v: f(v).sum()))(torch.stack([v, 2 * v])).sum(0),
}


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    kind=st.sampled_from(["scan", "local_map", "named_scope"]),
    names=st.lists(st.sampled_from(sorted(UNARY)), min_size=1, max_size=3),
    inner=st.sampled_from(sorted(INNER)),
    seed=st.integers(0, 2**16),
)
def test_transform_inside_body_reads_closure_requiring_grad(kind, names, inner, seed):
    body = compose(names)

    def field(v):
        return torch.tanh(body(v)) * P

    def update(v):
        return v - 0.1 * INNER[inner](field, v)

    program, reference = wrapped(kind, update)
    x = inputs(seed)[0]
    got, expected = program(x), reference(x)
    torch.testing.assert_close(got, expected)
    (got_grad,) = torch.autograd.grad(got.sum(), P)
    (expected_grad,) = torch.autograd.grad(expected.sum(), P)
    torch.testing.assert_close(got_grad, expected_grad)


@pytest.mark.parametrize("program", ["annotate_sharding", "kernel", "scan", "local_map", "named_scope"])
def test_autograd_functional_jacobian_vectorized(program):
    # vectorize=True batches the backward with torch's legacy vmap, which a HOP cannot
    # register a rule for: annotations and kernels run their eager rule there.
    f, reference = PROGRAMS[program]
    x = inputs()[0]
    got = torch.autograd.functional.jacobian(f, x, vectorize=True)
    torch.testing.assert_close(got, torch.autograd.functional.jacobian(reference, x))
