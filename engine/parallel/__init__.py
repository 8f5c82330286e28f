"""More than one GPU: split mode (the blocks cut across two devices, engine/parallel/split.py) and
data parallel (one process per GPU: engine/parallel/data_parallel.py is the process group; engine/runs/launch.py
starts the processes)."""
from .config import ParallelConfig

__all__ = ["ParallelConfig"]
