"""One interpreted Triton check, as `conftest.interpreted` runs it: `python tests/interpreter.py SCRIPT ARG...`
(under TRITON_INTERPRET=1) runs SCRIPT as `__main__` with ARG... on Triton's interpreter made faster where it
spends its time on itself, each change giving the same results bit for bit (`tests/README.md`: "Interpreted
Triton")."""

from __future__ import annotations

import runpy
import sys

import numpy as np


def fast_xor_reductions() -> None:
    """The interpreter's integer xor reduction (`tl.xor_sum`, which `tl.sort` and `tl.topk` call at each step of
    their bitonic merge) in one numpy call, not an element at a time in Python: bit for bit the same result (xor
    is exact, associative and commutative), and the Triton family's cases spend about half their time there
    without it (group1: 68 of 117 s)."""
    import triton.language as tl
    from triton.runtime import interpreter

    slow = interpreter.ReduceOps.apply_impl

    def apply_impl(self, input):  # noqa: A002 (Triton's name)
        data = input[0].handle.data
        if self.combine_fn is not tl.standard._xor_combine or len(input) != 1 or data.dtype.kind not in "iu":
            return slow(self, input)
        return self.to_tensor(np.bitwise_xor.reduce(data, axis=self.axis, keepdims=self.keep_dims), input[0].dtype)

    interpreter.ReduceOps.apply_impl = apply_impl


def builtins_listed_once() -> None:
    """The interpreter patches `triton.language`'s builtins again at every call of a `@triton.jit` function,
    listing each package's members each time (`inspect.getmembers`: a third of the decode step's time): here the
    names of each package's builtins are listed once and every call patches the same members as before (those
    still builtins: the ones patched already are skipped, as before)."""
    import inspect

    import triton.language as tl
    from triton.runtime import interpreter

    names: dict[int, list[str]] = {}

    def _patch_builtin(pkg, builder, scope) -> None:
        if id(pkg) not in names:
            names[id(pkg)] = [name for name, member in inspect.getmembers(pkg) if tl.core.is_builtin(member)]
        for name in names[id(pkg)]:
            member = getattr(pkg, name)
            if tl.core.is_builtin(member):
                interpreter._patch_attr(pkg, name, member, builder, scope)

    interpreter._patch_builtin = _patch_builtin


if __name__ == "__main__":
    script, sys.argv = sys.argv[1], sys.argv[1:]
    fast_xor_reductions()
    builtins_listed_once()
    runpy.run_path(script, run_name="__main__")
