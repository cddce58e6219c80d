"""How a run is spread over ranks: the process group, the device mesh and the per-block wrappers
applied to a plain model (`parallel`: apply_cp, apply_ac, apply_compile, apply_fsdp), and the split of one
sequence across context-parallel ranks (`context_parallel`). Nothing here imports the model."""
