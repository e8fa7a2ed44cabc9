"""The baselines every speed claim is measured against, built beside ours in the same process: (a)
Diffusers' module exactly as constructed needs nothing; (b) Diffusers' best switches (``best_switches``:
fused QKV where the class has it, the cuDNN attention backend, ``compile_repeated_blocks(fullgraph=True)``);
(c) Diffusers' documented FP8 recipe on top of (b) (``torchao_fp8``). And ``omni_ready``: ours called
until its background compiles and kernel builds are done, so timed calls are warm ones.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable
from typing import Any

import torch
from diffusers import DiffusionPipeline

import omni_accel
from omni_accel import kernel_builds

from .timing import wall


def cudnn_backend_for(model: torch.nn.Module) -> None:
    """Diffusers' cuDNN attention switch for one baseline model only. ``set_attention_backend`` also sets
    Diffusers' process-wide backend, which every other model in the process (ours included: a user's
    Diffusers choice wins there) would then follow; put that global back to Diffusers' default."""
    from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry

    model.set_attention_backend("_native_cudnn")
    _AttentionBackendRegistry.set_active_backend(AttentionBackendName.NATIVE)


def _processors(model: torch.nn.Module) -> set[type]:
    """The classes of the attention processors of ``model``'s attention modules."""
    return {type(m.processor) for m in model.modules() if getattr(m, "processor", None) is not None}


def _backend_ignored_by(model: torch.nn.Module) -> list[str]:
    """The attention processors that do not call Diffusers' dispatcher, so ignore a backend switch
    (SD3's JointAttnProcessor2_0 calls F.scaled_dot_product_attention itself)."""
    ignoring = []
    for processor in _processors(model):
        try:
            if "dispatch_attention_fn" not in inspect.getsource(processor.__call__):
                ignoring.append(processor.__name__)
        except (OSError, TypeError):  # no source to read
            ignoring.append(f"{processor.__name__}?")
    return sorted(ignoring)


def best_switches(model: torch.nn.Module, tiny: bool) -> dict[str, Any]:
    """Diffusers' best switches on ``model``, in place; what applied."""
    info: dict[str, Any] = {}
    if hasattr(model, "fuse_qkv_projections"):
        try:
            model.fuse_qkv_projections()
            fused = sum(bool(getattr(m, "fused_projections", False)) for m in model.modules())
            info["fuse_qkv"] = f"called: {fused} attention modules fused"
        except Exception as error:  # e.g. "not supported for models having added KV projections"
            info["fuse_qkv"] = f"not applied: {type(error).__name__}: {error}"
    else:
        info["fuse_qkv"] = f"not applied: {type(model).__name__} has no fuse_qkv_projections"
    info["attention_processors"] = sorted(p.__name__ for p in _processors(model))
    if tiny:
        info["cudnn"] = "skipped (tiny run on CPU)"
    else:
        cudnn_backend_for(model)
        ignoring = _backend_ignored_by(model)
        info["cudnn"] = "_native_cudnn set" + (f" (ignored by {', '.join(ignoring)})" if ignoring else "")
    options: dict[str, Any] = dict(fullgraph=True, backend="eager") if tiny else dict(fullgraph=True)
    if getattr(model, "_repeated_blocks", None):
        model.compile_repeated_blocks(**options)
        info["compile"] = f"compile_repeated_blocks({options}) over {list(model._repeated_blocks)}"
    else:
        lists = [
            (name, child)
            for name, child in model.named_children()
            if isinstance(child, torch.nn.ModuleList) and name.endswith("blocks") and len(child)
        ]
        for _, blocks in lists:
            for block in blocks:
                block.compile(**options)
        names = ", ".join(f"{name}[0..{len(blocks) - 1}]" for name, blocks in lists)
        info["compile"] = f"no _repeated_blocks: each of {names} .compile({options})"
    return info


def first_best_call(model: torch.nn.Module, fn: Callable[[], Any], device: str, info: dict) -> tuple:
    """(b)'s first call (it compiles); where cuDNN attention refuses these inputs, Diffusers' native
    backend instead (said in ``info``)."""
    try:
        return wall(fn, device)
    except Exception as error:
        if not info["cudnn"].startswith("_native_cudnn"):
            raise
        from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry

        model.set_attention_backend("native")
        _AttentionBackendRegistry.set_active_backend(AttentionBackendName.NATIVE)
        info["cudnn"] = f"failed at the first call ({type(error).__name__}: {error}); native backend used"
        return wall(fn, device)


def omni_ready(holder: DiffusionPipeline, fn: Callable[[], Any], device: str) -> tuple[float, list[str]]:
    """Calls (c) until its background compile and kernel builds are done and a CUDA graph of the compiled
    step is captured: one call, the waits, three calls; their wall seconds and the compiler's summary."""
    runtime = omni_accel.describe(holder).components[0].runtime
    compiler = getattr(runtime, "compiler", None)
    t0 = time.perf_counter()
    fn()
    if compiler is not None:
        # compiles queued by a call start at the next one (a step of a pipeline); one forward per "step"
        # here: start them now, or the wait returns at once and the timed calls race the compiler
        compiler.start_compiles()
        compiler.wait()
    kernel_builds.wait()
    for _ in range(3):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0, compiler.summary() if compiler is not None else ["no compiler"]


def torchao_fp8(model: torch.nn.Module, compiled: bool = True) -> torch.nn.Module:
    """Diffusers' documented FP8 recipe: torchao's dynamic float8 (row scales) on every linear, then the
    best switches. ``fuse_qkv_projections`` first: it concatenates bf16 weights, which torchao then
    quantizes. ``compiled=False``: the same quantization run eagerly (its errors per block can be read
    with hooks, which a fullgraph-compiled block would not take)."""
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, quantize_

    model.fuse_qkv_projections()
    quantize_(model, Float8DynamicActivationFloat8WeightConfig(granularity=PerRow()))
    cudnn_backend_for(model)
    if compiled:
        model.compile_repeated_blocks(fullgraph=True)
    return model
