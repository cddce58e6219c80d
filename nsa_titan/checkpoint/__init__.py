"""Distributed checkpointing on torch.distributed.checkpoint (DCP): exact, atomic, reshardable.

`manager.py` saves and resumes a run; `folders.py` knows which step folders are complete;
`states.py` holds what a checkpoint is made of; `model_file.py` reads and writes a model alone.
"""

from .errors import CheckpointError
from .folders import inspect_folder, scan
from .manager import CheckpointManager
from .model_file import check_fit, load_tensors, read_model_file, shapes, write_model_file
from .states import TrainState

__all__ = ["CheckpointError", "CheckpointManager", "TrainState", "check_fit", "inspect_folder", "load_tensors",
           "read_model_file", "scan", "shapes", "write_model_file"]
