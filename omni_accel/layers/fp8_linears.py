"""``quantize="fp8"`` on a transformer without native blocks (the generic tier): the plain linears of its
repeated blocks compute through ``layers.fp8`` (the same e4m3 quantization as native blocks), by an
instance ``forward`` on each, so that the blocks' own code, compiled regionally or not, calls our FP8 GEMM
where it calls the linear.

Why not torchao's float8 (which Diffusers documents): its weights become tensor subclasses in place of the
parameters, which changes ``state_dict``, LoRA merging and ``restore`` for the user, and it cannot even be
constructed without an FP8 GPU; here the bf16 parameters stay what they are, the copies live in one
``Fp8Weights`` store, and the result is the same quantization the native blocks compute (tested on the CPU
against Diffusers with quantized projections).

A LoRA's own linears (peft's ``lora_A`` / ``lora_B``) stay as they are, loaded before ``accelerate`` or
after, and with autograd on every linear computes as Diffusers' does. Calls of fewer than ``MIN_FP8_ROWS``
rows (per-sample conditioning projections, such as the AdaLN modulation) quantize the weight alone
(``weight_only_linear``, as native blocks' modulations): too few rows for an e4m3 GEMM to pay, but the
weight's read, their whole time, halves. Linears the FP8 GEMM cannot take (``fp8_reason``), quantized or
offloaded weights stay as they are. A transformer pre-hook brings every copy up to date (in place where the
weight was written in place) before each forward: before a CUDA graph replay too, and outside any compiled
region. An eager call checks again that its weight is the one copied: an offload hook of its block or of the
transformer loads the weights after that pre-hook.
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Callable

import torch
from torch import nn

from ..forward_hooks import InstanceForward, OurHook
from .fp8 import Fp8Weight, Fp8Weights, fp8_linear, fp8_reason, weight_only_linear
from .projection import _quantized_or_absent

MIN_FP8_ROWS = 16  # fewer rows: an e4m3 GEMM does not pay, the weight-only GEMV does


class Fp8Linear(InstanceForward):
    """The instance ``forward`` of one ``nn.Linear``: its GEMM in FP8 (see the module docstring)."""

    def __init__(self, linear: nn.Linear, store: Fp8Weights) -> None:
        super().__init__(linear)
        self.store = store
        self.weight8: Fp8Weight | None = None
        self._made_of: tuple[weakref.ref, int] | None = None  # the weight ``weight8`` was made of, and where

    def __deepcopy__(self, memo: dict) -> Fp8Linear:
        # Registered before the module is copied: the module's copy holds this forward's copy.
        twin = memo[id(self)] = Fp8Linear.__new__(Fp8Linear)
        twin.module, twin.store = copy.deepcopy(self.module, memo), copy.deepcopy(self.store, memo)
        twin.inner, twin.enabled = copy.deepcopy(self.inner, memo), self.enabled
        twin.weight8 = twin._made_of = None
        return twin

    def refresh(self) -> None:
        """The copy of the linear's weight as it is now (host-side; never inside a compiled region), after
        the store's ``refresh``: a weight still the same tensor at the same address keeps its copy, which
        that re-made in place if the weight was written."""
        weight = self.module.weight
        if (
            self._made_of is not None
            and self._made_of[0]() is weight
            and self._made_of[1] == weight.data_ptr()
        ):
            return
        usable = not _quantized_or_absent(weight) and fp8_reason(weight) is None
        self.weight8 = self.store.of(weight, [weight]) if usable else None
        self._made_of = (weakref.ref(weight), weight.data_ptr())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # with autograd on, the linear as Diffusers computes it: the e4m3 copy has no gradient to give
        if not self.enabled or torch.is_grad_enabled():
            return self._forward()(x)
        if not torch.compiler.is_dynamo_compiling():
            # An offload hook (group offload of a block, model offload) may have loaded the weight since the
            # transformer's pre-hook copied what was there (the CPU's copy, or an empty disk-offloaded one).
            self.refresh()
        if self.weight8 is None:
            return self._forward()(x)
        if x.numel() < MIN_FP8_ROWS * x.shape[-1]:
            return weight_only_linear(x, self.weight8, self.module.bias)
        return fp8_linear(x, self.weight8, self.module.bias)


class _RefreshCopies(OurHook):
    """The transformer's forward pre-hook: every ``Fp8Linear``'s copy brought up to date."""

    def __init__(self, forwards: list[Fp8Linear]) -> None:
        self.forwards = forwards

    def __deepcopy__(self, memo: dict) -> _RefreshCopies:
        return _RefreshCopies([copy.deepcopy(f, memo) for f in self.forwards])

    def __call__(self, module: nn.Module, args: tuple) -> None:
        if torch.compiler.is_dynamo_compiling():
            return
        self.forwards[0].store.refresh()
        for forward in self.forwards:
            forward.refresh()


def install_fp8_linears(
    transformer: nn.Module, blocks: list[tuple[str, nn.Module]], store: Fp8Weights
) -> tuple[int, list[Callable[[], None]]]:
    """Gives every plain linear of ``blocks`` an ``Fp8Linear`` forward; returns how many and the undos."""
    forwards = []
    for _, block in blocks:
        adapters = _adapter_linears(block)
        for module in block.modules():
            if type(module) is nn.Linear and "forward" not in module.__dict__ and id(module) not in adapters:
                forward = Fp8Linear(module, store)
                forward.install()
                forwards.append(forward)
    if not forwards:
        return 0, []
    handle = transformer.register_forward_pre_hook(_RefreshCopies(forwards))

    def undo() -> None:
        handle.remove()
        for forward in forwards:
            forward.uninstall()
        store.release()

    return len(forwards), [undo]


def _adapter_linears(block: nn.Module) -> set[int]:
    """The ids of the linears inside LoRA layers (peft's ``lora_A`` / ``lora_B``) of ``block``: an adapter
    loaded before ``accelerate`` runs as one loaded after, in full precision beside the FP8 base GEMM."""
    found = set()
    for layer in block.modules():
        for name in ("lora_A", "lora_B"):
            adapters = getattr(layer, name, None)
            if isinstance(adapters, nn.ModuleDict):
                found.update(id(module) for module in adapters.modules())
    return found
