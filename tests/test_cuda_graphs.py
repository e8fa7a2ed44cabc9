"""Whole-step CUDA graphs (``accelerate(pipe, cuda_graphs=True)``).

On CPU: what keys a graph (a replay must never serve a call whose host-side decisions differ from the
captured one), that calls a graph cannot serve run eagerly and are counted, and the Diffusers API around
it. On a GPU (``-m gpu``): replayed pipelines bitwise equal to the same accelerated pipeline run eagerly,
across new resolutions, batch sizes, LoRA scales, weight edits and compile.
"""

import contextlib
import copy
import dataclasses
import faulthandler
import gc
import pickle
import weakref

import pytest
import torch
import torch.utils._pytree as pytree
from conftest import flux_inputs, random_flux_transformer, random_lora
from diffusers import FirstBlockCacheConfig, FluxPipeline
from diffusers.models.transformers.transformer_flux import FluxAttnProcessor

import omni_accel
from omni_accel import LayoutTuning, ParallelConfig
from omni_accel.cuda_graphs import StepGraphs, _module_state, _Seen, block_graph_stats, step_key
from omni_accel.models.tiny_pipelines import tiny_flux_pipeline, tiny_sd3_pipeline


def _bare(transformer) -> FluxPipeline:
    return FluxPipeline(None, None, None, None, None, None, transformer)


def _key(transformer, **inputs):
    leaves, spec = pytree.tree_flatten(((), inputs))
    return step_key(transformer, leaves, spec)


@torch.no_grad()
def test_what_keys_a_graph():
    pipe = omni_accel.accelerate(_bare(random_flux_transformer()), cuda_graphs=True)
    transformer = pipe.transformer
    x = flux_inputs(transformer)
    transformer(**x)  # packs the projections (the key after the first call is the one graphs use)
    key = _key(transformer, **x)
    other_values = {k: torch.randn_like(v) for k, v in x.items()}
    assert _key(transformer, **other_values) == key, "new input values replay the same graph"
    with torch.no_grad():
        transformer.transformer_blocks[0].attn.to_q.weight.mul_(1.5)
    assert _key(transformer, **x) == key, "an in-place weight edit is seen by the graph itself"

    changed = {
        "a new shape": lambda: _key(transformer, **flux_inputs(transformer, image_tokens=16)),
        "a new batch": lambda: _key(transformer, **flux_inputs(transformer, batch=1)),
        "a new dtype": lambda: _key(transformer, **{**x, "timestep": x["timestep"].double()}),
        "a new argument value": lambda: _key(transformer, **x, joint_attention_kwargs={"scale": 0.5}),
        "an argument left out": lambda: _key(transformer, **{k: v for k, v in x.items() if k != "txt_ids"}),
    }
    for what, new_key in changed.items():
        assert new_key() != key, what

    def differs_after(what, edit):
        edit()
        new = _key(transformer, **x)
        assert new != key, what
        return new

    handle = transformer.single_transformer_blocks[0].norm.register_forward_hook(lambda *a: None)
    assert _key(transformer, **x) is None, "a hook below decides per call: no graph"
    handle.remove()

    proj = transformer.transformer_blocks[0].attn.to_out[0]
    key = differs_after("a reassigned weight", lambda: setattr(proj.weight, "data", proj.weight.data.clone()))
    key = differs_after("training mode", transformer.train)
    key = differs_after("eval mode again", transformer.eval)
    processor = transformer.transformer_blocks[0].attn.processor
    key = differs_after(
        "an attention processor of another class",
        lambda: transformer.transformer_blocks[0].attn.set_processor(
            type("Custom", (type(processor),), {})()
        ),
    )
    transformer.transformer_blocks[0].attn.set_processor(type(processor)())
    key = differs_after("the processor's class again", lambda: None)
    current = transformer.transformer_blocks[0].attn.processor
    key = differs_after("a processor's backend", lambda: setattr(current, "_attention_backend", "x"))
    attn = transformer.single_transformer_blocks[-1].attn
    key = differs_after("a new attribute on a submodule", lambda: setattr(attn, "a_flag", True))
    key = differs_after("its value", lambda: setattr(attn, "a_flag", False))
    key = differs_after("a submodule replaced", lambda: setattr(attn, "norm_q", copy.deepcopy(attn.norm_q)))
    key = differs_after("a submodule shared", lambda: setattr(attn, "norm_k", attn.norm_q))
    current._attention_backend = None
    with omni_accel.attention_scope(default="sdpa"):
        assert _key(transformer, **x) != key, "an attention scope"

    lora = random_lora(transformer, ["to_q", "to_k"], seed=3)
    key = differs_after("a loaded LoRA", lambda: pipe.load_lora_weights(lora, adapter_name="a"))
    key = differs_after("a new adapter scale", lambda: pipe.set_adapters("a", 0.5))
    key = differs_after("disabled adapters", pipe.disable_lora)
    key = differs_after("enabled adapters", pipe.enable_lora)
    key = differs_after("a fused LoRA", pipe.fuse_lora)


@contextlib.contextmanager
def _switched(owner, name: str, value):
    before = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, before)


@torch.no_grad()
def test_global_switches_and_modes_key_a_graph_or_keep_the_call_eager():
    """What a forward computes besides its arguments and modules: each switch is in the key, read without
    raising where PyTorch's newer ``fp32_precision`` API was used (its legacy getters raise then); a
    torch-function or dispatch mode around the call keeps it eager, a default device is keyed."""
    from torch.overrides import TorchFunctionMode

    from omni_accel.cuda_graphs import _modes_reason

    pipe = omni_accel.accelerate(_bare(random_flux_transformer()), cuda_graphs=True)
    transformer = pipe.transformer
    x = flux_inputs(transformer)
    transformer(**x)
    key = _key(transformer, **x)
    matmul, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    switches = {
        "inference mode": torch.inference_mode,
        "a default dtype": lambda: _switched_dtype(torch.float64),
        "a default device": lambda: torch.device("cpu"),
        "TF32 through the fp32_precision API": lambda: _switched(matmul, "fp32_precision", "tf32"),
        "cudnn.benchmark": lambda: _switched(cudnn, "benchmark", not cudnn.benchmark),
        "cudnn.deterministic": lambda: _switched(cudnn, "deterministic", not cudnn.deterministic),
    }
    if hasattr(matmul, "allow_fp16_accumulation"):
        switches["fp16 accumulation"] = lambda: _switched(matmul, "allow_fp16_accumulation", True)
    for what, switch in switches.items():
        with switch():
            assert _key(transformer, **x) not in (key, None), what
            assert _modes_reason() is None, what  # a default device is keyed, not refused
    assert _key(transformer, **x) == key

    class Scaled(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with Scaled():
        assert _modes_reason() == "Scaled active around the call"
    assert _modes_reason() is None


@contextlib.contextmanager
def _switched_dtype(dtype: torch.dtype):
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def test_the_state_walk_reads_every_module_once_and_every_tensor_of_each():
    """The walk that keys a graph is written for host time (no ``modules()``): it must still meet every
    submodule, a shared one once, and key every parameter and buffer of each."""
    shared = torch.nn.LayerNorm(4)
    inner = torch.nn.Sequential(torch.nn.Linear(4, 4), shared, torch.nn.ModuleList([shared, None]))
    model = torch.nn.Sequential(inner, torch.nn.BatchNorm1d(4), shared, torch.nn.Linear(4, 2, bias=False))
    model.register_module("absent", None)
    seen = _Seen()
    state = _module_state(model, seen)
    expected = [
        t for m in model.modules() for t in (*m._parameters.values(), *m._buffers.values()) if t is not None
    ]
    assert sorted(map(id, seen.tensors)) == sorted(map(id, expected))
    modules = {id(m) for m in model.modules()}
    assert sorted(x for x in state if isinstance(x, int) and x in modules) == sorted(modules), "each once"
    assert _module_state(model) == state


@torch.no_grad()
def test_calls_a_graph_cannot_serve_run_eagerly_and_are_counted(monkeypatch):
    plain = random_flux_transformer()
    pipe = omni_accel.accelerate(_bare(random_flux_transformer()), cuda_graphs=True)
    x = flux_inputs(plain)
    for _ in range(3):
        torch.testing.assert_close(pipe.transformer(**x)[0], plain(**x)[0], rtol=0, atol=0)
    report = str(omni_accel.describe(pipe))
    assert (
        "replayed from CUDA graphs" if torch.cuda.is_available() else "no step can run on CUDA here"
    ) in report
    assert "cuda graphs: 0 captured, 0 replays, 0 kept" in report
    assert "cuda graphs: 3 calls ran eagerly (arguments not all on one CUDA device)" in report
    assert "kernels being built" not in report
    monkeypatch.setattr(omni_accel.kernel_builds, "building", lambda: ["Triton kernel b", "Triton kernel a"])
    report = str(omni_accel.describe(pipe))  # what holds a capture off, by name
    assert "kernels being built in the background now: Triton kernel a, Triton kernel b" in report
    cache = omni_accel.describe(pipe).components[0].cache
    assert cache is not None and cache.hits > 0  # eager calls keep the exact projection cache


@torch.no_grad()
def test_diffusers_api_around_the_graph_hook():
    pipe = tiny_flux_pipeline()

    def image(pipe):
        generator = torch.Generator().manual_seed(0)
        return pipe("a cat", num_inference_steps=2, output_type="latent", generator=generator).images

    reference = image(pipe)
    omni_accel.accelerate(pipe, cuda_graphs=True)
    torch.testing.assert_close(image(pipe), reference, rtol=1e-5, atol=1e-6)
    twin = copy.deepcopy(pipe)
    torch.testing.assert_close(image(twin), reference, rtol=1e-5, atol=1e-6)
    hooks = [omni_accel.describe(p).components[0].graphs for p in (pipe, twin)]
    assert hooks[0] is not hooks[1]
    assert [sum(hook.stats()["eager"].values()) for hook in hooks] == [2, 2]  # each copy's own steps
    assert pickle.loads(pickle.dumps(twin.transformer)).forward.module is not twin.transformer

    plain = tiny_flux_pipeline()
    for p in (plain, pipe):  # a step cache registered after: its hooks decide per call, so eager
        p.transformer.enable_cache(FirstBlockCacheConfig(threshold=0.3))
    torch.testing.assert_close(image(pipe), image(plain), rtol=1e-5, atol=1e-6)
    for p in (plain, pipe):
        p.transformer.disable_cache()
    omni_accel.restore(pipe)
    assert not any("forward" in module.__dict__ for module in pipe.transformer.modules())
    assert "forward" in twin.transformer.__dict__  # restoring the original leaves the copy accelerated
    twin_blocks = omni_accel.describe(twin).components[0].block_graphs
    assert [graphs.module for graphs in twin_blocks] == [*twin.transformer.transformer_blocks] + [
        *twin.transformer.single_transformer_blocks
    ]


@torch.no_grad()
def test_block_graphs_serve_steps_whose_hooks_wrap_their_blocks():
    """A step cache's hooks on the blocks keep a step from being one graph; each block's own graph stays
    keyable, since those hooks wrap it. A hook below a block (TaylorSeer's on attention) does not, unless
    it decided before the block ran (``test_taylorseer_decides_before_each_block``)."""
    from diffusers import TaylorSeerCacheConfig

    pipe = omni_accel.accelerate(tiny_flux_pipeline(), cuda_graphs=True)
    transformer = pipe.transformer
    blocks = omni_accel.describe(pipe).components[0].block_graphs
    assert [graphs.module for graphs in blocks] == [*transformer.transformer_blocks] + [
        *transformer.single_transformer_blocks
    ]
    assert all(graphs.module.__dict__["forward"] is graphs for graphs in blocks)
    x = flux_inputs(transformer)
    assert _key(transformer, **x) is not None and all(graphs._state() is not None for graphs in blocks)
    transformer.enable_cache(FirstBlockCacheConfig(threshold=0.3))
    assert _key(transformer, **x) is None, "the step is declined"
    assert all(graphs._state() is not None for graphs in blocks), "its blocks are not"
    transformer.disable_cache()
    transformer.enable_cache(TaylorSeerCacheConfig(cache_interval=2, disable_cache_before_step=1))
    assert all(graphs._state() is None for graphs in blocks)
    transformer.disable_cache()
    assert "cuda graphs of the blocks" not in str(omni_accel.describe(pipe))  # no counter moved: no line


class _ReplayedOnTheCpu:
    """A CUDA graph as the CPU can play it: a replay runs the recorded forward again on the static inputs
    and writes its outputs into the recorded output tensors, so it reads and writes the memory a real
    replay would."""

    def __init__(self, forward, args: tuple, kwargs: dict, output) -> None:
        self.forward, self.args, self.kwargs, self.output = forward, args, kwargs, output

    def replay(self) -> None:
        fresh = pytree.tree_leaves(self.forward(*self.args, **self.kwargs))
        for static, value in zip(pytree.tree_leaves(self.output), fresh, strict=True):
            if isinstance(static, torch.Tensor):
                static.copy_(value)

    def pool(self) -> None:
        return None


def _graphs_played_on_the_cpu(monkeypatch) -> None:
    import contextlib

    from omni_accel import cuda_graphs

    def record(self, forward, args, kwargs, mode):
        output = forward(*args, **kwargs)
        return _ReplayedOnTheCpu(forward, args, kwargs, output), output

    monkeypatch.setattr(cuda_graphs, "_eager_reason", lambda module, leaves: None)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(cuda_graphs.StepGraphs, "_record", record)


def test_taylorseer_decides_before_each_block(monkeypatch):
    """On one GPU a block whose attention modules TaylorSeer hooks is served by a graph per decision: the
    hooks decide before the block runs (the predictions enter as arguments) and record the computed parts'
    outputs after it. Graphs played on the CPU (``_ReplayedOnTheCpu``): the latents are bitwise plain
    Diffusers' with TaylorSeer, a block that runs Diffusers' forward (a custom processor) included, its
    hooks then deciding themselves."""
    from diffusers import TaylorSeerCacheConfig
    from diffusers.models.transformers.transformer_flux import FluxAttnProcessor

    from omni_accel import cuda_graphs

    class CustomProcessor(FluxAttnProcessor):
        pass

    _graphs_played_on_the_cpu(monkeypatch)
    decided = []
    decide = cuda_graphs.decide
    monkeypatch.setattr(cuda_graphs, "decide", lambda module: decided.append(module) or decide(module))
    plain = tiny_flux_pipeline()
    fast = omni_accel.accelerate(tiny_flux_pipeline(), cuda_graphs=True)
    for pipe in (plain, fast):
        pipe.transformer.single_transformer_blocks[0].attn.set_processor(CustomProcessor())
        taylor = TaylorSeerCacheConfig(
            cache_interval=2, disable_cache_before_step=1, taylor_factors_dtype=torch.float32
        )
        pipe.transformer.enable_cache(taylor)
    call = {"prompt": "a cat", "num_inference_steps": 6, "output_type": "latent"}
    got, expected = (p(**call, generator=torch.Generator().manual_seed(0)).images for p in (fast, plain))
    assert torch.equal(got, expected)
    assert not torch.equal(
        expected, tiny_flux_pipeline()(**call, generator=torch.Generator().manual_seed(0)).images
    )
    component = omni_accel.describe(fast).components[0]
    blocks = len(fast.transformer.transformer_blocks) + len(fast.transformer.single_transformer_blocks)
    assert len(decided) == 6 * blocks  # every block call decided ahead (the custom one's taken back)
    (reason,) = component.runtime.fallbacks
    assert "CustomProcessor" in reason and component.runtime.fallbacks[reason] == 6
    stats = block_graph_stats(component.block_graphs)
    assert stats["replays"] > 0 and stats["inputs_in_place"] > 0, stats


@torch.no_grad()
@pytest.mark.parametrize("cache", ["first_block_never_skips", "first_block", "mag"])
def test_block_graphs_read_the_block_befores_output_where_it_lies(monkeypatch, cache):
    """Under a step cache (FirstBlockCache, MagCache) each block's graph reads the previous block's output
    where that graph wrote it, instead of a copy of it. Graphs played on the CPU (``_ReplayedOnTheCpu``):
    the latents are bitwise plain Diffusers' with the same cache. A user's hook that writes a block's
    output through ``.data`` (which no version counter sees) stops it for that block: still bitwise."""
    from diffusers import MagCacheConfig

    _graphs_played_on_the_cpu(monkeypatch)
    call = {"prompt": "a cat", "num_inference_steps": 6, "output_type": "latent"}
    configs = {
        "first_block_never_skips": lambda: FirstBlockCacheConfig(threshold=-1.0),
        "first_block": lambda: FirstBlockCacheConfig(threshold=0.3),
        "mag": lambda: MagCacheConfig(threshold=0.5, num_inference_steps=6, mag_ratios=[1.0] + [0.9] * 5),
    }

    def scale_through_data(module, args, out) -> None:
        out[1].data.mul_(1.5)

    def images(user_hook: bool) -> tuple[torch.Tensor, torch.Tensor, dict]:
        plain = tiny_flux_pipeline()
        fast = omni_accel.accelerate(tiny_flux_pipeline(), cuda_graphs=True)
        for pipe in (plain, fast):
            if user_hook:
                pipe.transformer.transformer_blocks[0].register_forward_hook(scale_through_data)
            pipe.transformer.enable_cache(configs[cache]())
        want, got = (p(**call, generator=torch.Generator().manual_seed(0)).images for p in (plain, fast))
        stats = block_graph_stats(omni_accel.describe(fast).components[0].block_graphs)
        report = str(omni_accel.describe(fast))
        assert f"{stats['inputs_in_place']} arguments read where the block before wrote them" in report
        return want, got, stats

    want, got, stats = images(user_hook=False)
    assert torch.equal(got, want)
    assert stats["replays"] > 0 and not stats["eager"], stats
    assert stats["inputs_in_place"] > 0, stats
    hooked_want, hooked_got, hooked_stats = images(user_hook=True)
    assert torch.equal(hooked_got, hooked_want) and not torch.equal(hooked_want, want)
    assert hooked_stats["inputs_in_place"] < stats["inputs_in_place"], (hooked_stats, stats)


@torch.no_grad()
def test_a_graph_never_reads_fp8_copies_dropped_since(monkeypatch):
    """Under ``quantize="fp8"`` a native block that runs Diffusers' forward (a hook on one of its linears)
    drops its e4m3 copies, and makes them again, elsewhere, once it runs natively again. The graph captured
    before reads the old copies' memory (freed): though the weights and the module's state are as when it
    was captured, it serves no later call (the copies' generation is in the step's key); a new one is
    captured. Graphs played on the CPU (``_ReplayedOnTheCpu``, which runs the Python again): the replays
    are counted."""
    _graphs_played_on_the_cpu(monkeypatch)
    model = random_flux_transformer()
    inputs = flux_inputs(model, text_tokens=8)
    component = omni_accel.describe(omni_accel.accelerate(_bare(model), quantize="fp8", cuda_graphs=True))
    store, graphs = component.components[0].runtime.fp8, component.components[0].graphs
    expected = [model(**inputs).sample for _ in range(3)][-1]  # eager, captured, replayed
    assert graphs.stats()["captures"] == 1 and store.copies == 29
    handle = model.transformer_blocks[0].attn.to_q.register_forward_pre_hook(lambda module, args: None)
    model(**inputs)
    assert store.copies == 19  # the block's 10 dropped
    handle.remove()
    replays = graphs.stats()["replays"]
    assert torch.equal(model(**inputs).sample, expected)
    assert store.copies == 29 and graphs.stats()["replays"] == replays, graphs.stats()
    for _ in range(2):
        assert torch.equal(model(**inputs).sample, expected)
    assert graphs.stats()["captures"] == 2 and graphs.stats()["replays"] == replays + 2, graphs.stats()


@torch.no_grad()
def test_evicted_graphs_are_freed_under_a_hook_registered_since(monkeypatch):
    """A Diffusers hook registered on a block after ``accelerate`` (a step cache's) copies the attributes of
    the block's graphs into its wrapper (``functools.update_wrapper`` copies ``__dict__``), the dict of the
    graphs last replayed among them: a graph evicted by later captures stayed alive there, with its static
    inputs (and, on the GPU, its memory). Graphs played on the CPU (``_ReplayedOnTheCpu``)."""
    _graphs_played_on_the_cpu(monkeypatch)
    model = random_flux_transformer()
    component = omni_accel.describe(omni_accel.accelerate(_bare(model), cuda_graphs=True)).components[0]
    model.enable_cache(FirstBlockCacheConfig(threshold=-1.0))
    first = []
    for tokens in (12, 16, 20):  # a block keeps two graphs: the third shape evicts the first's
        inputs = flux_inputs(model, image_tokens=tokens, text_tokens=8)
        for _ in range(3):  # eager, captured, replayed
            with model.cache_context(f"cond {tokens}"):
                model(**inputs)
        if not first:
            first = [
                weakref.ref(graph) for block in component.block_graphs for graph in block.graphs.values()
            ]
    gc.collect()
    assert all(len(block.graphs) == 2 for block in component.block_graphs)
    assert first and all(ref() is None for ref in first)


@torch.no_grad()
@pytest.mark.parametrize("step_cache", [False, True])
def test_graphs_of_weights_that_moved_are_dropped_at_the_move(monkeypatch, step_cache):
    """``.to`` another dtype or device drops the graphs keyed on the old weights, which no call can replay
    again, with their static inputs and memory pool (they stayed until later captures evicted them, the
    pool for good: on the GPU, where plain Diffusers holds nothing once moved); a ``.to`` where the weights
    are keeps them. Graphs played on the CPU (``_ReplayedOnTheCpu``); a step cache has each block captured."""
    _graphs_played_on_the_cpu(monkeypatch)
    model = random_flux_transformer()
    inputs = flux_inputs(model, text_tokens=8)
    plain = copy.deepcopy(model)
    component = omni_accel.describe(omni_accel.accelerate(_bare(model), cuda_graphs=True)).components[0]
    if step_cache:
        for m in (plain, model):
            m.enable_cache(FirstBlockCacheConfig(threshold=-1.0))
    holders = [*component.block_graphs] if step_cache else [component.graphs]

    def sample(m, x):
        with m.cache_context("cond") if step_cache else contextlib.nullcontext():
            return m(**x).sample

    for _ in range(3):  # eager, captured, replayed
        assert torch.equal(sample(model, inputs), sample(plain, inputs))
    captured = [weakref.ref(graph) for graphs in holders for graph in graphs.graphs.values()]
    assert captured and all(graphs.replays for graphs in holders)
    model.to("cpu")  # where the weights are: nothing moved
    assert sum(len(graphs.graphs) for graphs in holders) == len(captured)
    model.to(torch.float64)
    gc.collect()
    assert not any(graphs.graphs or graphs.latest for graphs in holders)
    assert all(ref() is None for ref in captured)
    plain.to(torch.float64)
    wide = {k: v.double() if v.is_floating_point() else v for k, v in inputs.items()}
    for _ in range(3):
        want, got = sample(plain, wide), sample(model, wide)
        assert ((got - want).abs().max() / want.abs().max()) < 1e-12
    assert all(len(graphs.graphs) == 1 and graphs.captures == 2 for graphs in holders)


def test_block_graphs_under_inference_mode(monkeypatch):
    """A pipeline called under ``torch.inference_mode()``: the replays' copies have no version counter, so
    no block reads the one before's output in place (a write to it could not be seen); bitwise plain's."""
    _graphs_played_on_the_cpu(monkeypatch)
    call = {"prompt": "a cat", "num_inference_steps": 3, "output_type": "latent"}
    plain = tiny_flux_pipeline()
    fast = omni_accel.accelerate(tiny_flux_pipeline(), cuda_graphs=True)
    for pipe in (plain, fast):
        pipe.transformer.enable_cache(FirstBlockCacheConfig(threshold=-1.0))
    with torch.inference_mode():
        want, got = (p(**call, generator=torch.Generator().manual_seed(0)).images for p in (plain, fast))
    assert torch.equal(got, want)
    stats = block_graph_stats(omni_accel.describe(fast).components[0].block_graphs)
    assert stats["replays"] > 0 and stats["inputs_in_place"] == 0, stats
    # then outside inference mode (the pipeline's own no_grad): graphs of their own, which may write their
    # inputs (a graph captured in inference mode holds inference tensors no call outside it may write)
    for cache in (True, False):
        if not cache:
            for pipe in (plain, fast):
                pipe.transformer.disable_cache()
        want, got = (p(**call, generator=torch.Generator().manual_seed(0)).images for p in (plain, fast))
        assert torch.equal(got, want)


def test_graph_memory_knows_what_an_output_still_holds():
    """The memory a replay copied an output out of holds that copy's values until the copy is written
    (its version counter, views included) or another replay runs (``forget``: any replay may write any of
    the pool's memory)."""
    from omni_accel.cuda_graphs import GraphMemory

    memory, output, other = GraphMemory(), torch.randn(4, 8), torch.randn(2)
    copied = output.clone()
    memory.copied_out([output, 3, other], [copied, 3, other.clone()])
    assert memory.holds(output, copied) and memory.holding(copied) is output
    assert not memory.holds(output, copied.clone()) and memory.holding(torch.randn(4, 8)) is None
    assert memory.holding(3) is None and not memory.holds(other, copied)
    copied[:, :2].add_(1)  # a write through a view moves the copy's version
    assert not memory.holds(output, copied) and memory.holding(copied) is None
    memory.copied_out([output], [copied])
    memory.forget()
    assert not memory.holds(output, copied)
    memory.copied_out([output], [copied])
    del output
    assert memory.holding(copied) is None  # the memory is gone (its id may be another tensor's)
    output = torch.randn(4, 8)
    with torch.inference_mode():  # a copy made there has no version counter: nothing is known to hold it
        copied = output.clone()
        memory.copied_out([output], [copied])
        assert memory.holding(copied) is None and not memory.holds(output, copied)


@torch.no_grad()
def test_an_output_passed_twice_is_read_in_place_once(monkeypatch):
    """A graph captured with one held output as two arguments reads it in place for one of them and keeps
    its own copy for the other, so a later call with two different tensors there gets both. Only the last
    replay's outputs are read in place."""
    from omni_accel.cuda_graphs import GraphMemory

    class Twice(torch.nn.Module):
        def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return a * 2 + b

    _graphs_played_on_the_cpu(monkeypatch)
    memory = GraphMemory()
    first, second, third = torch.nn.Linear(4, 4), Twice(), torch.nn.Linear(4, 4)
    graphs = [StepGraphs(module, memory=memory) for module in (first, second, third)]
    for installed in graphs:
        installed.install()
    x, y = torch.randn(2, 4), torch.randn(2, 4)
    for _ in range(3):  # each: eager, then captured, then replayed
        out = first(x)
        assert torch.equal(second(out, out), out * 2 + out)
        third(y)
    assert graphs[1].stats()["inputs_in_place"] > 0
    statics = graphs[1].graphs[next(iter(graphs[1].graphs))].inputs
    assert statics[0] is not statics[1]
    out = first(x)
    assert torch.equal(second(y, out), y * 2 + out)
    assert torch.equal(second(out, y), out * 2 + y)
    out, in_place = first(x), graphs[1].inputs_in_place
    third(y)  # another graph's replay may have written any of the pool's memory: the output is copied in
    assert torch.equal(second(out, out), out * 3) and graphs[1].inputs_in_place == in_place


def test_auto_turns_graphs_on_for_one_cuda_device(monkeypatch):
    from omni_accel.auto import options_from_env
    from omni_accel.run import build_parser, options_from_args

    def graphs(**options):
        pipe = omni_accel.accelerate(_bare(random_flux_transformer()), **options)
        return omni_accel.describe(pipe).components[0].graphs

    assert graphs() is None or torch.cuda.is_available()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert graphs() is not None
    assert graphs(cuda_graphs=False) is None
    assert options_from_env({"OMNI_ACCEL_CUDA_GRAPHS": "0"}) == {"cuda_graphs": False}
    assert options_from_env({}) == {}
    parser = build_parser()
    assert options_from_args(parser.parse_args(["--no-cuda-graphs", "x.py"]))["cuda_graphs"] is False
    assert "cuda_graphs" not in options_from_args(parser.parse_args(["x.py"]))


def test_cuda_graphs_on_a_generic_transformer_and_bad_values():
    pipe = omni_accel.accelerate(tiny_sd3_pipeline(), cuda_graphs=True)
    report = omni_accel.describe(pipe).components[0]
    assert report.mode == "generic" and report.graphs is not None
    assert "cuda_graphs=True, but no step can run on CUDA here" in report.detail
    omni_accel.restore(pipe)
    assert "forward" not in pipe.transformer.__dict__
    with pytest.raises(TypeError, match="cuda_graphs must be True, False or None"):
        omni_accel.accelerate(tiny_flux_pipeline(), cuda_graphs="yes")


def _gpu_pipeline(dtype: torch.dtype = torch.bfloat16, **options):
    """A small FLUX pipeline (bf16 unless asked) accelerated with CUDA graphs, on the GPU."""
    pipe = tiny_flux_pipeline(
        num_attention_heads=4,
        attention_head_dim=64,
        dtype=dtype,
        device="cuda",
        guidance_embeds=True,
    )
    return omni_accel.accelerate(pipe, cuda_graphs=True, **options)


@pytest.mark.gpu
def test_background_compile_runs_beside_replays_and_is_captured_once_switched_in():
    """The first steps are captured with the eager blocks; the compile starts before the first replay and
    runs beside the replays (never beside a capture); once its code is switched in, the compiled steps are
    captured anew and replay bitwise their eager launches."""
    pipe = _gpu_pipeline(compile=True, compile_in_background=True)
    runtime = omni_accel.describe(pipe).components[0].runtime
    graphs = omni_accel.describe(pipe).components[0].graphs
    call = {"prompt": "a cat", "num_inference_steps": 4, "output_type": "latent"}
    eager = pipe(**call, generator=torch.Generator("cuda").manual_seed(0)).images
    assert runtime.compiler._threads, "the compile started during the first call"
    runtime.compiler.wait()
    compiled = pipe(**call, generator=torch.Generator("cuda").manual_seed(0)).images
    assert runtime.compiler.generation == 1
    calls = runtime.compiler.calls()
    assert all(compiled for _, compiled in calls.values()), (
        calls
    )  # the compiled code ran (warm-up and capture of the new key)
    stats = graphs.stats()  # per call: a warm-up, a capture and its replay, two replays
    assert stats["captures"] == 2 and stats["replays"] == 6 and not stats["eager"], stats
    torch.testing.assert_close(compiled, eager, rtol=0.05, atol=0.05)
    _replays_match_eager(pipe)


def _replays_match_eager(pipe, exact: bool = True, **call):
    """The pipeline's image with its graphs switched off (the same kernels, compiled ones included,
    launched one by one) and on: bitwise equal (``exact``), else equal to bf16 rounding."""
    call = {"prompt": "a cat", "num_inference_steps": 4, "output_type": "latent", **call}
    graphs = omni_accel.describe(pipe).components[0].graphs
    images = []
    for enabled in (False, True):
        graphs.enabled = enabled
        images.append(pipe(**call, generator=torch.Generator("cuda").manual_seed(0)).images)
    want, got = images
    if exact:
        assert torch.equal(got, want), (got.float() - want.float()).abs().max()
    else:
        torch.testing.assert_close(got, want, rtol=0.05, atol=0.05)


class _HostConstants(torch.nn.Module):
    """A forward that makes tensors from Python values on the GPU, as Qwen-Image and LTX-2 do."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, n: int) -> torch.Tensor:
        scale = torch.tensor([n, 2 * n], dtype=x.dtype, device=x.device)
        length = torch.as_tensor(n, device=x.device)
        return self.proj(x) * scale.sum() + length


@pytest.mark.gpu
@torch.no_grad()
def test_steps_that_copy_host_values_to_the_gpu_capture_them_from_pinned_memory():
    module = _HostConstants().cuda()
    twin = copy.deepcopy(module)
    graphs = StepGraphs(module)
    graphs.install()
    x = torch.randn(4, 8, device="cuda")
    for n in (1, 1, 1, 3, 3, 3, 1, 3):  # each n its own key, so its own constants
        torch.testing.assert_close(module(x.clone(), n), twin(x, n), rtol=0, atol=0)
    stats = graphs.stats()
    assert stats["captures"] == 2 and stats["replays"] + stats["early_replays"] >= 4, stats
    assert not stats["eager"], stats
    assert all(
        len(graph.constants) == 2 and graph.constants[0].is_pinned() for graph in graphs.graphs.values()
    )


@pytest.mark.gpu
@pytest.mark.parametrize("compiled", [False, True])
def test_replayed_steps_are_bitwise_the_eager_steps(compiled):
    pipe = _gpu_pipeline(compile=compiled, compile_in_background=False)
    _replays_match_eager(pipe)
    stats = omni_accel.describe(pipe).components[0].graphs.stats()
    assert stats["captures"] == 1 and stats["replays"] == 3, stats  # warm-up, capture + replay, two replays
    _replays_match_eager(pipe, height=48, width=32)  # a new resolution captures anew
    _replays_match_eager(pipe, num_images_per_prompt=2)
    # Back to the first shape: its graph is still kept. Compiled, that graph holds the kernels compiled
    # for that one shape, while eager launches now run the dynamic-shape kernels the later shapes made
    # dynamo compile: a different (equally valid) reduction order, so equal to rounding, not bitwise.
    _replays_match_eager(pipe, exact=not compiled)
    assert omni_accel.describe(pipe).components[0].graphs.stats()["captures"] == 3


@pytest.mark.gpu
@pytest.mark.parametrize("quantize", [None, "fp8"])
@pytest.mark.parametrize("cache", ["first_block_never_skips", "first_block", "mag"])
def test_step_caches_replay_the_blocks_they_compute(cache, quantize):
    """Under a step cache each block it computes replays its own graph: the images are bitwise those of
    the same pipeline with graphs off, cached steps and skipped blocks included."""
    from diffusers import MagCacheConfig

    configs = {
        "first_block_never_skips": lambda: FirstBlockCacheConfig(threshold=-1.0),
        "first_block": lambda: FirstBlockCacheConfig(threshold=0.3),
        "mag": lambda: MagCacheConfig(threshold=0.5, num_inference_steps=4, mag_ratios=[1.0, 0.95, 0.9, 0.9]),
    }
    pipe = _gpu_pipeline(quantize=quantize)
    pipe.transformer.enable_cache(configs[cache]())
    _replays_match_eager(pipe)
    _replays_match_eager(pipe)
    component = omni_accel.describe(pipe).components[0]
    blocks = block_graph_stats(component.block_graphs)
    assert blocks["captures"] > 0 and blocks["replays"] > 0 and not blocks["eager"], blocks
    assert blocks["inputs_in_place"] > 0, blocks  # each block's output read where its graph wrote it
    assert component.graphs.stats()["replays"] == 0
    assert component.runtime.fallbacks == {}


@pytest.mark.gpu
@pytest.mark.parametrize("cache", [False, True])
def test_replays_under_inference_mode(cache):
    """A pipeline called under ``torch.inference_mode()``: the step's graph, or each block's under a step
    cache, replays bitwise the eager steps."""
    pipe = _gpu_pipeline()
    if cache:
        pipe.transformer.enable_cache(FirstBlockCacheConfig(threshold=-1.0))
    with torch.inference_mode():
        _replays_match_eager(pipe)
        _replays_match_eager(pipe)
    component = omni_accel.describe(pipe).components[0]
    stats = block_graph_stats(component.block_graphs) if cache else component.graphs.stats()
    assert stats["replays"] > 0, stats


@pytest.mark.gpu
@pytest.mark.parametrize("quantize", [None, "fp8"])
def test_taylorseer_replays_a_graph_per_decision(quantize):
    """Under TaylorSeer (on the attention modules) each block replays the graph of its hooks' decision
    (its attention part computed, or predicted and skipped): bitwise the images with graphs off, where the
    native math runs the hooks around that part eagerly."""
    from diffusers import TaylorSeerCacheConfig

    pipe = _gpu_pipeline(quantize=quantize)
    pipe.transformer.enable_cache(TaylorSeerCacheConfig(cache_interval=2, disable_cache_before_step=1))
    _replays_match_eager(pipe, num_inference_steps=8)
    _replays_match_eager(pipe, num_inference_steps=8)
    component = omni_accel.describe(pipe).components[0]
    blocks = block_graph_stats(component.block_graphs)
    assert blocks["captures"] > 0 and blocks["replays"] > 0, blocks
    assert component.runtime.fallbacks == {}


@pytest.mark.gpu
def test_replays_follow_lora_scales_weight_edits_and_true_cfg():
    pipe = _gpu_pipeline()
    lora = random_lora(pipe.transformer, ["to_q", "to_v", "proj_out"], seed=5)
    pipe.load_lora_weights(lora, adapter_name="a")
    _replays_match_eager(pipe)
    graphs = omni_accel.describe(pipe).components[0].graphs
    misses = graphs.stats()["early_misses"]
    pipe.set_adapters("a", 0.3)
    _replays_match_eager(pipe)  # the first step's early replay (the old scale's graph) is dropped
    assert graphs.stats()["early_misses"] == misses + 1, graphs.stats()
    _replays_match_eager(pipe, joint_attention_kwargs={"scale": 0.7})
    with torch.no_grad():
        pipe.transformer.single_transformer_blocks[1].proj_mlp.weight.mul_(0.5)  # in place: same graph
    _replays_match_eager(pipe)
    _replays_match_eager(pipe, negative_prompt="a dog", true_cfg_scale=4.0)  # cond result held over uncond
    stats = omni_accel.describe(pipe).components[0].graphs.stats()
    assert stats["eager"] == {} and stats["captures"] == 3, stats  # LoRA, its new scale, the call scale


@pytest.mark.gpu
def test_a_patched_processor_keeps_the_steps_out_of_graphs(monkeypatch):
    """A replay would skip the patch's Python (``models/code_watch.py``): every step runs it eagerly."""
    pipe = _gpu_pipeline()
    original, calls = FluxAttnProcessor.__call__, []

    def recorder(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(FluxAttnProcessor, "__call__", recorder)
    pipe(prompt="a cat", num_inference_steps=3, output_type="latent")
    stats = omni_accel.describe(pipe).components[0].graphs.stats()
    assert stats["replays"] == stats["captures"] == 0, stats
    assert any("FluxAttnProcessor.__call__ is patched" in reason for reason in stats["eager"]), stats
    blocks = pipe.transformer.transformer_blocks, pipe.transformer.single_transformer_blocks
    assert len(calls) == 3 * sum(map(len, blocks))


@pytest.mark.gpu
def test_early_replays_serve_unchanged_steps_and_never_read_a_freed_weight():
    """The graph is launched before the module's state is read: unchanged steps are served by it; after
    a weight is replaced and its memory given back to the driver it is not launched at all."""
    pipe = _gpu_pipeline()
    graphs = omni_accel.describe(pipe).components[0].graphs
    _replays_match_eager(pipe)
    stats = graphs.stats()
    assert stats["early_replays"] >= 2 and stats["early_misses"] == 0, stats
    block = pipe.transformer.single_transformer_blocks[0]
    with torch.no_grad():
        block.proj_out.weight = torch.nn.Parameter(block.proj_out.weight * 0.5)
    torch.cuda.empty_cache()  # the old weight's memory, if nothing holds it, is unmapped
    before = graphs.stats()
    call = {"prompt": "a cat", "num_inference_steps": 1, "output_type": "latent"}
    pipe(**call, generator=torch.Generator("cuda").manual_seed(0))
    torch.cuda.synchronize()  # a launch that read unmapped memory would fault here
    after = graphs.stats()
    # the stale graph was launched only if the old weight is still alive (held by a view), and then dropped
    launched = after["early_replays"] - before["early_replays"]
    assert after["early_misses"] - before["early_misses"] == launched, (before, after)
    _replays_match_eager(pipe)  # the new weight's graphs
    assert graphs.stats()["eager"] == {}, graphs.stats()


def _parallel_replays(rank: int, world: int) -> None:
    """Each layout's replayed steps (their NCCL collectives captured with the kernels) against the same
    pipeline run eagerly, on every rank: uneven sequence slices, a new resolution, true CFG paired (over
    cfg=2's ranks, or stacked in one batch)."""
    faulthandler.dump_traceback_later(150, exit=True)  # a replay waiting on its peer has no NCCL timeout
    true_cfg = dict(negative_prompt="a dog", true_cfg_scale=4.0)
    for layout, options in (
        (ParallelConfig(tp=2), {}),
        (ParallelConfig(tp=2), {"compile": True}),  # functional collectives inside compiled blocks
        (ParallelConfig(ulysses=2), {}),
        (ParallelConfig(ulysses=2), {"compile": True}),  # peer writes inside a compiled block's attention
        (ParallelConfig(ring=2), {}),
        (ParallelConfig(cfg=2), {}),
        ("auto", {}),  # the layout arrives at the first call, around graphs installed before it
    ):
        print(f"rank {rank}: {layout} {options}", flush=True)
        pipe = _gpu_pipeline(parallel=layout, **options)
        _replays_match_eager(pipe)
        _replays_match_eager(pipe, **true_cfg)  # the first call's shapes: its graph again
        _replays_match_eager(pipe, height=48, width=32)
        _replays_match_eager(pipe, num_images_per_prompt=2)  # a strided slice of each sample, eagerly
        component = omni_accel.describe(pipe).components[0]
        stats = component.graphs.stats()
        # without a cfg group the true-CFG calls run stacked in one batch, of the two images' shapes; with
        # one, each rank runs a batch of one either way
        stacked = component.cfg.stacked_calls > 0
        assert stacked == (component.cfg.group is None), (layout, component.cfg.describe())
        assert stats["eager"] == {} and stats["captures"] == 2 + stacked, (layout, stats)
    _stacked_guidance_is_bitwise_the_two_calls()
    _peer_writes_move_what_nccl_moves()
    _sequence_by_peer_writes_is_nccls_up_to_rounding()


def _stacked_guidance_is_bitwise_the_two_calls() -> None:
    """A true-CFG step's two calls stacked in one batch give what the two calls give, bit for bit (the
    kernels here do not change their rounding with the batch)."""
    for degrees in (dict(ulysses=2), dict(tp=2)):
        images = []
        for stacked in (True, False):
            pipe = _gpu_pipeline(parallel=ParallelConfig(**degrees, batch_guidance=stacked))
            call = dict(prompt="a cat", negative_prompt="a dog", true_cfg_scale=4.0, output_type="latent")
            images.append(pipe(**call, generator=torch.Generator("cuda").manual_seed(0)).images)
            pairs = omni_accel.describe(pipe).components[0].cfg  # None: no pairing without stacking
            assert (pairs is not None and pairs.stacked_calls > 0) == stacked
        assert torch.equal(*images), degrees


def _peer_writes_move_what_nccl_moves() -> None:
    """Tensor parallelism's token split by peer writes into symmetric memory against every token on every
    rank (what it does without peer writes: NCCL all-reduces), bitwise equal on even and uneven token
    splits (two partial sums add in either order to the same bits, the norms are per token)."""
    images = []
    for peer_writes in (True, False):
        tuning = LayoutTuning(peer_writes=peer_writes)
        pipe = _gpu_pipeline(parallel=ParallelConfig(tp=2, tuning=tuning))
        call = dict(prompt="a cat", num_inference_steps=2, output_type="latent")
        sizes = ({}, {"height": 48, "width": 32})
        images.append(
            [pipe(**call, **size, generator=torch.Generator("cuda").manual_seed(0)).images for size in sizes]
        )
        report = str(omni_accel.describe(pipe))
        how = "into its peers' symmetric memory" if peer_writes else "peer writes switched off"
        assert any("tensor parallel" in row and how in row for row in report.splitlines()), report
    assert all(torch.equal(a, b) for a, b in zip(*images, strict=True))


def _sequence_by_peer_writes_is_nccls_up_to_rounding() -> None:
    """ring=2 and ulysses=2 by peer writes against NCCL's send/recv ring and all-to-all, in float32, even
    and uneven splits: the same attention up to the order of its sums and the GEMMs' own. By peer writes
    the q/k kernel writes q, k and v where the exchange wants them; FLUX's single blocks run their QKV
    and MLP-input GEMMs apart, the MLP's beside the transfer (ring: one kernel over the gathered K/V,
    double blocks the local block first, then the peer's, merged; Ulysses: one kernel over the rank's
    heads instead of two head stages, the single blocks' outputs returned beside their GELU)."""
    for layout, line, how in (
        (ParallelConfig(ring=2), "ring transfers", "into every peer's symmetric memory"),
        (ParallelConfig(ulysses=2), "ulysses exchanges", "into its peers' symmetric memory"),
    ):
        latents = []
        for peer_writes in (True, False):
            tuned = dataclasses.replace(layout, tuning=LayoutTuning(peer_writes=peer_writes))
            pipe = _gpu_pipeline(torch.float32, parallel=tuned)
            call = dict(prompt="a cat", num_inference_steps=2, output_type="latent")
            latents.append(
                [
                    pipe(**call, **size, generator=torch.Generator("cuda").manual_seed(0)).images
                    for size in ({}, {"height": 48, "width": 32})
                ]
            )
            report = str(omni_accel.describe(pipe))
            want = how if peer_writes else "peer writes switched off"
            assert any(line in row and want in row for row in report.splitlines()), report
        for got, nccl in zip(*latents, strict=True):
            error = ((got - nccl).abs().max() / nccl.abs().max()).item()
            assert error <= 1e-4, (layout, error)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_parallel_replays_are_bitwise_the_eager_steps():
    from multirank import run_multirank

    run_multirank(_parallel_replays, 2, timeout=300, backend="nccl")


def _split_modulation_on_one_gpu(rank: int, world: int) -> None:
    """On one rank the modulation split computes every block's projection whole: bitwise what a block
    computes alone (LoRA on the linears, accumulated in the GEMM's epilogue), and captured in a CUDA graph
    with its all-gather, replayed bitwise."""
    import torch.distributed as dist

    from omni_accel.layers.projection import apply_one, read_linear
    from omni_accel.layers.split_modulation import SplitModulation
    from omni_accel.models.base import modulation_sites

    pipe = _gpu_pipeline()
    modulations = ["norm1.linear", "norm1_context.linear", "norm.linear"]
    pipe.load_lora_weights(random_lora(pipe.transformer, modulations, seed=2), adapter_name="m")
    sites = modulation_sites(pipe.transformer)
    split = SplitModulation(sites, dist.group.WORLD)
    temb = torch.randn(2, pipe.transformer.inner_dim, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        eager = split.project_sites(sites, temb)
        for site in sites:
            alone = apply_one(torch.nn.functional.silu(temb), read_linear(site.module(), site.key))
            assert torch.equal(eager[site.key], alone), site.key
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            split.project_sites(sites, temb)  # warm-up outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = split.project_sites(sites, temb)
        temb.copy_(torch.randn_like(temb))
        graph.replay()
        again = split.project_sites(sites, temb)
    assert all(torch.equal(captured[key], again[key]) for key in again)


@pytest.mark.gpu
def test_split_modulation_on_one_gpu_is_each_blocks_own_and_replays():
    from multirank import run_multirank

    run_multirank(_split_modulation_on_one_gpu, 1, timeout=200, backend="nccl")


def test_graphs_of_one_module_share_their_static_inputs():
    """A new graph reads an argument from a kept graph's static input where it has the same position and
    memory layout (they replay one after another, each copying its arguments in first), else a copy."""
    from omni_accel.cuda_graphs import static_inputs

    hidden, text = torch.randn(2, 8, 4), torch.randn(2, 3, 4)
    first = static_inputs([hidden, text, 0.5], [])
    assert all(s is not t and torch.equal(s, t) for s, t in zip(first[:2], (hidden, text), strict=True))
    predicted = torch.randn(2, 8, 4)
    second = static_inputs([hidden.clone(), text[:, :2], 0.5, predicted], [first])
    assert second[0] is first[0]  # same position and layout: shared
    assert second[1] is not first[1] and second[1].shape == (2, 2, 4)  # another shape: its own copy
    assert second[2] == 0.5 and second[3] is not predicted and torch.equal(second[3], predicted)
    transposed = hidden.transpose(0, 1).contiguous().transpose(0, 1)  # same shape, other strides
    assert static_inputs([transposed], [first])[0] is not first[0]
