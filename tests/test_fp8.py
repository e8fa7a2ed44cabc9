"""``quantize="fp8"`` on native blocks, on the CPU in float32: the oracle is Diffusers' own module with each
projection of its blocks computing from its input and weight quantized as ``layers.fp8`` specifies, e4m3
with row / output-channel scales (the AdaLN modulation from its weight alone). The CPU runs the same
quantization and an FP8 GEMM (``torch._scaled_mm``), so the native path must land within float32 rounding
of that oracle, through weight edits, LoRA, fuse/unfuse, deepcopy and restore; and it must be lossy, as
``describe`` says."""

from __future__ import annotations

import copy
import gc
import types
import weakref

import pytest
import torch
from conftest import flux_inputs, random_flux_transformer, rel_err
from multirank import run_multirank
from native_contract import _Holder
from torch import nn

import omni_accel
from omni_accel.layers import fp8

# The AdaLN modulation linears (by name suffix): FLUX.1 / Wan, Qwen-Image, Z-Image, MiniMax-H3
_MODULATIONS = (
    "norm1.linear",
    "norm1_context.linear",
    "norm.linear",
    "scale_shift_table",
    "img_mod.1",
    "txt_mod.1",
    "adaLN_modulation.0",
    "adaln_proj.linear",
)
_TIGHT = 1e-5
_ONE_FLIP = 1e-4


def _dequantized(x: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rows, w = fp8.quantize_rows(x), fp8.quantize_weight(weight)
    return (rows.data.float() * rows.scale).reshape(x.shape), w.data.float() * w.scale.t()


def _emulated_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return nn.functional.linear(*_dequantized(x, self.weight), self.bias)


def _emulated_weight_only_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """An AdaLN modulation (a row per sample): the weight alone quantized."""
    w = fp8.quantize_weight(self.weight)
    return nn.functional.linear(x, w.data.float() * w.scale.t(), self.bias)


def _emulated_split_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """An input-split projection under tensor parallelism: each rank quantizes its slice of the inputs
    and of the weight's columns (``self.shards``: the input indices of each rank), the products summed."""
    out = sum(nn.functional.linear(*_dequantized(x[..., idx], self.weight[:, idx])) for idx in self.shards)
    return out if self.bias is None else out + self.bias


def emulated(model: nn.Module, blocks: tuple[str, ...], shards: dict[str, list] | None = None) -> nn.Module:
    """``model`` with every linear of its ``blocks`` lists but LoRA's own A/B computing from FP8-quantized
    input and weight (dequantized, float32 product), the AdaLN projections from their quantized weight alone.
    ``blocks``: the block lists' module names (``token_refiner.refiner_blocks``: a nested one). ``shards``: the
    input-split linears (by name suffix) of a tensor-parallel layout, and each rank's input indices."""
    for name, module in model.named_modules():
        in_blocks = any(name.startswith(f"{blocks_name}.") for blocks_name in blocks)
        lora = ".lora_A." in name or ".lora_B." in name
        if type(module) is nn.Linear and in_blocks and not lora and name.endswith(_MODULATIONS):
            module.forward = types.MethodType(_emulated_weight_only_forward, module)
        elif type(module) is nn.Linear and in_blocks and not lora:
            split = next((v for k, v in (shards or {}).items() if name.endswith(k)), None)
            module.forward = types.MethodType(_emulated_forward, module)
            if split is not None:
                module.shards = split
                module.forward = types.MethodType(_emulated_split_forward, module)
    return model


_FLUX_BLOCKS = ("transformer_blocks", "single_transformer_blocks")


def _flux():
    model = random_flux_transformer()
    return model, flux_inputs(model)


def _sample(model, inputs):
    with torch.no_grad():
        return model(**inputs).sample


def _oracle(model, inputs, blocks=_FLUX_BLOCKS):
    return _sample(emulated(copy.deepcopy(model), blocks), inputs)


def test_native_flux_fp8_is_diffusers_with_quantized_projections_and_says_lossy():
    model, inputs = _flux()
    plain, oracle = _sample(model, inputs), _oracle(model, inputs)
    pipe = omni_accel.accelerate(_Holder(copy.deepcopy(model)), quantize="fp8")
    out = _sample(pipe.transformer, inputs)
    assert rel_err(out, oracle) < _TIGHT
    assert rel_err(out, plain) > 1e-3  # lossy indeed
    report = omni_accel.describe(pipe)
    text = str(report)
    assert "LOSSY: quantize='fp8'" in text and "fp8 (lossy): 29 projection weights in e4m3" in text
    store = report.components[0].runtime.fp8
    assert store.quantized == 29  # 22 of tokens, 7 modulations; once each: the second call reuses them
    _sample(pipe.transformer, inputs)
    assert store.quantized == 29
    omni_accel.restore(pipe)
    assert torch.equal(_sample(pipe.transformer, inputs), plain)
    assert all(type(p) is nn.Parameter for p in pipe.transformer.parameters())


def test_native_wan_fp8_is_diffusers_with_quantized_projections():
    from conftest import random_wan_transformer
    from test_wan_native import wan_inputs

    model = random_wan_transformer()
    inputs = wan_inputs(model)
    oracle = _oracle(model, inputs, ("blocks",))
    pipe = omni_accel.accelerate(_Holder(copy.deepcopy(model)), quantize="fp8")
    assert rel_err(_sample(pipe.transformer, inputs), oracle) < _TIGHT
    assert omni_accel.describe(pipe).components[0].runtime.fp8.copies > 0


def test_native_flux2_fp8_is_diffusers_with_quantized_projections():
    """FLUX.2: every projection of its blocks in FP8 (its AdaLN modulations run at model level, in bf16),
    the single block's one QKV+MLP linear as one FP8 GEMM whose outputs are read by parts."""
    from conftest import random_flux2_transformer
    from test_flux2_native import flux2_inputs

    model = random_flux2_transformer()
    inputs = flux2_inputs(model)
    oracle = _oracle(model, inputs)
    pipe = omni_accel.accelerate(_Holder(copy.deepcopy(model)), quantize="fp8")
    assert rel_err(_sample(pipe.transformer, inputs), oracle) < _TIGHT
    store = omni_accel.describe(pipe).components[0].runtime.fp8
    assert store.quantized == 2 * 8 + 2 * 2  # double: 2 packed QKV, 2 out, 4 MLP; single: 2 linears


def _first_output(model, inputs) -> torch.Tensor:
    """The output tensor of a model that returns a dataclass, a tuple, or (Z-Image) a list per sample."""
    with torch.no_grad():
        out = model(**inputs, return_dict=False)[0]
    return torch.stack(list(out)) if isinstance(out, list | tuple) else out


@pytest.mark.parametrize(
    "family, blocks, quantized",
    [
        # per block, image and text each: packed QKV, out, 2 MLP linears, the modulation (weight alone)
        ("qwenimage", ("transformer_blocks",), 2 * 10),
        # the refiners' blocks too: packed QKV, out, packed w1/w3, w2, and the AdaLN where a block has one
        ("zimage", ("noise_refiner", "context_refiner", "layers"), 19),
        # the text token refiner's blocks as well as the main blocks (their per-row AdaLN projection)
        ("minimax_h3", ("transformer_blocks", "token_refiner.refiner_blocks"), 14),
    ],
)
def test_native_fp8_of_the_later_families_is_diffusers_with_quantized_projections(family, blocks, quantized):
    import conftest

    inputs_of = {
        "qwenimage": ("test_qwenimage_native", "qwen_inputs"),
        "zimage": ("test_zimage_native", "zimage_inputs"),
        "minimax_h3": ("test_minimax_h3_native", "minimax_inputs"),
    }[family]
    model = getattr(conftest, f"random_{family}_transformer")()
    inputs = getattr(__import__(inputs_of[0]), inputs_of[1])(model)
    plain = _first_output(model, inputs)
    oracle = _first_output(emulated(copy.deepcopy(model), blocks), inputs)
    pipe = omni_accel.accelerate(_Holder(copy.deepcopy(model)), quantize="fp8")
    out = _first_output(pipe.transformer, inputs)
    assert rel_err(out, oracle) < _TIGHT, rel_err(out, oracle)
    assert rel_err(out, plain) > 10 * rel_err(out, oracle)  # lossy indeed, and by the quantization
    report = omni_accel.describe(pipe)
    assert "LOSSY: quantize='fp8'" in str(report) and report.components[0].runtime.fp8.quantized == quantized
    omni_accel.restore(pipe)
    assert torch.equal(_first_output(pipe.transformer, inputs), plain)


@pytest.mark.parametrize("edit", ["in_place", "through_data", "load_state_dict", "assign"])
def test_weight_edits_requantize(edit):
    model, inputs = _flux()
    pipe = omni_accel.accelerate(_Holder(copy.deepcopy(model)), quantize="fp8")
    ours = pipe.transformer
    _sample(ours, inputs)
    store = omni_accel.describe(pipe).components[0].runtime.fp8
    copies = store.copies
    edited = copy.deepcopy(model)
    with torch.no_grad():
        for m in (edited, ours):
            if edit == "in_place":
                m.single_transformer_blocks[1].proj_out.weight.mul_(1.5)
                m.transformer_blocks[0].attn.to_k.weight.add_(0.1)  # inside a packed QKV
            elif edit == "through_data":
                m.transformer_blocks[0].ff.net[2].weight.data.mul_(-1)
        state = {k: v * 0.5 if "proj_mlp" in k else v for k, v in edited.state_dict().items()}
        if edit in ("load_state_dict", "assign"):
            edited.load_state_dict(state)
            ours.load_state_dict(state, assign=edit == "assign")
    assert rel_err(_sample(ours, inputs), _oracle(edited, inputs)) < _TIGHT
    if edit != "assign":  # in place: the same copies, re-made where they went stale
        assert store.copies == copies


def test_in_place_requantization_keeps_the_copy_where_it_is():
    store = fp8.Fp8Weights()
    weight = nn.Parameter(torch.randn(32, 64))
    first = store.of(weight, [weight])
    address = first.data.data_ptr()
    with torch.no_grad():
        weight.mul_(3)
    store.refresh()  # what a CUDA graph replay is preceded by
    assert store.quantized == 2 and first.data.data_ptr() == address
    expected = fp8.quantize_weight(weight)
    assert torch.equal(first.scale, expected.scale) and torch.equal(first.data.float(), expected.data.float())
    store.release()
    assert type(weight) is nn.Parameter


def test_refresh_remakes_a_copy_only_after_its_weight_was_written():
    """``refresh`` runs before every replay and checks every weight at once: nothing is re-made while
    nothing was written, and every kind of change is still seen (a write, through ``.data`` too, a weight
    dropped, a copy made after the last check)."""
    store = fp8.Fp8Weights()
    a, b = nn.Parameter(torch.randn(32, 64)), nn.Parameter(torch.randn(32, 64))
    store.of(a, [a])
    store.of(b, [b])
    store.refresh()
    assert store.quantized == 2
    with torch.no_grad():
        b.add_(1)
    store.refresh()
    store.refresh()
    assert store.quantized == 3
    a.data.mul_(2)
    store.refresh()
    assert store.quantized == 4
    del b
    gc.collect()
    store.refresh()
    store.refresh()
    assert store.copies == 1
    c = nn.Parameter(torch.randn(32, 64))
    store.of(c, [c])
    with torch.no_grad():
        c.mul_(2)
    store.refresh()
    assert store.quantized == 6 and store.copies == 2
    store.release()


def test_lora_runs_beside_the_fp8_gemm_and_fuses_into_it():
    from peft import LoraConfig

    model, inputs = _flux()
    config = LoraConfig(r=2, lora_alpha=2, target_modules=["to_q", "to_out.0", "proj_out", "ff.net.2"])
    model.add_adapter(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.05)
    pipe = omni_accel.accelerate(_Holder(copy.deepcopy(model)), quantize="fp8")
    ours = pipe.transformer
    assert rel_err(_sample(ours, inputs), _oracle(model, inputs)) < _TIGHT  # adapters in full precision
    fused = copy.deepcopy(model)
    for m in (fused, ours):
        m.fuse_lora()
    assert rel_err(_sample(ours, inputs), _oracle(fused, inputs)) < _TIGHT  # the merged weights quantized
    for m in (fused, ours):
        m.unfuse_lora()
    assert rel_err(_sample(ours, inputs), _oracle(model, inputs)) < _TIGHT


def test_deepcopy_gets_its_own_copies():
    model, inputs = _flux()
    pipe = omni_accel.accelerate(_Holder(copy.deepcopy(model)), quantize="fp8")
    _sample(pipe.transformer, inputs)
    twin = copy.deepcopy(pipe)
    with torch.no_grad():
        twin.transformer.single_transformer_blocks[0].proj_out.weight.mul_(2)
    edited = copy.deepcopy(model)
    with torch.no_grad():
        edited.single_transformer_blocks[0].proj_out.weight.mul_(2)
    assert rel_err(_sample(twin.transformer, inputs), _oracle(edited, inputs)) < _TIGHT
    assert rel_err(_sample(pipe.transformer, inputs), _oracle(model, inputs)) < _TIGHT


def test_quantize_is_checked():
    model, _ = _flux()
    with pytest.raises(ValueError, match="or None \\(lossless\\), got 'int4'"):
        omni_accel.accelerate(_Holder(model), quantize="int4")
    assert all(type(p) is nn.Parameter for p in model.parameters())


def _halves(size: int) -> list[torch.Tensor]:
    return list(torch.arange(size).chunk(2))


def _tensor_parallel_body(rank: int, world: int) -> None:
    import torch.distributed as dist

    model = random_flux_transformer(num_attention_heads=2)
    inputs = flux_inputs(model)
    width, mlp = model.inner_dim, model.single_transformer_blocks[0].proj_mlp.out_features
    ff = model.transformer_blocks[0].ff.net[2].in_features
    single = [torch.cat([a, width + m]) for a, m in zip(_halves(width), _halves(mlp), strict=True)]
    shards = {
        "attn.to_out.0": _halves(width),
        "attn.to_add_out": _halves(width),
        "ff.net.2": _halves(ff),
        "ff_context.net.2": _halves(ff),
        "proj_out": single,  # its input: cat([attention, mlp]), each part split
    }
    oracle = _sample(emulated(copy.deepcopy(model), _FLUX_BLOCKS, shards), inputs)
    pipe = omni_accel.accelerate(
        _Holder(copy.deepcopy(model)), quantize="fp8", parallel=omni_accel.ParallelConfig(tp=2)
    )
    out = _sample(pipe.transformer, inputs)
    gathered = [torch.empty_like(out) for _ in range(world)]
    dist.all_gather(gathered, out)
    assert torch.equal(gathered[0], gathered[1])  # replica ranks
    # Each shard quantized with its own scales. Not within float32 rounding: the all-reduce sums the partial
    # products in another order than the oracle, and a 1e-7 difference that flips one e4m3 rounding in a
    # later projection moves the output by ~1e-4 (measured 4.9e-4 here), against 4.3e-2 from one rank's
    # quantization, which the sharded one is not.
    assert rel_err(out, oracle) < 2e-3
    assert rel_err(out, _oracle(model, inputs)) > 20 * rel_err(out, oracle)
    assert omni_accel.describe(pipe).components[0].runtime.fp8.copies == 29

    # Ulysses: every projection whole, its rows quantized one by one, so one GPU's FP8 within float32
    # rounding; the modulation split over the ranks reads rows of the whole weight's e4m3 copy
    one_gpu = _sample(
        omni_accel.accelerate(_Holder(copy.deepcopy(model)), quantize="fp8").transformer, inputs
    )
    ulysses = omni_accel.accelerate(
        _Holder(copy.deepcopy(model)), quantize="fp8", parallel=omni_accel.ParallelConfig(ulysses=2)
    )
    assert rel_err(_sample(ulysses.transformer, inputs), one_gpu) < _TIGHT
    assert omni_accel.describe(ulysses).components[0].runtime.modulation.fp8 is not None

    # The generic tier under tp (Diffusers' _tp_plan of the class): each shard's own copies. No sharded
    # oracle is written for that plan here; the check is that it stays an FP8 error of one GPU's size
    # (measured 2.2e-2 from one GPU's FP8, which is 2.7e-2 from lossless), with replica ranks bitwise.
    inputs = flux_inputs(model, text_tokens=8)
    lossless = _sample(model, inputs)
    one = _sample(
        omni_accel.accelerate(_Holder(copy.deepcopy(model)), quantize="fp8", native=False).transformer, inputs
    )
    generic = omni_accel.accelerate(
        _Holder(copy.deepcopy(model)), quantize="fp8", native=False, parallel=omni_accel.ParallelConfig(tp=2)
    )
    out = _sample(generic.transformer, inputs)
    dist.all_gather(gathered, out)
    assert torch.equal(gathered[0], gathered[1])
    assert 0 < rel_err(out, lossless) < 2 * rel_err(one, lossless)
    # a row-split linear's partial product is the tp hook's own forward: it computes as Diffusers' does, and
    # describe says so (it used to count an e4m3 copy of it, never read)
    store = omni_accel.describe(generic).components[0].runtime.fp8
    assert store.kept == {
        "Diffusers hooks on the linear (omni_accel.tp_sum) wrap its forward": 46 - store.copies
    }
    assert 0 < store.copies < 46


def test_tensor_parallel_shards_quantize_apart():
    run_multirank(_tensor_parallel_body, 2)


def test_quality_script_scores_fp8_against_lossless():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import quality

    results = quality.main(["--tiny", "--diffusers"])
    assert results["diffusers_vs_lossless"]["ssim_min"] > 0.999  # lossless: the same images
    fp8_scores = results["fp8_vs_lossless"]
    assert 20 < fp8_scores["psnr_db_min"] < 200 and fp8_scores["ssim_min"] < 1  # lossy, not broken


def test_generic_tier_fp8_is_diffusers_with_quantized_projections():
    model = random_flux_transformer()
    inputs = flux_inputs(model, text_tokens=8)  # 16 text rows: every projection of the blocks in FP8
    oracle = _oracle(model, inputs)
    pipe = omni_accel.accelerate(_Holder(copy.deepcopy(model)), quantize="fp8", native=False)
    ours = pipe.transformer
    assert rel_err(_sample(ours, inputs), oracle) < _TIGHT
    report = omni_accel.describe(pipe)
    # a copy per linear of the blocks (unpacked q/k/v; the modulation's, its one row weight-only)
    assert "LOSSY: quantize='fp8'" in str(report) and report.components[0].runtime.fp8.copies == 46
    twin = copy.deepcopy(pipe)
    edited = copy.deepcopy(model)
    with torch.no_grad():
        for m in (edited, ours):
            m.transformer_blocks[1].ff.net[2].weight.data.mul_(-1)
    # _scaled_mm and the oracle's float32 product differ by ~1e-7, which may flip one e4m3 rounding of a
    # later projection (~1e-5 here); a stale copy would be off by O(1)
    assert rel_err(_sample(ours, inputs), _oracle(edited, inputs)) < _ONE_FLIP
    assert rel_err(_sample(twin.transformer, inputs), oracle) < _TIGHT  # the copy kept its own weights
    omni_accel.restore(pipe)
    assert torch.equal(_sample(ours, inputs), _sample(edited, inputs))
    assert all("forward" not in m.__dict__ for m in ours.modules())
    assert all(type(p) is nn.Parameter for p in ours.parameters())


def _leaf_offload(model: nn.Module) -> None:
    model.enable_group_offload(torch.device("cpu"), offload_type="leaf_level")


def _layerwise_casting(model: nn.Module) -> None:
    model.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.float32)


@pytest.mark.parametrize(("hook", "hooked"), [(_leaf_offload, 46), (_layerwise_casting, 39)])
def test_generic_tier_fp8_decides_hooked_linears_alike_before_and_after_accelerate(hook, hooked):
    """A linear whose forward a hook wraps computes as Diffusers' does under it, whichever came first (one
    hooked before ``accelerate`` used to be skipped silently, one hooked after got FP8), and ``describe``
    counts it with its reason; layerwise casting leaves the AdaLN linears (``norm``) alone: those run FP8."""
    model = random_flux_transformer()
    inputs = flux_inputs(model, text_tokens=8)
    outs, kept = [], []
    for before in (True, False):
        fast = copy.deepcopy(model)
        if before:
            hook(fast)
        pipe = omni_accel.accelerate(_Holder(fast), quantize="fp8", native=False)
        if not before:
            hook(fast)
        outs.append(_sample(fast, inputs))
        store = omni_accel.describe(pipe).components[0].runtime.fp8
        kept.append(dict(store.kept))
        assert store.linears == 46 and store.copies == 46 - hooked
        line = f"fp8: {hooked} of 46 linears compute as Diffusers' do (Diffusers hooks on the linear"
        assert line in str(omni_accel.describe(pipe))
    assert torch.equal(outs[0], outs[1]) and kept[0] == kept[1]
    if hook is _leaf_offload:  # every linear hooked: Diffusers' own result
        plain = copy.deepcopy(model)
        hook(plain)
        assert torch.equal(outs[0], _sample(plain, inputs))


@pytest.mark.parametrize("native", [True, False])
def test_fp8_on_a_model_quantized_before_says_none_is_quantized(native):
    """Layerwise casting to float8 before ``accelerate``: no projection can run FP8, and the headline says
    so with the reasons (it said the projections ran as e4m3 GEMMs); native blocks tell once they ran."""
    model = random_flux_transformer()
    inputs = flux_inputs(model, text_tokens=8)
    from diffusers.hooks import apply_layerwise_casting

    # every linear cast, the AdaLN ones too (FLUX's own patterns skip "norm")
    apply_layerwise_casting(model, torch.float8_e4m3fn, torch.float32, skip_modules_pattern=("pos_embed",))
    pipe = omni_accel.accelerate(_Holder(model), quantize="fp8", native=native)
    _sample(model, inputs)
    headline = str(omni_accel.describe(pipe)).splitlines()[1]
    assert "quantize='fp8' requested, none quantized: " in headline and "LOSSY" not in headline
    assert ("hooks on" if native else "Diffusers hooks on the linear (layerwise_casting)") in headline


def test_generic_tier_fp8_pipeline_pickles_after_a_call():
    """Its linears' forwards held a weak reference to the weight copied, and its undo was a closure."""
    import pickle

    model = random_flux_transformer()
    inputs = flux_inputs(model, text_tokens=8)
    pipe = omni_accel.accelerate(_Holder(copy.deepcopy(model)), quantize="fp8", native=False)
    expected = _sample(pipe.transformer, inputs)
    twin = pickle.loads(pickle.dumps(pipe))
    assert torch.equal(_sample(twin.transformer, inputs), expected)
    assert omni_accel.describe(twin).components[0].runtime.fp8.copies == 46
    omni_accel.restore(twin)
    assert torch.equal(_sample(twin.transformer, inputs), _sample(model, inputs))


@pytest.mark.parametrize("when", ["before", "after"])
def test_generic_tier_fp8_quantizes_the_weights_group_offload_loads(when, tmp_path):
    """Block-level group offload to disk leaves empty tensors in the parameters between calls; the
    transformer's pre-hook saw those, so each linear's copy is made again from the weight its block loaded
    (it used to multiply by the e4m3 copy of uninitialized memory: NaN or garbage)."""
    model = random_flux_transformer()
    inputs = flux_inputs(model, text_tokens=8)
    expected = _sample(
        omni_accel.accelerate(_Holder(copy.deepcopy(model)), quantize="fp8", native=False).transformer, inputs
    )
    offloaded = copy.deepcopy(model)

    def offload() -> None:
        cpu = torch.device("cpu")
        offloaded.enable_group_offload(
            cpu, cpu, offload_type="block_level", num_blocks_per_group=1, offload_to_disk_path=str(tmp_path)
        )

    if when == "before":
        offload()
    omni_accel.accelerate(_Holder(offloaded), quantize="fp8", native=False)
    if when == "after":
        offload()
    for _ in range(2):
        assert torch.equal(_sample(offloaded, inputs), expected)


def test_generic_tier_fp8_keeps_lora_in_bf16_beside():
    from peft import LoraConfig

    model = random_flux_transformer()
    inputs = flux_inputs(model, text_tokens=8)
    pipe = omni_accel.accelerate(_Holder(copy.deepcopy(model)), quantize="fp8", native=False)
    config = LoraConfig(r=2, lora_alpha=2, target_modules=["to_q", "proj_out"])
    for m in (model, pipe.transformer):  # added after accelerate: peft wraps our FP8 linears
        torch.manual_seed(5)
        m.add_adapter(config)
        with torch.no_grad():
            for name, param in m.named_parameters():
                if "lora_B" in name:
                    param.normal_(0, 0.05)
    assert rel_err(_sample(pipe.transformer, inputs), _oracle(model, inputs)) < _TIGHT


def _lora(model: nn.Module, rank: int = 16) -> None:
    from peft import LoraConfig

    torch.manual_seed(5)
    model.add_adapter(LoraConfig(r=rank, lora_alpha=rank, target_modules=["to_q", "proj_out", "ff.net.2"]))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.05)


def test_generic_tier_fp8_lora_loaded_before_accelerate_runs_as_one_loaded_after():
    """The adapter's own linears (peft's lora_A / lora_B) stay out of FP8 whenever it was loaded."""
    model = random_flux_transformer()
    inputs = flux_inputs(model, text_tokens=8)
    before, after = copy.deepcopy(model), copy.deepcopy(model)
    _lora(before)
    before = omni_accel.accelerate(_Holder(before), quantize="fp8", native=False)
    after = omni_accel.accelerate(_Holder(after), quantize="fp8", native=False)
    _lora(after.transformer)
    assert torch.equal(_sample(before.transformer, inputs), _sample(after.transformer, inputs))
    fp8_store = omni_accel.describe(before).components[0].runtime.fp8
    assert fp8_store.copies == omni_accel.describe(after).components[0].runtime.fp8.copies == 46


def _after_a_call(native: bool) -> tuple[nn.Module, dict, nn.Module, fp8.Fp8Weights]:
    """A FLUX transformer, its inputs, its FP8 copy accelerated (eagerly) after one call, and the copy store."""
    model = random_flux_transformer()
    inputs = flux_inputs(model, text_tokens=8)
    fast = copy.deepcopy(model)
    pipe = omni_accel.accelerate(_Holder(fast), quantize="fp8", cuda_graphs=False, native=native)
    store = omni_accel.describe(pipe).components[0].runtime.fp8
    _sample(fast, inputs)
    return model, inputs, fast, store


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("hook", [_leaf_offload, _layerwise_casting])
def test_fp8_copies_nothing_reads_are_dropped_not_remade(native, hook):
    """Hooks added after a first call send native blocks (and the generic tier's hooked linears) to
    Diffusers' forward: their copies are dropped (layerwise casting left the AdaLN ones alive: 3.2 GB on
    FLUX.1-dev) and not re-made at each forward (each of leaf offload's loads re-made every copy in place),
    each one dropped advancing the generation CUDA graphs key on. Dropped, they are freed: the generic
    tier's hooks on its linears had copied each linear's copy into their wrappers (``update_wrapper``)."""
    model, inputs, fast, store = _after_a_call(native)
    copies, generation = store.copies, store.generation
    made_before = [weakref.ref(entry.fp8.data) for entry in store._entries.values()]
    for m in (model, fast):
        hook(m)
    outs = [_sample(fast, inputs) for _ in range(3)]
    made = store.quantized
    outs.append(_sample(fast, inputs))
    assert store.quantized == made  # nothing re-made for no reader
    kept = 0 if native or hook is _leaf_offload else 7  # the generic tier's AdaLN linears: unhooked, FP8
    assert store.copies == kept and store.generation == generation + copies - kept
    gc.collect()
    assert sum(ref() is not None for ref in made_before) == kept
    if native:  # every block runs Diffusers' forward
        assert all(torch.equal(out, _sample(model, inputs)) for out in outs)


@pytest.mark.parametrize("native", [True, False])
def test_fp8_copies_are_not_remade_while_training(native):
    """With autograd on every projection computes as Diffusers' does: an optimizer's steps re-quantize no
    copy (the generic tier re-made every one at each forward); the next call without autograd quantizes
    the trained weights."""
    model, inputs, fast, store = _after_a_call(native)
    made = store.quantized
    optimizer = torch.optim.SGD(fast.parameters(), lr=0.5)
    for _ in range(3):
        fast(**inputs).sample.square().mean().backward()
        optimizer.step()
    assert store.quantized == made
    trained = copy.deepcopy(model)
    trained.load_state_dict(fast.state_dict())
    assert rel_err(_sample(fast, inputs), _oracle(trained, inputs)) < _ONE_FLIP


@pytest.mark.parametrize("native", [True, False])
def test_fp8_with_autograd_on_computes_and_differentiates_as_diffusers(native):
    model = random_flux_transformer()
    inputs = flux_inputs(model, text_tokens=8)
    fast = omni_accel.accelerate(_Holder(copy.deepcopy(model)), quantize="fp8", native=native).transformer
    grads = []
    for m in (model, fast):
        x = inputs["hidden_states"].clone().requires_grad_()
        out = m(**{**inputs, "hidden_states": x}, return_dict=False)[0]
        out.square().mean().backward()
        grads.append((out.detach(), x.grad, {n: p.grad for n, p in m.named_parameters()}))
    (want, want_x, want_p), (got, got_x, got_p) = grads
    assert torch.equal(got, want) and torch.equal(got_x, want_x)
    assert all(got_p[n] is not None and torch.equal(got_p[n], g) for n, g in want_p.items() if g is not None)


def test_fp8_copies_of_moved_weights_are_dropped_and_inference_mode_copies_can_be_remade():
    """Weights that move (offload, load_state_dict(assign=True)) leave no copies behind in an eager
    forward; copies made under inference mode are re-made in place by a later call outside it."""
    model = random_flux_transformer()
    inputs = flux_inputs(model, text_tokens=8)
    pipe = omni_accel.accelerate(_Holder(copy.deepcopy(model)), quantize="fp8", cuda_graphs=False)
    fast, store = pipe.transformer, omni_accel.describe(pipe).components[0].runtime.fp8
    with torch.inference_mode():
        _sample(fast, inputs)
    copies = store.copies
    for _ in range(3):
        with torch.no_grad():
            for param in fast.parameters():
                param.data = param.data.clone()  # every weight at a new address
        _sample(fast, inputs)
        assert store.copies == copies
    edited = copy.deepcopy(model)
    with torch.no_grad():
        for m in (edited, fast):
            m.transformer_blocks[0].attn.to_q.weight.mul_(2)
    assert rel_err(_sample(fast, inputs), _oracle(edited, inputs)) < _ONE_FLIP


@pytest.mark.parametrize("native", [True, False])
def test_fp8_copies_are_let_go_of_when_the_model_moves(native):
    """``.to`` another dtype or device frees the copies of the old weights at the move, as plain Diffusers
    frees everything there (they stayed, on the GPU they were made on, until the next call); one where the
    weights are keeps them; the next calls quantize the weights as they are then."""
    model, inputs, fast, store = _after_a_call(native)
    copies = [weakref.ref(entry.fp8.data) for entry in store._entries.values()]
    assert copies and all(ref() is not None for ref in copies)
    fast.to("cpu")  # where the weights are: nothing moved
    assert all(ref() is not None for ref in copies)
    fast.to(torch.float64)
    gc.collect()
    assert store.copies == 0 and all(ref() is None for ref in copies)
    oracle = _oracle(model, inputs)
    wide = {k: v.double() if v.is_floating_point() else v for k, v in inputs.items()}
    assert rel_err(_sample(fast, wide).float(), oracle) < _ONE_FLIP
    fast.to(torch.float32)
    assert store.copies == 0
    assert rel_err(_sample(fast, inputs), oracle) < _TIGHT


@pytest.mark.parametrize("kind", ["first_block", "mag", "taylorseer"])
def test_diffusers_step_caches_compose_with_fp8(kind):
    """A step cache on the FP8 native blocks decides and computes as it does on Diffusers' own blocks with
    the same quantization (the oracle pipeline), the blocks native: FirstBlockCache and MagCache hook whole
    blocks, TaylorSeer the attention modules (the math runs its hook around their part)."""
    from diffusers import FirstBlockCacheConfig, MagCacheConfig, TaylorSeerCacheConfig

    configs = {
        "first_block": lambda: FirstBlockCacheConfig(threshold=5.0),
        "mag": lambda: MagCacheConfig(threshold=0.5, num_inference_steps=3, mag_ratios=[1.0, 0.95, 0.9]),
        "taylorseer": lambda: TaylorSeerCacheConfig(cache_interval=2, disable_cache_before_step=1),
    }
    oracle = omni_accel.tiny_flux_pipeline()
    emulated(oracle.transformer, _FLUX_BLOCKS)
    fast = omni_accel.accelerate(omni_accel.tiny_flux_pipeline(), quantize="fp8")
    call = dict(prompt="a cat", num_inference_steps=3, output_type="latent")
    uncached = oracle(**call, generator=torch.Generator().manual_seed(0)).images
    for pipe in (oracle, fast):
        pipe.transformer.enable_cache(configs[kind]())
    got, expected = (p(**call, generator=torch.Generator().manual_seed(0)).images for p in (fast, oracle))
    assert not torch.equal(expected, uncached)  # the cache reused something
    assert rel_err(got, expected) < _TIGHT
    assert omni_accel.describe(fast).components[0].runtime.fallbacks == {}  # every block ran natively


def test_a_from_pipe_sibling_of_an_fp8_pipeline_says_it_is_lossy():
    from diffusers import FluxImg2ImgPipeline

    pipe = omni_accel.accelerate(omni_accel.tiny_flux_pipeline(seed=0), quantize="fp8")
    sibling = omni_accel.accelerate(FluxImg2ImgPipeline.from_pipe(pipe))  # no quantize: the module is shared
    assert "LOSSY: quantize='fp8' (asked by that pipeline)" in str(omni_accel.describe(sibling))
