"""compile=True: the native blocks trace without graph breaks, keep following the attention scope, and
compile beside the running pipeline (eager steps until the code is ready, switched in between steps)."""

import contextlib
import dataclasses
import gc
import re
import threading
import weakref

import pytest
import torch
from test_wan_native import vace_call

import omni_accel
from omni_accel import attention_scope

CALL = dict(prompt="a cat", height=32, width=32, num_inference_steps=2, output_type="latent")


def _latents(pipe):
    return pipe(**CALL, generator=torch.Generator().manual_seed(0)).images


def test_compiled_blocks_match_eager_and_follow_the_scope():
    torch._dynamo.reset()
    eager = _latents(omni_accel.accelerate(omni_accel.tiny_flux_pipeline(seed=0)))
    pipe = omni_accel.accelerate(
        omni_accel.tiny_flux_pipeline(seed=0),
        compile={"backend": "aot_eager", "fullgraph": True},
        compile_in_background=False,
    )
    got = _latents(pipe)
    assert ((got - eager).abs().max() / eager.abs().max()).item() <= 1e-5
    report = omni_accel.describe(pipe)
    assert "repeated blocks compiled" in str(report)
    # the blocks consult the projection cache in their eager preparation, outside the compiled math
    cache = report.components[0].cache
    hits = cache.hits
    assert torch.equal(_latents(pipe), got) and cache.hits > hits  # the same request again: reused, bitwise
    with attention_scope(default="sdpa_math"):
        _latents(pipe)
    selector = omni_accel.describe(pipe).components[0].selector
    assert {row[2] for row in selector.decisions()} == {"sdpa", "sdpa_math"}  # decided at run time


@contextlib.contextmanager
def _forward_in_flight():
    """What an accelerated model's forward binds for its blocks' attention (one rank, no layout)."""
    from types import SimpleNamespace

    from omni_accel.attention.selection import default_selector
    from omni_accel.layers.attention import enter_forward, leave_forward

    token = enter_forward(SimpleNamespace(selector=default_selector(), layout=None))
    try:
        yield
    finally:
        leave_forward(token)


def test_routed_attention_op_passes_opcheck():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 5, 3, 8, generator=g) for _ in range(3))
    args = (q, k, v, True, "test", "self", 8**-0.5)
    mask = torch.rand(2, 1, 1, 5, generator=g) > 0.3
    mask[:, ..., 0] = True
    with _forward_in_flight():
        torch.library.opcheck(torch.ops.omni_accel.routed_attention.default, (*args, None))
        torch.library.opcheck(torch.ops.omni_accel.routed_attention.default, (*args, mask))
    with pytest.raises(RuntimeError, match="native attention ran outside an accelerated forward"):
        torch.ops.omni_accel.routed_attention.default(*args, None)


def test_placed_attention_op_passes_opcheck():
    """The op compiled blocks call where a layout places q, k and v (here one rank: nothing placed)."""
    import importlib

    importlib.import_module("omni_accel.layers.attention")  # registers the op
    g = torch.Generator().manual_seed(0)
    qs, ks, vs = ([torch.randn(1, n, 3 * 8, generator=g) for n in (2, 5)] for _ in range(3))
    weights = [torch.rand(8, generator=g) + 0.5 for _ in range(2)], [None, torch.rand(8, generator=g)]
    cos, sin = torch.rand(7, 8, generator=g), torch.rand(7, 8, generator=g)
    args = (qs, ks, vs, *weights, 8, 1e-6, cos, sin, False, "test", "self", 0.3)
    with _forward_in_flight():
        torch.library.opcheck(torch.ops.omni_accel.placed_attention.default, args)


def test_blocks_of_one_class_share_one_compiled_graph():
    """Per-layer constants in the traced code would recompile every block (torch's limit is 8)."""
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    pipe = omni_accel.tiny_flux_pipeline(seed=0, num_layers=3, num_single_layers=3)
    omni_accel.accelerate(pipe, compile={"backend": "aot_eager"}, compile_in_background=False)
    _latents(pipe)
    assert counters["stats"]["unique_graphs"] == 2  # one per block class
    # another pipeline of the class: its blocks run the same compiled code (the graphs name no pipeline)
    other = omni_accel.tiny_flux_pipeline(seed=1, num_layers=3, num_single_layers=3)
    omni_accel.accelerate(other, compile={"backend": "aot_eager"}, compile_in_background=False)
    _latents(other)
    assert counters["stats"]["unique_graphs"] == 2


def test_every_resolution_compiles_static_code():
    """A second input shape gets its own static graph, not torch.compile's automatic dynamic-shape one
    (whose kernels measured slower: FLUX.1-dev on an H200, 160 against 134 ms per step); the user's own
    ``dynamic`` option still decides when given."""
    torch._dynamo.reset()
    symbolic = []

    def backend(gm, example_inputs):
        values = [node.meta.get("example_value") for node in gm.graph.find_nodes(op="placeholder")]
        shapes = [value.shape for value in values if isinstance(value, torch.Tensor)]
        sizes = [value for value in values if isinstance(value, torch.SymInt)]
        symbolic.append(bool(sizes) or any(isinstance(n, torch.SymInt) for shape in shapes for n in shape))
        return gm.forward

    pipe = omni_accel.tiny_flux_pipeline(seed=0)
    omni_accel.accelerate(pipe, compile={"backend": backend}, compile_in_background=False)
    for size in (32, 48):
        pipe(**{**CALL, "height": size, "width": size}, generator=torch.Generator().manual_seed(0))
    assert symbolic == [False] * 4  # two block classes, two resolutions
    torch._dynamo.reset()
    symbolic.clear()
    pipe = omni_accel.tiny_flux_pipeline(seed=0)
    omni_accel.accelerate(pipe, compile={"backend": backend, "dynamic": True}, compile_in_background=False)
    _latents(pipe)
    assert symbolic and all(symbolic)


def test_diffusers_compile_repeated_blocks_after_accelerate():
    """Diffusers' own switch compiles the blocks whole (the traced block runs Diffusers' forward: the native
    path's host-side work does not trace), without a graph break, once per block class; the output matches."""
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    plain = omni_accel.tiny_flux_pipeline(seed=0, num_layers=3, num_single_layers=3)
    pipe = omni_accel.accelerate(omni_accel.tiny_flux_pipeline(seed=0, num_layers=3, num_single_layers=3))
    pipe.transformer.compile_repeated_blocks(backend="aot_eager")
    got = _latents(pipe)
    assert ((got - _latents(plain)).abs().max() / _latents(plain).abs().max()).item() <= 1e-5
    assert counters["stats"]["unique_graphs"] <= 4  # per block class, a recompile at most
    assert not counters["graph_break"]


def test_describe_says_blocks_run_under_a_users_own_compile():
    """A user's compile_repeated_blocks() before accelerate: the blocks ran Diffusers' forward under it, and
    describe said only "native", attention "planned (no call yet)" and the cache "not consulted yet"."""
    torch._dynamo.reset()
    expected = _latents(omni_accel.tiny_flux_pipeline(seed=0))
    pipe = omni_accel.tiny_flux_pipeline(seed=0)
    assert "torch.compile" not in str(omni_accel.describe(omni_accel.accelerate(pipe)))
    omni_accel.restore(pipe)
    pipe.transformer.compile_repeated_blocks(backend="eager")
    omni_accel.accelerate(pipe)
    assert torch.equal(_latents(pipe), expected)
    report = str(omni_accel.describe(pipe))
    assert "a torch.compile of the user's own: 4 of the 4 native blocks" in report, report
    assert "run neither the native math nor our attention providers" in report


def test_describe_reads_a_torch_compile_wrapper_of_the_transformer_as_the_module_it_compiles():
    """pipe.transformer = torch.compile(pipe.transformer) after accelerate: describe said the transformer was
    replaced and 'accelerated by another pipeline' (native) or 'runs as in Diffusers' (routed), while the
    wrapper runs this pipeline's setup, its calls traced outside the accelerated forward; restore undoes the
    module inside and leaves the wrapper where the user put it."""
    torch._dynamo.reset()
    plain = omni_accel.tiny_flux_pipeline(seed=0)
    plain.transformer = torch.compile(plain.transformer, backend="eager")
    pipe = omni_accel.accelerate(omni_accel.tiny_flux_pipeline(seed=0))
    pipe.transformer = wrapper = torch.compile(pipe.transformer, backend="eager")
    assert torch.equal(_latents(pipe), _latents(plain))
    report = omni_accel.describe(pipe).components[0]
    assert report.mode == "native", report
    assert "torch.compile(FluxTransformer2DModel) put in the pipeline holds its 4 native blocks" in str(
        report
    )
    omni_accel.restore(pipe)
    assert pipe.transformer is wrapper
    assert type(wrapper._orig_mod.transformer_blocks[0]) is type(
        plain.transformer._orig_mod.transformer_blocks[0]
    )


def test_a_torch_compile_wrapper_of_a_model_without_native_blocks_runs_our_providers():
    """pipe.transformer = torch.compile(pipe.transformer) (fullgraph or not) on a routed or generic model:
    Dynamo traced the module's whole call from its first frame, where the accelerated forward's scopes were
    not entered, so every attention call ran Diffusers' function and describe said so. The scopes are now
    entered around the compiled frames: our providers serve the calls, in one graph, and the images are plain
    Diffusers'. Called from inside a larger compiled function, the model is traced in, with no graph break."""
    from torch._dynamo.utils import counters

    want = _latents(omni_accel.tiny_sd3_pipeline(seed=0))
    for fullgraph, options in (
        (False, {"native": False}),
        (True, {"native": False, "compile": {"backend": "eager"}}),
    ):
        torch._dynamo.reset()
        counters.clear()
        pipe = omni_accel.accelerate(omni_accel.tiny_sd3_pipeline(seed=0), **options)
        pipe.transformer = torch.compile(pipe.transformer, backend="eager", fullgraph=fullgraph)
        assert torch.equal(_latents(pipe), want)
        assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"], dict(counters)
        report = str(omni_accel.describe(pipe))
        assert "attention resolved: sd3.joint" in report, report
        if "compile" in options:
            assert "compiles the module's whole call, our attention providers inside it" in str(report), (
                report
            )
        else:
            assert "torch.compile" not in str(report), report

    captured = {}
    transformer = pipe.transformer._orig_mod
    hook = transformer.register_forward_pre_hook(lambda m, a, k: captured.update(k), with_kwargs=True)
    _latents(pipe)
    hook.remove()
    torch._dynamo.reset()
    counters.clear()
    outer = torch.compile(lambda **kw: transformer(**kw)[0] * 2, backend="eager", fullgraph=True)
    assert torch.equal(outer(**captured), transformer(**captured)[0] * 2)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters)


def test_describe_counts_blocks_a_torch_compile_wrapper_took_the_place_of():
    """pipe.transformer.transformer_blocks[0] = torch.compile(block): that block runs Diffusers' forward
    (traced), and describe did not say so."""
    torch._dynamo.reset()
    pipe = omni_accel.accelerate(omni_accel.tiny_flux_pipeline(seed=0))
    blocks = pipe.transformer.transformer_blocks
    blocks[0] = torch.compile(blocks[0], backend="eager")
    report = str(omni_accel.describe(pipe))
    assert "a torch.compile of the user's own: 1 of the 4 native blocks" in report, report


def _compiler(pipe):
    return omni_accel.describe(pipe).components[0].runtime.compiler


def test_background_compile_runs_eager_steps_then_switches_between_steps():
    torch._dynamo.reset()
    pipe = omni_accel.accelerate(
        omni_accel.tiny_flux_pipeline(seed=0), compile=True, compile_in_background=True
    )  # inductor
    compiler = _compiler(pipe)
    generations = []

    def wait_for_the_compile(pipe, step, timestep, kwargs):
        compiler.wait()
        generations.append(compiler.generation)
        return kwargs

    call = {**CALL, "num_inference_steps": 3}
    got = pipe(
        **call, generator=torch.Generator().manual_seed(0), callback_on_step_end=wait_for_the_compile
    ).images
    # Step 1 ran the eager blocks (2 double, 2 single) alone; step 2 too, while both functions compiled; the
    # compile finished during its callback but is switched in only as step 3 starts, which ran compiled.
    assert generations == [0, 0, 1]
    assert compiler.calls() == {"double_block": (4, 2), "single_block": (4, 2)}
    eager = omni_accel.accelerate(omni_accel.tiny_flux_pipeline(seed=0))
    eager = eager(**call, generator=torch.Generator().manual_seed(0)).images
    assert ((got - eager).abs().max() / eager.abs().max()).item() <= 1e-5
    blocking = omni_accel.accelerate(
        omni_accel.tiny_flux_pipeline(seed=0), compile=True, compile_in_background=False
    )
    assert torch.equal(_latents(blocking), _latents(pipe))  # from now on all compiled: the same code
    report = str(omni_accel.describe(pipe))
    assert re.search(
        r"double_block: compiled in the background in \d+\.\d s \(4 calls ran eagerly before, 6 compiled\)",
        report,
    )
    assert "repeated blocks compiled (in the background" in report


def _tensors(value):
    """Every tensor in ``value``, inside containers and dataclasses (the weights of a LinearWeights) too."""
    if isinstance(value, torch.Tensor):
        return [value]
    if dataclasses.is_dataclass(value):
        value = [getattr(value, field.name) for field in dataclasses.fields(value)]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, list | tuple):
        return [t for item in value for t in _tensors(item)]
    return []


def test_block_math_never_writes_to_its_inputs(monkeypatch):
    """The background compile runs the compiled math once on the caller's arguments and throws the result
    away, which is harmless only because the math is pure."""
    from omni_accel.models.base import NativeRuntime

    checked = set()
    real = NativeRuntime.math

    def checking(runtime, fn, caller):
        math = real(runtime, fn, caller)

        def run(*args):
            leaves = _tensors(args)
            before = [t.clone() for t in leaves]
            out = math(*args)
            assert all(torch.equal(a, b) for a, b in zip(before, leaves, strict=True)), fn.__name__
            checked.add(fn.__name__)
            return out

        return run

    monkeypatch.setattr(NativeRuntime, "math", checking)
    _latents(omni_accel.accelerate(omni_accel.tiny_flux_pipeline(seed=0)))
    vace = omni_accel.accelerate(omni_accel.tiny_wan_pipeline(seed=0, vace=True))
    vace(**vace_call(vace), generator=torch.Generator().manual_seed(0))
    assert checked == {"double_block", "single_block", "wan_block", "wan_vace_block"}


def test_no_switch_while_a_compile_is_in_flight():
    """A step boundary with one function compiled and another still compiling switches in neither."""
    from omni_accel.models.compiler import BlockCompiler

    torch._dynamo.reset()
    release = threading.Event()
    compiler = BlockCompiler({"backend": "aot_eager"})
    real = compiler._build

    def slow_for_g(fn, *args):
        if fn is g:
            release.wait(60)
        return real(fn, *args)

    compiler._build = slow_for_g
    x = torch.randn(4)
    for step in range(3):  # "a" runs f, "b" runs g; the compiles start at the second step
        compiler.math(f, "a")(x)
        compiler.math(g, "b")(x)
        assert len(compiler._threads) == (2 if step else 0)
        if step:
            compiler._threads[0].join(60)  # f is compiled, g is not
            assert compiler.begin_step() == 0 and compiler.compiling  # graphs: replay, do not capture
    assert compiler.generation == 0 and compiler.calls() == {"f": (3, 0), "g": (3, 0)}
    release.set()
    compiler.wait()
    assert torch.equal(compiler.math(f, "a")(x), f(x)) and torch.equal(compiler.math(g, "b")(x), g(x))
    assert compiler.generation == 1 and compiler.calls() == {"f": (3, 1), "g": (3, 1)}
    assert compiler.begin_step() == 1 and not compiler.compiling


def test_no_compile_starts_in_a_step_a_capture_waits_to_follow():
    """Eager steps that CUDA graphs will capture once kernels are built (or after the warm-up) start no
    compile: it would hold the capture off, and every step until it ended would run eagerly beside it. The
    first replay starts it (``before_replay``)."""
    from omni_accel import background
    from omni_accel.models.compiler import BlockCompiler

    torch._dynamo.reset()
    compiler = BlockCompiler({"backend": "aot_eager"})
    x = torch.randn(4)
    for _ in range(3):  # the warm-up, then two steps while kernels build
        with background.capture_waits():
            compiler.math(f, "a")(x)
            compiler.math(g, "b")(x)
    assert compiler._threads == [] and not compiler.compiling
    assert not background.capture_waiting()
    compiler.start_compiles()  # what a replay calls first
    assert len(compiler._threads) == 2
    compiler.wait()
    assert compiler.begin_step() == 1 and compiler.calls() == {"f": (3, 0), "g": (3, 0)}


def test_an_eager_call_beside_the_compiles_start_queues_no_second_compile(monkeypatch):
    """Another thread's eager call (a pipeline sharing the transformer) that checked the function was not
    compiling, then queued its arguments after this thread's step boundary had started the compile, left
    them queued: the next boundary compiled the function a second time after its code was switched in
    (the generation advanced again: CUDA graphs recaptured; no capture while it compiled)."""
    from omni_accel.models import compiler as module

    torch._dynamo.reset()
    compiler = module.BlockCompiler({"backend": "eager"})
    builds = []
    real_build = compiler._build
    compiler._build = lambda fn, calls, options: builds.append(len(calls)) or real_build(fn, calls, options)
    x, y = torch.randn(4), torch.randn(6)
    compiler.math(f, "a")(x)  # this thread's first step: queues x's shape
    inside, go = threading.Event(), threading.Event()
    signature = module._signature

    def slow_signature(args, kwargs):  # the other thread's call, between its check and its queueing
        if threading.current_thread().name == "other":
            inside.set()
            go.wait(0.5)  # fixed: it holds the lock, so the compile cannot start before it queued
        return signature(args, kwargs)

    monkeypatch.setattr(module, "_signature", slow_signature)
    other = threading.Thread(target=lambda: compiler.math(f, "b")(y), name="other")
    other.start()
    assert inside.wait(10)
    compiler.start_compiles()  # this thread's next step boundary
    go.set()
    other.join(10)
    for _ in range(3):  # the steps after: the code is switched in, and nothing is left to compile
        compiler.wait()
        compiler.math(f, "a")(x)
    assert builds == [2] and compiler.generation == 1


def test_an_eager_call_that_ends_after_the_switch_queues_no_second_compile():
    """A block whose eager math was handed out before another thread's step boundary switched the compiled
    code in, and ran after it, queued its arguments: the next boundary compiled the function again."""
    from omni_accel.models.compiler import BlockCompiler

    torch._dynamo.reset()
    compiler = BlockCompiler({"backend": "eager"})
    x = torch.randn(4)
    compiler.math(f, "a")(x)
    compiler.math(f, "a")(x)  # the second step starts the compile
    compiler.wait()
    late = compiler.math(f, "b")  # this thread's block, still eager
    compiler.math(f, "a")  # another thread's next step: the code is switched in
    late(x)
    compiler.math(f, "a")(x)
    compiler.wait()
    assert compiler.generation == 1 and not compiler.compiling and compiler.begin_step() == 1


def test_wait_joins_compiles_started_from_several_threads_at_once():
    """Two threads' step boundaries starting compiles at once (pipelines sharing a transformer) each rebuilt
    the list of compile threads from what it read before the other's update: one thread was lost, and
    ``wait`` (the benchmarks' wait for a warm image) returned while its compile still ran."""
    from omni_accel.models.compiler import BlockCompiler

    torch._dynamo.reset()
    compiler = BlockCompiler({"backend": "eager"})
    release = threading.Event()
    real_build = compiler._build

    def slow_for_g(fn, *args):
        if fn is g:
            release.wait(10)
        return real_build(fn, *args)

    compiler._build = slow_for_g
    x = torch.randn(4)
    compiler.math(h, "a")(x)
    compiler.math(h, "a")(x)  # the first compile: a thread is listed
    compiler.wait()
    compiler.math(f, "b")(x)
    inside, go = threading.Event(), threading.Event()

    def slow_is_alive():  # the other thread's look at the listed threads, before it lists its own
        if threading.current_thread().name == "other":
            inside.set()
            go.wait(0.5)  # fixed: it holds the lock, so this thread's compile starts after
        return False

    compiler._threads[0].is_alive = slow_is_alive
    other = threading.Thread(target=compiler.start_compiles, name="other")  # starts f's compile
    other.start()
    try:
        assert inside.wait(10)
        compiler.math(g, "c")(x)
        compiler.start_compiles()  # this thread's step boundary starts g's
        go.set()
        other.join(10)
        assert "omni_accel-compile-g" in {thread.name for thread in compiler._threads}  # ``wait`` joins it
    finally:
        release.set()
    compiler.wait()
    assert not compiler.compiling


def test_every_input_shape_the_eager_steps_met_compiles_in_the_background():
    """A block function called with several shapes in a step (Z-Image's refiners and main layers) has each
    compiled by the worker before the switch, none left to compile in the call that meets it after."""
    from omni_accel.models.compiler import BlockCompiler

    torch._dynamo.reset()
    compiled_in = []

    def backend(gm, example_inputs):
        compiled_in.append(threading.current_thread().name)
        return gm.forward

    compiler = BlockCompiler({"backend": backend})
    blocks = {"a": torch.randn(4), "b": torch.randn(6), "c": torch.randn(2, 3), "d": torch.randn(6)}
    for _ in range(2):  # the compile starts at the second step, with every shape of the first
        for block, x in blocks.items():
            compiler.math(f, block)(x)
    compiler.wait()
    assert compiler.begin_step() == 1
    for block, x in blocks.items():
        assert torch.equal(compiler.math(f, block)(x), f(x))
    assert compiler.calls() == {"f": (8, 4)}
    assert compiled_in == ["omni_accel-compile-f"] * 3  # one per shape, none in the calling thread


def test_zimage_blocks_compile_every_shape_in_the_background():
    """Z-Image runs one block function at three shapes a step (its noise and caption refiners, its main
    layers): all compile in the worker, none in the step after the switch."""
    torch._dynamo.reset()
    compiled_in = []

    def backend(gm, example_inputs):
        compiled_in.append(threading.current_thread().name)
        return gm.forward

    pipe = omni_accel.accelerate(
        omni_accel.tiny_zimage_pipeline(seed=0), compile={"backend": backend}, compile_in_background=True
    )
    _latents(pipe)
    compiler = omni_accel.describe(pipe).components[0].runtime.compiler
    compiler.wait()
    _latents(pipe)
    assert compiler.calls()["zimage_block"][1] > 0  # the second image ran the compiled code
    assert compiled_in == ["omni_accel-compile-zimage_block"] * 3


def test_a_block_calls_signature_tells_apart_what_a_static_compile_does():
    from omni_accel.models.compiler import _signature

    x = torch.randn(2, 3)
    site_a, site_b = object(), object()  # passed to every block alike: their identity is not a new shape
    assert _signature((x, site_a), {"eps": 1e-6}) == _signature((x.clone(), site_b), {"eps": 1e-6})
    assert _signature((x,), {"eps": 1e-6}) != _signature((x,), {"eps": 1e-5})  # Dynamo specializes on it
    assert _signature((x,), {}) != _signature((x.t(),), {})  # strides
    assert _signature((x,), {}) != _signature((x[:1],), {})


def test_a_failed_background_compile_is_raised_once_then_runs_eagerly():
    from omni_accel.models.compiler import BlockCompiler

    torch._dynamo.reset()
    compiler = BlockCompiler({"backend": "aot_eager", "fullgraph": True})
    x = torch.randn(4)
    compiler.math(breaks, "a")(x)
    compiler.math(breaks, "a")(x)  # the second step submits the compile
    compiler.wait()
    compiler.math(breaks, "b")(x)  # the same step, after the failure: eager, and queues no second compile
    with pytest.raises(
        RuntimeError, match="(?s)breaks in the background failed to compile.*compile_in_background=False"
    ):
        compiler.math(breaks, "a")(x)
    for _ in range(2):  # no second error, no second compile
        assert torch.equal(compiler.math(breaks, "a")(x), breaks(x))
        compiler.wait()
    (line,) = compiler.summary()  # one line of describe, though Dynamo's error runs over many
    assert re.fullmatch(
        r"breaks: compile failed, runs eagerly: Unsupported: .+ in the background \(5 calls.*", line
    )
    assert compiler.calls() == {"breaks": (5, 0)}


def _refuses(gm, example_inputs):
    raise RuntimeError("this backend refuses every graph")


@pytest.mark.parametrize("tier", ["native", "generic"])
def test_describe_says_blocks_whose_background_compile_failed_run_eagerly(tier):
    """The report's first line said the blocks were compiled (and the generic tier's layers "(compiled)")
    after their compile had failed and they ran eagerly; only the ``compiled:`` line told the truth."""
    torch._dynamo.reset()
    build, options = {
        "native": (omni_accel.tiny_flux_pipeline, {}),
        "generic": (omni_accel.tiny_qwenimage_pipeline, {"native": False}),
    }[tier]
    pipe = omni_accel.accelerate(
        build(seed=0), compile={"backend": _refuses}, compile_in_background=True, **options
    )
    _latents(pipe)  # the second step starts the compile
    _compiler(pipe).wait()
    pending = str(omni_accel.describe(pipe))
    assert "compile failed, raised at the next step, then runs eagerly: BackendCompilerFailed" in pending
    with pytest.raises(RuntimeError, match="in the background failed to compile"):
        _latents(pipe)
    for report in (pending, str(omni_accel.describe(pipe))):
        first = report.splitlines()[1]
        assert re.search(
            r"repeated blocks (\(\w+\) )?not compiled: the compile failed, so they run eagerly \(.+: "
            r"BackendCompilerFailed: .*this backend refuses every graph\)",
            first,
        ), first
        assert "compiled in the background" not in first and "compiled (in the background" not in first
        assert "(compiled)" not in report


def test_describe_names_the_block_functions_whose_compile_failed_beside_compiled_ones():
    from collections import Counter
    from types import SimpleNamespace

    from omni_accel.models.compiler import BlockCompiler
    from omni_accel.report import ComponentReport

    torch._dynamo.reset()
    compiler = BlockCompiler({"backend": "eager", "fullgraph": True}, raise_failures=False)
    x = torch.randn(4)
    for _ in range(3):  # eager, then both compile (``breaks`` fails), then switched in
        compiler.math(f, "a")(x)
        compiler.math(breaks, "b")(x)
        compiler.wait()
    runtime = SimpleNamespace(compiler=compiler, fallbacks=Counter())
    report = ComponentReport(
        "transformer", "T", "native", "x; repeated blocks compiled (in the background)", runtime=runtime
    )
    assert re.fullmatch(
        r"x; repeated blocks compiled \(in the background\), except the blocks of a function whose compile "
        r"failed, which run eagerly \(breaks: Unsupported: .+\)",
        report._detail(),
    )


def test_describe_beside_another_threads_first_call(monkeypatch):
    """``describe`` lists the compiler's functions while another thread's first call of a block function
    adds one (a status page beside a request): it raised "dictionary changed size during iteration"."""
    from omni_accel.models.compiler import BlockCompiler

    compiler = BlockCompiler({"backend": "eager"})
    compiler.math(f, "a")
    line = BlockCompiler._line

    def line_while_another_thread_calls(fn, function):
        compiler.math(g, "b")  # what the other thread ran meanwhile
        return line(fn, function)

    monkeypatch.setattr(BlockCompiler, "_line", staticmethod(line_while_another_thread_calls))
    assert compiler.summary() == [
        "f: not yet compiled in the background (0 calls ran eagerly before, 0 compiled)"
    ]


def test_a_compile_that_cannot_start_raises_at_every_call():
    """torch.compile refusing its arguments at the first call is not remembered as a compiled function."""
    from omni_accel.models.compiler import BlockCompiler

    compiler = BlockCompiler({"bogus_kw": 1}, background=False)
    for _ in range(2):
        with pytest.raises(TypeError, match="unexpected keyword argument 'bogus_kw'"):
            compiler.math(f, "a")


def test_under_a_layout_the_compile_waits_for_the_first_call():
    from omni_accel.models.compiler import BlockCompiler

    torch._dynamo.reset()
    compiler = BlockCompiler({"backend": "aot_eager"}, background=False)
    compiler.math(f, "a")(torch.randn(4))
    assert not compiler._threads and compiler.summary() == ["f: compiled at its first call per input shape"]
    compiler = BlockCompiler({"backend": "aot_eager"})
    compiler.math(f, "a", background=False)(torch.randn(4))  # a parallel layout
    assert not compiler._threads and compiler.summary() == ["f: compiled at its first call per input shape"]


def f(x):
    return torch.sin(x) * 2


def g(x):
    return torch.cos(x) + 1


def breaks(x):
    torch._dynamo.graph_break()
    return x + 1


def _breaks_the_graph(x):
    torch._dynamo.graph_break()
    return x * 2


def test_a_compile_nobody_asked_for_falls_back_to_eager_at_the_first_call():
    """The generic tier's automatic compile (raise_failures=False): a block that cannot compile whole runs
    eagerly, said once and in the summary; an explicit compile raises."""
    from omni_accel.models.compiler import BlockCompiler

    torch._dynamo.reset()
    x = torch.randn(4)
    quiet = BlockCompiler({"backend": "eager", "fullgraph": True}, background=False, raise_failures=False)
    for _ in range(2):
        assert torch.equal(quiet.math(_breaks_the_graph, "a")(x), x * 2)
    (line,) = quiet.summary()
    assert re.fullmatch(
        r"_breaks_the_graph: compile failed, runs eagerly: .+ at its first call per input shape", line
    )
    loud = BlockCompiler({"backend": "eager", "fullgraph": True}, background=False)
    with pytest.raises(Exception, match="graph_break|Graph break|graph break"):
        loud.math(_breaks_the_graph, "a")(x)


def h(x):
    return torch.tanh(x) - 1


@pytest.mark.parametrize("background", [False, True], ids=["first-call", "background"])
@pytest.mark.parametrize("asked", [False, True], ids=["automatic", "compile-given"])
def test_a_call_past_dynamos_recompile_limit_runs_eagerly_alone(background, asked):
    """Dynamo's cache of compiled versions per code object is shared with every compile of a block class
    in the process (a user's compile_repeated_blocks of another pipeline, our other pipelines): a call that
    needs a version past its limit runs eagerly, said in the summary, and the versions compiled before keep
    serving their inputs. Never an error, whether or not the user asked for the compile (``compile=`` given:
    ``raise_failures``, where a failed compile is raised)."""

    torch._dynamo.reset()
    with torch._dynamo.config.patch(recompile_limit=1):
        _past_the_recompile_limit(background, asked)


def _past_the_recompile_limit(background: bool, raise_failures: bool = False) -> None:
    from omni_accel.models.compiler import BlockCompiler

    compiler = BlockCompiler(
        {"backend": "eager", "fullgraph": True}, background=background, raise_failures=raise_failures
    )
    small, large = torch.randn(4), torch.randn(6)
    for _ in range(3):  # background: the first steps eager, the compile between, then compiled
        assert torch.equal(compiler.math(h, "a")(small), h(small))
        compiler.wait()
    assert torch.equal(compiler.math(h, "a")(large), h(large))  # another static shape: past the limit
    assert torch.equal(compiler.math(h, "a")(small), h(small))  # the compiled version still serves
    summary = compiler.summary()
    assert "compile failed" not in summary[0]
    assert summary[1] == (
        "h: 1 calls ran eagerly: Dynamo's recompile limit (torch._dynamo.config.recompile_limit) was reached "
        "for this block class in the process"
    )
    if background:
        eager, compiled = compiler.calls()["h"]
        assert eager >= 1 and compiled >= 2, (eager, compiled)


def test_torch_compile_in_a_thread_undoes_what_another_thread_set_meanwhile():
    """Why ``compile_in_background`` is off by default: torch.compile saves process-wide state when it starts
    (the random state, the default dtype...) and restores it when it ends, so a ``torch.manual_seed`` in the
    main thread during a background compile is undone (the cause of the wrong images a GPU run of many
    pipelines showed: a model built with a seeded random init beside a compile got other weights). The day
    this fails, torch keeps other threads' state and the background compile can become the default."""
    inside, changed = threading.Event(), threading.Event()

    def waits_for_the_main_thread(gm, example_inputs):
        inside.set()
        changed.wait(60)
        return gm.forward

    def f(x):
        return torch.sin(x) + 1

    torch._dynamo.reset()
    worker = threading.Thread(
        target=lambda: torch.compile(f, backend=waits_for_the_main_thread)(torch.ones(2))
    )
    worker.start()
    assert inside.wait(60)
    try:
        torch.manual_seed(1)
        torch.set_default_dtype(torch.float64)
    finally:
        changed.set()
        worker.join()
    got, dtype = torch.randn(3), torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    torch.manual_seed(1)
    assert not torch.equal(got, torch.randn(3)) and dtype == torch.float32, (
        "torch.compile in a thread no longer undoes another thread's seed and default dtype: "
        "compile_in_background may become the default again"
    )


def _complex_rope(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Qwen-Image's and Z-Image's rotation: q or k times complex frequencies."""
    rotated = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2)) * freqs.unsqueeze(1)
    return torch.view_as_real(rotated).flatten(3).type_as(x) * 2


def test_complex_products_compile_as_real_arithmetic():
    """Inductor generates no code for complex tensors; our pass rewrites their products so they fuse."""
    from torch._inductor.custom_graph_pass import CustomGraphPass

    from omni_accel.models.complex_products import RealComplexProducts

    seen: list[str] = []

    class Recorded(CustomGraphPass):
        def __call__(self, graph):
            RealComplexProducts()(graph)
            seen.extend(str(node.target) for node in graph.nodes)

        def uuid(self):
            return None

    torch._dynamo.reset()
    x = torch.randn(2, 8, 3, 16)
    freqs = torch.polar(torch.ones(8, 8), torch.randn(8, 8))
    compiled = torch.compile(_complex_rope, fullgraph=True, options={"post_grad_custom_pre_pass": Recorded()})
    torch.testing.assert_close(compiled(x, freqs), _complex_rope(x, freqs), rtol=1e-6, atol=1e-6)
    assert "aten.mul.Tensor" in seen and "aten.view_as_complex.default" not in seen, seen
    assert sum(target == "aten.view_as_real.default" for target in seen) == 1  # of the frequencies: a view


def test_block_compiles_carry_our_graph_passes_where_inductor_compiles():
    from omni_accel.models.compiler import BlockCompiler
    from omni_accel.models.complex_products import RealComplexProducts

    passes = BlockCompiler({"fullgraph": True}).options["options"]
    assert isinstance(passes["post_grad_custom_pre_pass"], RealComplexProducts)
    assert "options" not in BlockCompiler({"backend": "eager"}).options
    assert "options" not in BlockCompiler({"mode": "max-autotune"}).options  # torch takes one of the two
    own = object()
    options = BlockCompiler({"options": {"post_grad_custom_pre_pass": own}}).options
    assert options["options"]["post_grad_custom_pre_pass"] is own


@pytest.mark.parametrize("tier", ["native", "generic"])
@pytest.mark.parametrize("when", ["queued", "in-flight"])
def test_a_dtype_change_beside_the_background_compile_is_compiled_again_not_failed(tier, when):
    """``pipe.to(torch.float64)`` after the eager calls queued their arguments (a one-step call), or while
    the worker runs them: the queued activations and the moved weights mixed dtypes, the compile "failed",
    the next call raised and the blocks never compiled. Now the compile is made again from new calls."""
    torch._dynamo.reset()
    running, release = threading.Event(), threading.Event()

    def backend(gm, example_inputs):
        running.set()
        release.wait(60)
        return gm.forward

    build = omni_accel.tiny_flux_pipeline if tier == "native" else omni_accel.tiny_qwenimage_pipeline
    # built before any compile: one ending beside a seeded build undoes its seed (see the test above)
    expected = _latents_of(build(seed=0).to(torch.float64), steps=2)
    options = {"native": False} if tier == "generic" else {}
    pipe = omni_accel.accelerate(
        build(seed=0), compile={"backend": backend}, compile_in_background=True, **options
    )
    compiler = _compiler(pipe)
    _latents_of(pipe, steps=1 if when == "queued" else 2)
    if when == "in-flight":
        assert running.wait(60) and compiler.compiling
    # the worker, queued or tracing, sees the move before its backend returns: no unordered race with it
    pipe.to(torch.float64)
    release.set()
    compiler.wait()  # the compile in flight ends, stale
    for _ in range(2):  # the first compiles again (eagerly meanwhile), the second runs the compiled code
        assert ((_latents_of(pipe, steps=2) - expected).abs().max() / expected.abs().max()).item() <= 1e-12
        compiler.wait()
    assert "failed" not in str(omni_accel.describe(pipe))
    assert all(compiled for _, compiled in compiler.calls().values()), compiler.calls()


@pytest.mark.parametrize("tier", ["native", "generic"])
def test_a_move_drops_the_calls_queued_for_the_background_compile(tier):
    """``pipe.to`` another dtype or device after the eager calls queued their arguments (a one-step call)
    drops those calls at the move: they held the old activations and weights (on the GPU they were on)
    until the next call, whose compile of them would stop as stale anyway. A ``to`` where the model is
    keeps them. No compile runs here."""
    build = omni_accel.tiny_flux_pipeline if tier == "native" else omni_accel.tiny_qwenimage_pipeline
    options = {"native": False} if tier == "generic" else {}
    pipe = omni_accel.accelerate(build(seed=0), compile=True, compile_in_background=True, **options)
    compiler = _compiler(pipe)
    _latents_of(pipe, steps=1)
    queued = [function.queued for function in compiler._functions.values()]
    held = [
        weakref.ref(leaf)
        for calls in queued
        for call in calls.values()
        for leaf in torch.utils._pytree.tree_leaves(call[:2])
        if isinstance(leaf, torch.Tensor) and leaf.dtype == torch.float32
    ]
    assert held and not compiler.compiling
    pipe.to("cpu")  # where the model is
    assert all(ref() is not None and ref().dtype == torch.float32 for ref in held)
    pipe.to(torch.float64)
    gc.collect()
    # what stays alive is the model's own parameters (moved: the same objects)
    assert not any(queued) and all(ref() is None or ref().dtype == torch.float64 for ref in held)


def _latents_of(pipe, steps):
    return pipe(**{**CALL, "num_inference_steps": steps}, generator=torch.Generator().manual_seed(0)).images
