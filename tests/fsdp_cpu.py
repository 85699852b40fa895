"""Run a recipe under FSDP on CPU processes (gloo): ``torchrun ... tests/fsdp_cpu.py recipes/x.py ARGS``.

Accelerate turns ``ACCELERATE_USE_FSDP`` on only for accelerator devices and makes plain multi-CPU data
parallel of it; ``fully_shard`` itself runs on gloo. This launcher makes the state Accelerate builds an FSDP
one (its plugin read from the same environment variables) and then runs the recipe as its own ``__main__``,
so the recipe's code is exercised unchanged, as on GPUs."""

from __future__ import annotations

import runpy
import sys

from accelerate.state import AcceleratorState
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

_init = AcceleratorState.__init__


def _fsdp_init(self: AcceleratorState, *args, **kwargs) -> None:
    _init(self, *args, **kwargs)
    if self.distributed_type == DistributedType.MULTI_CPU:
        self.distributed_type = DistributedType.FSDP
        self.fsdp_plugin = kwargs.get("fsdp_plugin") or FullyShardedDataParallelPlugin()


AcceleratorState.__init__ = _fsdp_init
script, sys.argv = sys.argv[1], sys.argv[1:]
sys.path.insert(0, str(__import__("pathlib").Path(script).resolve().parent))
runpy.run_path(script, run_name="__main__")
