"""Frees the accelerated transformers' step graphs (and the layouts' peer buffers) before
``torch.distributed.destroy_process_group``.

An NCCL operation captured in a CUDA graph stays pending on its communicator for as long as the graph
lives, and destroying the group waits for pending operations: a script that ends with
``dist.destroy_process_group()`` while an accelerated pipeline still holds graphs of its parallel steps
would hang there (docs/PARALLELISM.md, "CUDA graphs under a layout"). Target: ``torch.distributed``'s
``destroy_process_group`` (the name scripts call). ``revert`` puts the original back.
"""

from __future__ import annotations

from types import ModuleType

from . import ours

PACKAGE = "torch"
CHECKED_VERSIONS = ("2.4.0", "2.14.0")

_ORIGINAL = "_omni_accel_original_destroy_process_group"


def apply(module: ModuleType) -> None:
    from omni_accel.cuda_graphs import release_all
    from omni_accel.parallel.peer_memory import forget_groups

    original = module.destroy_process_group

    def destroy_process_group(*args, **kwargs):
        release_all()
        forget_groups()  # the peer buffers, which the graphs used and their groups map
        return original(*args, **kwargs)

    destroy_process_group.__doc__ = original.__doc__
    setattr(module, _ORIGINAL, original)
    module.destroy_process_group = ours(destroy_process_group, original)


def revert(module: ModuleType) -> None:
    module.destroy_process_group = module.__dict__.pop(_ORIGINAL)
