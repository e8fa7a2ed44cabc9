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
weight's read, their whole time, halves. A transformer pre-hook brings every copy up to date (in place where
the weight was written in place) before each forward without autograd: before a CUDA graph replay too, and
outside any compiled region; it drops the copies of the linears that compute as Diffusers' do (below), which
nothing reads. An eager call checks again that its weight is the one copied: an offload hook of its block or
of the transformer loads the weights after that pre-hook.

What a linear can take is decided as it stands, at ``accelerate`` and at each call, never by what was there
first: one the FP8 GEMM cannot take (``fp8_reason``), with a quantized or offloaded weight, or whose forward a
hook wraps (layerwise casting, leaf-level group offload, accelerate's offload: the hook casts or loads its
weight per call, and a copy of that would be made and dropped per call), registered before ``accelerate`` or
after, computes as Diffusers' does, as a native block with hooked submodules does; ``Fp8Weights.kept`` counts
those linears by reason for ``describe``.
"""

from __future__ import annotations

import copy
import functools
import weakref
from collections.abc import Callable

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ..forward_hooks import InstanceForward, OurHook, foreign_forward
from ..utils.tensor_kinds import quantized_or_absent, tensor_kind
from .fp8 import Fp8Weight, Fp8Weights, fp8_linear, fp8_reason, weight_only_linear

MIN_FP8_ROWS = 16  # fewer rows: an e4m3 GEMM does not pay, the weight-only GEMV does


class _Held:
    """The e4m3 copy a linear reads (None: none) and the weight it was made of (weak, with its address).
    One object that the forward keeps and changes: a Diffusers hook registered on the linear after it copies
    the forward's attributes into its wrapper (``functools.update_wrapper`` copies ``__dict__``), where a copy
    the forward rebinds would stay alive for good."""

    __slots__ = ("fp8", "made_of")

    def __init__(self) -> None:
        self.fp8: Fp8Weight | None = None
        self.made_of: tuple[weakref.ref, int] | None = None


class Fp8Linear(InstanceForward):
    """The instance ``forward`` of one ``nn.Linear``: its GEMM in FP8 (see the module docstring)."""

    def __init__(self, linear: nn.Linear, store: Fp8Weights) -> None:
        super().__init__(linear)
        self.store = store
        self.held = _Held()
        self.kept: str | None = (
            None  # why the linear computes as Diffusers' does, as last decided (None: FP8)
        )

    def __deepcopy__(self, memo: dict) -> Fp8Linear:
        # Registered before the module is copied: the module's copy holds this forward's copy.
        twin = memo[id(self)] = Fp8Linear.__new__(Fp8Linear)
        twin.module, twin.store = copy.deepcopy(self.module, memo), copy.deepcopy(self.store, memo)
        twin.inner, twin.enabled = copy.deepcopy(self.inner, memo), self.enabled
        twin.held = _Held()
        twin.kept = self.kept  # as the store's copy counts it
        return twin

    def __getstate__(self) -> dict:
        # the copy and the weak reference to the weight it was made of: made again after unpickling
        return {**self.__dict__, "held": _Held()}

    def refresh(self) -> None:
        """The copy of the linear's weight as it is now (host-side; never inside a compiled region), after
        the store's ``refresh``: a weight still the same tensor at the same address keeps its copy, which
        that re-made in place if the weight was written. None where the linear computes as Diffusers' does
        (``decide``)."""
        weight, held = self.module.weight, self.held
        if (
            self.kept is None
            and held.made_of is not None
            and held.made_of[0]() is weight
            and held.made_of[1] == weight.data_ptr()
            and _wrapping_hooks(self) is None
        ):
            return
        held.fp8 = self.store.of(weight, [weight]) if self.decide() is None else None
        held.made_of = (weakref.ref(weight), weight.data_ptr())

    def decide(self) -> str | None:
        """Why the linear as it stands computes as Diffusers' does, or None (FP8); counted in the store."""
        weight, current = self.module.weight, self.module.__dict__.get("forward")
        if current is not None and current is not self and not foreign_forward(self.module, current):
            # the class's forward again: a hook registered before accelerate, removed since, put it back
            self.inner = None
            self.install()
        reason = _wrapping_hooks(self)
        if reason is None and quantized_or_absent(weight):
            reason = f"its weight is {tensor_kind(weight)}: it computes as the module does"
        if reason is None:
            reason = fp8_reason(weight)
        if reason != self.kept:
            self.store.keep(self.kept, reason)
            self.kept = reason
        return reason

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # with autograd on, the linear as Diffusers computes it: the e4m3 copy has no gradient to give
        if not self.enabled or torch.is_grad_enabled():
            return self._forward()(x)
        if not torch.compiler.is_dynamo_compiling():
            # An offload hook (group offload of a block, model offload) may have loaded the weight since the
            # transformer's pre-hook copied what was there (the CPU's copy, or an empty disk-offloaded one).
            self.refresh()
        weight8 = self.held.fp8
        if weight8 is None:
            return self._forward()(x)
        if x.numel() < MIN_FP8_ROWS * x.shape[-1]:
            return weight_only_linear(x, weight8, self.module.bias)
        return fp8_linear(x, weight8, self.module.bias)


class _RefreshCopies(OurHook):
    """The transformer's forward pre-hook: every ``Fp8Linear``'s copy brought up to date, and those of the
    linears that compute as Diffusers' do dropped (nothing reads them)."""

    def __init__(self, forwards: list[Fp8Linear]) -> None:
        self.forwards = forwards

    def __deepcopy__(self, memo: dict) -> _RefreshCopies:
        return _RefreshCopies([copy.deepcopy(f, memo) for f in self.forwards])

    def __call__(self, module: nn.Module, args: tuple) -> None:
        # with autograd on every linear computes as Diffusers' does: a copy re-made now (after each
        # optimizer step) would not be read; the next call without it brings them up to date
        if torch.compiler.is_dynamo_compiling() or torch.is_grad_enabled():
            return
        store = self.forwards[0].store
        for forward in self.forwards:
            forward.refresh()
        # the copies of linears that compute as Diffusers' do (hooked...): dropped, not re-made at each write
        read = {id(forward.module.weight) for forward in self.forwards if forward.held.fp8 is not None}
        store.drop(
            forward.module.weight for forward in self.forwards if id(forward.module.weight) not in read
        )
        store.refresh()

    def drop_moved(self) -> None:
        """The transformer moved (``omni_accel.moves``): the copies of weights that are no longer where they
        were made of are let go of, by the store and by each linear."""
        for forward in self.forwards:
            made_of = forward.held.made_of
            if made_of is not None and (
                made_of[0]() is not forward.module.weight or made_of[1] != forward.module.weight.data_ptr()
            ):
                forward.held.fp8 = forward.held.made_of = None
        self.forwards[0].store.drop_moved()


def install_fp8_linears(
    transformer: nn.Module, blocks: list[tuple[str, nn.Module]], store: Fp8Weights
) -> tuple[_RefreshCopies | None, list[Callable[[], None]]]:
    """Gives every plain linear of ``blocks`` an ``Fp8Linear`` forward (one a hook wraps too: it decides per
    call, see the module docstring); returns the transformer's pre-hook that keeps their copies (None: no
    linear) and the undos."""
    forwards = []
    for _, block in blocks:
        adapters = _adapter_linears(block)
        for module in block.modules():
            if type(module) is nn.Linear and id(module) not in adapters:
                forward = Fp8Linear(module, store)
                forward.install()
                forward.decide()  # counted from the start: describe says what stays out before a call
                forwards.append(forward)
    if not forwards:
        return None, []
    store.linears += len(forwards)
    copies = _RefreshCopies(forwards)
    handle = transformer.register_forward_pre_hook(copies)

    # a partial of a module-level function, not a closure: the pipeline pickles with its undo
    return copies, [functools.partial(_uninstall, handle, forwards, store)]


def _uninstall(handle: RemovableHandle, forwards: list[Fp8Linear], store: Fp8Weights) -> None:
    handle.remove()
    for forward in forwards:
        forward.uninstall()
    store.release()


def _wrapping_hooks(forward: Fp8Linear) -> str | None:
    """What wraps the linear's forward, registered before ``forward`` (its ``inner``) or after (it calls
    ``forward``), or None: a Diffusers hook (layerwise casting, group offload) or another instance forward
    (accelerate's offload hooks)."""
    module = forward.module
    registry = module.__dict__.get("_diffusers_hook")
    if registry is not None and registry.hooks:
        return f"Diffusers hooks on the linear ({', '.join(sorted(registry.hooks))}) wrap its forward"
    current = module.__dict__.get("forward")
    if current is forward:
        wrapped = forward.inner is not None and foreign_forward(module, forward.inner)
        return (
            "a forward set on the linear before accelerate (e.g. accelerate's offload hook) wraps it"
            if wrapped
            else None
        )
    return "a forward set on the linear (e.g. accelerate's offload hook) wraps ours"


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
