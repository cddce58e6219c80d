"""NSA's C++ kernels for CPUs (`cpu_attention`, its sources in `csrc/`) and their family (`family.py`)."""
