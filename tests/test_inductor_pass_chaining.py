"""Importing ``hops`` writes no inductor setting; a user's post-grad pass keeps running.

Inductor lowers this package's HOP nodes in a post-grad custom pass. It is installed when a
program holding a HOP is first traced, wrapping whatever pass the user set, before or after
``import hops``, and again when the user sets another later. Each scenario runs in a fresh
interpreter: the package is imported there for the first time.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

PROGRAM = """
import torch
from torch._inductor import config

runs = {}

def user_pass(name):
    def run(graph):
        runs[name] = runs.get(name, 0) + 1
    return run

def compile_and_check(hops, fn_name):
    def step(c, w):
        c = c + torch.tanh(c @ w)
        return c, c
    def program(h, ws):
        last, ys = hops.scan(step, h, ws)
        return last.sum() + ys.sum()
    program.__name__ = fn_name
    h = torch.randn(4, 8, requires_grad=True)
    ws = (torch.randn(3, 8, 8) / 8).requires_grad_()
    torch._dynamo.reset()
    loss = torch.compile(program, fullgraph=True)(h, ws)
    grads = torch.autograd.grad(loss, (h, ws))
    expected = program(h, ws)
    expected_grads = torch.autograd.grad(expected, (h, ws))
    torch.testing.assert_close(loss, expected)
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want)
"""


def run(script: str) -> None:
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(PROGRAM) + textwrap.dedent(script)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]


def test_user_pass_set_after_the_import_before_any_compile_runs_and_hops_still_compile():
    # The import writes no pass (a compile holding a HOP may install one, chained with the
    # user's). A pass set before the import, and one set after a first compile: the every-sample
    # test below.
    run(
        """
        import hops
        assert config.post_grad_custom_pre_pass is None, config.post_grad_custom_pre_pass
        config.post_grad_custom_pre_pass = user_pass("later")
        compile_and_check(hops, "second")
        assert runs.get("later", 0) >= 2, runs
        """
    )


SNAPSHOT = """
import inspect, sys, torch
import torch._dynamo.convert_frame, torch._dynamo.symbolic_convert, torch._dynamo.eval_frame
import torch._dynamo.variables.functions, torch._dynamo.variables.higher_order_ops
import torch._inductor.config, torch._functorch.config, torch._dynamo.config
import torch._export.serde.serialize, torch._inductor.graph

MODULES = [
    torch._dynamo.convert_frame, torch._dynamo.symbolic_convert, torch._dynamo.eval_frame,
    torch._dynamo.variables.functions, torch._dynamo.variables.higher_order_ops,
    torch._export.serde.serialize, torch._inductor.graph,
]

def functions():
    # Every module-level function and class, and every class's own methods, by identity
    # (counters and caches change as programs compile; code must not).
    def code(value):
        return callable(value) or isinstance(value, (staticmethod, classmethod, property))
    seen = {}
    for module in MODULES:
        for name, value in vars(module).items():
            if code(value):
                seen[f"{module.__name__}.{name}"] = id(value)
            if inspect.isclass(value) and value.__module__ == module.__name__:
                for attr, member in vars(value).items():
                    if code(member):
                        seen[f"{module.__name__}.{name}.{attr}"] = id(member)
    return seen

def settings():
    return {
        config.__name__: {k: repr(v) for k, v in config.get_config_copy().items()}
        for config in (torch._inductor.config, torch._functorch.config, torch._dynamo.config)
    }

def changed(before, after):
    return sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
"""


def test_import_and_compiling_every_sample_replace_no_dynamo_function_and_keep_the_users_pass():
    # Importing the package: the Dynamo HOP-variable table gains this package's entries (a
    # registration), but no function of Dynamo's frame compiler, tracer or variables, of
    # torch.export's serializer (it gains a namespace, a registration) or of inductor's graph
    # lowering is replaced or added, on any version, and no setting of Dynamo, AOTAutograd or
    # inductor is written (the user's pass is theirs). After a program holding each HOP
    # compiled, the only functions that differ are the ones _compat.COMPILE_PATCHES declares
    # (before torch 2.15, SubgraphLowering.__init__, wrapped at the first compile; on 2.9, one
    # method Dynamo lacks, added at the first scan it traces), and a user's post-grad pass, set
    # before the import and replaced after it, ran in each compile.
    subprocess_check(
        """
        runs = {}
        def user_pass(name):
            def run(graph):
                runs[name] = runs.get(name, 0) + 1
            return run
        torch._inductor.config.post_grad_custom_pre_pass = user_pass("before")
        before_functions, before_settings = functions(), settings()
        import hops
        after_settings = settings()
        from hops._compat import COMPILE_PATCHES
        assert changed(before_functions, functions()) == [], changed(before_functions, functions())
        for module, values in before_settings.items():
            assert not changed(values, after_settings[module]), (module, changed(values, after_settings[module]))
        from tests.helpers.samples_together import together, together_inputs
        # Inference graphs of every sample as one program (test_inductor.py compiles every
        # sample's backward too), compiled with the pass set before the import, then again
        # with one set after it.
        program, inputs = together(), [t.detach() for t in together_inputs()]
        expected = program(*inputs)
        for name in ("before", "after"):
            if name == "after":
                torch._inductor.config.post_grad_custom_pre_pass = user_pass("after")
            torch._dynamo.reset()
            got = torch.compile(program, fullgraph=True)(*inputs)
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)
        after_compiles = changed(before_functions, functions())
        assert after_compiles == sorted(COMPILE_PATCHES), after_compiles
        assert runs.get("before", 0) == runs.get("after", 0) >= 1, runs  # (every graph of each compile)
        """
    )


def subprocess_check(script: str, *argv: str) -> None:
    import os

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(SNAPSHOT) + textwrap.dedent(script), *argv],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=root,
    )
    assert done.returncode == 0, done.stderr[-3000:]
