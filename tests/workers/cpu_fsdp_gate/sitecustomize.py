"""On PYTHONPATH in tests/ranks/test_run.py only: accelerate 1.15 turns an FSDP plugin into DDP
on a host without GPUs (``AcceleratorState`` keeps ``MULTI_CPU`` and drops the plugin), so an
HF Trainer script configured for FSDP2 would run DDP on CPU. This lets accelerate take the path
it takes on GPUs (``fsdp2_prepare_model``: ``fully_shard`` for real), as
tests/workers/accelerate_worker.py does inline; the script itself stays as users write it."""

import functools

from accelerate import Accelerator
from accelerate.state import PartialState
from accelerate.utils import DistributedType

_init = Accelerator.__init__


@functools.wraps(_init)
def __init__(self, *args, **kwargs):
    _init(self, *args, **kwargs)
    plugin = kwargs.get("fsdp_plugin")
    if plugin is not None and self.state.distributed_type == DistributedType.MULTI_CPU:
        self.state.distributed_type = PartialState().distributed_type = DistributedType.FSDP
        self.state.fsdp_plugin = plugin


Accelerator.__init__ = __init__
