"""nsa_titan: a torchtitan-style trainer for Native Sparse Attention language models."""
