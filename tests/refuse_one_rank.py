"""Run by test_distributed under scaletrain.torchrun, 2 processes: rank 1 refuses its input
(torchrun.hand_over) while rank 0 waits on it in a collective. Each process started appends
its rank to the file given (argv[1]), so the test counts the attempts."""

import os
import sys

import torch
import torch.distributed as dist

from scaletrain.torchrun import hand_over

with open(sys.argv[1], "a") as f:
    f.write(f"{os.environ['RANK']}\n")
dist.init_process_group("gloo")
if dist.get_rank() == 1:
    hand_over("rank 1 refused its input")  # (waits to be stopped)
    sys.exit(0)
dist.all_reduce(torch.ones(1))  # waits on rank 1: its exit would fail this, and torchrun restart both
