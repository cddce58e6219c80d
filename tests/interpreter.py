"""A script's interpreted Triton checks, as `conftest.interpreted` runs them: `python tests/interpreter.py SCRIPT
FAMILY CASE...` (under TRITON_INTERPRET=1) imports what SCRIPT imports once, then runs SCRIPT as `__main__` with
`FAMILY CASE` for each case in a child forked from that process (each case starts from the same state, none sees
another's changes), on Triton's interpreter made faster where it spends its time on itself, each change giving the
same results bit for bit (`tests/README.md`: "Interpreted Triton"). Before each case's output it prints
`MARK CASE`, after it `MARK exit CODE`."""

from __future__ import annotations

import argparse
import os
import runpy
import sys
import traceback

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


MARK = "== interpreted case"
"""The line that opens and closes each case's output (`conftest.interpreted` reads between them)."""


def run_case(script: str, family: str, case: str) -> int:
    """`script family case` as `__main__` in a forked child: its exit code."""
    print(f"{MARK} {case}", flush=True)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            sys.argv = [script, family, case]
            runpy.run_path(script, run_name="__main__")
            code = 0
        except BaseException:  # noqa: BLE001 (reported on stderr, the case's exit code says it failed)
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    print(f"{MARK} exit {code}", flush=True)
    return code


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("script", help="a test module whose `__main__` runs one case: SCRIPT FAMILY CASE")
    parser.add_argument("family", help="the family the script checks (triton)")
    parser.add_argument("cases", nargs="+", help="the cases, each in a child forked from one import of SCRIPT's")
    args = parser.parse_args()
    fast_xor_reductions()
    builtins_listed_once()
    runpy.run_path(args.script, run_name="interpreted")  # its imports (torch, Triton, the kernels), once
    sys.exit(1 if any([run_case(args.script, args.family, case) for case in args.cases]) else 0)
