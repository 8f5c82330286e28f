"""Whole training runs: reuse a finished one (result_reuse.py), or start one worker process per GPU and
watch them (launch.py starts worker.py). It sits above engine/train/, which trains in one process."""
