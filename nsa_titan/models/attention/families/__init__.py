"""NSA's kernel families, one folder each, one interface (`base.Family`), chosen once per run (`choose`).

  reference.py  dense masks for every branch, the exact definition: the yardstick
  pytorch/      the branch-by-branch path: PyTorch chunks and tiles (`fast.nsa_fast`), its custom ops; the torch
                family, and flash (its window through flash-attn)
  cpp/          NSA's C++ kernels for CPUs (`cpu_attention`, `csrc/`), through the branch-by-branch path
  triton/       the whole attention as one op of Triton kernels (CUDA; TRITON_INTERPRET=1 on a CPU)
  flex/         cmp and win through FlexAttention, sel through pytorch/'s op (CUDA; forward on a CPU)

This file imports nothing, so that a family's kernels can be imported without the others.
"""
