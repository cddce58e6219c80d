"""The Triton family: the kernels (`triton_nsa*.py`) and the host side, the op (`family.py`)."""
