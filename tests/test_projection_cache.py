"""Every exactness rule of ExactProjectionCache has a test that fails when the rule is broken."""

import importlib
import threading

import pytest
import torch
import torch.nn.functional as F

import omni_accel
from omni_accel.cache import ExactProjectionCache
from omni_accel.cache.projection import GRADIENTS, HOOKED, WEIGHTS_CHANGED


@pytest.fixture(autouse=True)
def no_grad():
    with torch.no_grad():
        yield


def _linear(seed=0, i=8, o=16):
    torch.manual_seed(seed)
    return torch.nn.Linear(i, o)


def _cond(value=1.0, shape=(2, 8)):
    return torch.linspace(-1, 1, shape[0] * shape[1]).reshape(shape) * value


def _project(cache, lin, cond, name="mod"):
    cache.prepare(cond)
    return cache.project(name, lin, cond, lambda: lin(F.silu(cond)))


def test_exported_from_the_package():
    assert omni_accel.ExactProjectionCache is ExactProjectionCache


@pytest.mark.parametrize(
    "bad, error", [(-1, ValueError), (1.5, TypeError), ("1", TypeError), (True, TypeError)]
)
def test_invalid_budget(bad, error):
    with pytest.raises(error, match="max_bytes"):
        ExactProjectionCache(max_bytes=bad)


def test_hit_is_bitwise_and_counted():
    cache, lin = ExactProjectionCache(), _linear()
    first = _project(cache, lin, _cond())
    second = _project(cache, lin, _cond())  # a new tensor with the same content
    assert torch.equal(first, second) and second.data_ptr() == first.data_ptr()
    assert (cache.hits, cache.misses) == (1, 1)


def test_a_hit_is_keyed_on_the_fp32_precision_set_either_way():
    """PyTorch's ``fp32_precision`` API (2.9+): once a user sets it, the legacy getters raise; the cache reads
    the new one and keys on it, as on the legacy switches."""
    matmul = torch.backends.cuda.matmul
    if not hasattr(matmul, "fp32_precision"):
        pytest.skip("this PyTorch has no fp32_precision API")
    cache, lin = ExactProjectionCache(), _linear()
    first = _project(cache, lin, _cond())
    before = matmul.fp32_precision
    matmul.fp32_precision = "tf32"
    try:
        assert torch.equal(_project(cache, lin, _cond()), first)
        assert (cache.hits, cache.misses) == (0, 2)  # computed under the other setting
    finally:
        matmul.fp32_precision = before
    for _ in range(2):  # the entry now holds the other setting's output: computed again, then reused
        assert torch.equal(_project(cache, lin, _cond()), first)
    assert (cache.hits, cache.misses) == (1, 3)


def test_disabled_cache_computes_every_time():
    cache, lin = ExactProjectionCache(max_bytes=0), _linear()
    calls = []
    for _ in range(3):
        cond = _cond()
        cache.prepare(cond)
        cache.project("m", lin, cond, lambda c=cond: calls.append(1) or lin(c))
    assert len(calls) == 3 and cache.stats()["entries"] == 0 and cache.hits == 0


def test_different_content_misses():
    cache, lin = ExactProjectionCache(), _linear()
    _project(cache, lin, _cond())
    changed = _cond()
    changed[1, 3] = torch.nextafter(changed[1, 3], torch.tensor(10.0))  # one ulp
    assert torch.equal(_project(cache, lin, changed), lin(F.silu(changed)))
    assert cache.hits == 0


def test_signed_zero_is_a_different_input():
    cache, lin = ExactProjectionCache(), _linear()
    _project(cache, lin, torch.zeros(2, 8))
    _project(cache, lin, -torch.zeros(2, 8))
    assert cache.hits == 0


def test_projection_name_is_part_of_the_key():
    cache, lin, other = ExactProjectionCache(), _linear(0), _linear(1)
    cond = _cond()
    cache.prepare(cond)
    cache.project("a", lin, cond, lambda: lin(cond))
    got = cache.project("b", other, cond, lambda: other(cond))
    assert torch.equal(got, other(cond)) and cache.hits == 0


@pytest.mark.parametrize(
    "edit",
    [
        lambda lin: lin.weight.add_(1e-3),  # in-place edit
        lambda lin: setattr(lin.weight, "data", lin.weight.data.clone() * 2),  # storage swap
        lambda lin: lin.double(),  # dtype change
        lambda lin: lin.bias.zero_(),
        lambda lin: _fused_step(lin),  # a fused optimizer's kernel moves no version counter
    ],
)
def test_weight_changes_invalidate(edit):
    cache, lin = ExactProjectionCache(), _linear()
    _project(cache, lin, _cond())
    edit(lin)
    cond = _cond().to(lin.weight.dtype)
    got = _project(cache, lin, cond)
    assert torch.equal(got, lin(F.silu(cond)))
    assert cache.hits == 0


@pytest.mark.parametrize(
    "move",
    [
        lambda lin: lin.to("cpu"),  # model offload's hook, once the model is on its execution device
        lambda lin: lin.to(torch.float32),
        lambda lin: setattr(lin.weight, "data", lin.weight),
    ],
)
def test_a_move_to_where_the_weights_are_keeps_the_entries(move):
    """``module.to`` a device and dtype it has sets each parameter's ``.data`` to itself: no write."""
    cache, lin = ExactProjectionCache(), _linear()
    expected = _project(cache, lin, _cond())
    move(lin)
    assert torch.equal(_project(cache, lin, _cond()), expected) and cache.hits == 1


def test_an_alias_read_before_and_set_back_after_an_edit_invalidates():
    """Only the parameter itself set as its ``.data`` is no write: an alias of the same memory, read before
    the output was stored, may have been written since."""
    cache, lin = ExactProjectionCache(), _linear()
    alias = lin.weight.data
    _project(cache, lin, _cond())
    alias.mul_(2)
    lin.weight.data = alias
    assert torch.equal(_project(cache, lin, _cond()), lin(F.silu(_cond()))) and cache.hits == 0


def _fused_step(module: torch.nn.Module) -> None:
    for param in module.parameters():
        param.grad = torch.ones_like(param)
    torch.optim.SGD(module.parameters(), lr=0.1, fused=True).step()


def test_watched_parameters_take_the_optimizer_path_plain_ones_take(monkeypatch):
    """A parameter the cache depends on picks the same optimizer implementation as a plain one: the
    multi-tensor one where its device has kernels (patched to include the CPU here), not the per-tensor loop."""
    optimizer = importlib.import_module("torch.optim.optimizer")
    monkeypatch.setattr(optimizer, "_get_foreach_kernels_supported_devices", lambda: ["cpu"])
    cache, lin = ExactProjectionCache(), _linear()
    plain = optimizer._default_to_fused_or_foreach(list(lin.parameters()), False)
    _project(cache, lin, _cond())
    assert type(lin.weight) is not torch.nn.Parameter  # watched
    assert optimizer._default_to_fused_or_foreach(list(lin.parameters()), False) == plain == (False, True)


def test_buffer_changes_invalidate():
    cache = ExactProjectionCache()
    norm = torch.nn.BatchNorm1d(8).eval()
    cond = _cond()
    cache.prepare(cond)
    cache.project("n", norm, cond, lambda: norm(cond))
    norm.running_mean.add_(1.0)
    cond = _cond()
    cache.prepare(cond)
    assert torch.equal(cache.project("n", norm, cond, lambda: norm(cond)), norm(cond)) and cache.hits == 0


def test_autocast_entered_after_prepare_is_not_served_the_fp32_result():
    cache, lin = ExactProjectionCache(), _linear()
    _project(cache, lin, _cond())
    cond = _cond()
    cache.prepare(cond)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = cache.project("mod", lin, cond, lambda: lin(F.silu(cond)))
        assert got.dtype == torch.bfloat16
    assert cache.hits == 0


def test_matmul_precision_is_part_of_the_key():
    cache, lin = ExactProjectionCache(), _linear()
    _project(cache, lin, _cond())
    previous = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("medium" if previous != "medium" else "high")
        _project(cache, lin, _cond())
    finally:
        torch.set_float32_matmul_precision(previous)
    assert cache.hits == 0 and cache.misses == 2


def test_grad_mode_runs_the_original():
    cache, lin = ExactProjectionCache(), _linear()
    _project(cache, lin, _cond())
    with torch.enable_grad():
        out = _project(cache, lin, _cond())
        assert out.requires_grad
    assert cache.hits == 0 and cache.bypasses == 1


@pytest.mark.parametrize("where", ["module_pre", "module_post", "child", "global_pre", "global_post"])
def test_hooks_run_the_original(where):
    cache = ExactProjectionCache()
    seq = torch.nn.Sequential(_linear())
    _project(cache, seq, _cond())
    seen = []
    hook = lambda *args: seen.append(1)  # noqa: E731
    handle = {
        "module_pre": lambda: seq.register_forward_pre_hook(hook),
        "module_post": lambda: seq.register_forward_hook(hook),
        "child": lambda: seq[0].register_forward_hook(hook),
        "global_pre": lambda: torch.nn.modules.module.register_module_forward_pre_hook(hook),
        "global_post": lambda: torch.nn.modules.module.register_module_forward_hook(hook),
    }[where]()
    try:
        _project(cache, seq, _cond())
    finally:
        handle.remove()
    assert seen and cache.hits == 0


def test_bypasses_and_dropped_outputs_are_counted_by_reason():
    """``describe`` says why the cache reused nothing (under offload: hooks, or weights loaded anew)."""
    cache, lin = ExactProjectionCache(), _linear()
    _project(cache, lin, _cond())
    with torch.enable_grad():
        _project(cache, lin, _cond())
    handle = lin.register_forward_pre_hook(lambda *args: None)
    _project(cache, lin, _cond())
    handle.remove()
    lin.weight.data = lin.weight.data.clone()  # what an offload hook's load does
    _project(cache, lin, _cond())
    assert cache.bypass_reasons == {GRADIENTS: 1, HOOKED: 1} and cache.stale == {WEIGHTS_CHANGED: 1}
    assert cache.stats()["stale"] == 1 and cache.hits == 0


def test_inference_mode_weights_run_the_original():
    cache = ExactProjectionCache()
    with torch.inference_mode():
        lin = _linear()
    for _ in range(2):
        cond = _cond()
        cache.prepare(cond)
        cache.project("m", lin, cond, lambda c=cond: lin(c))
    assert cache.hits == 0 and cache.bypasses == 2


def test_compiling_runs_the_original(monkeypatch):
    cache, lin = ExactProjectionCache(), _linear()
    _project(cache, lin, _cond())
    monkeypatch.setattr(torch.compiler, "is_dynamo_compiling", lambda: True)
    _project(cache, lin, _cond())
    assert cache.hits == 0


def test_input_mutated_after_prepare_runs_the_original():
    cache, lin = ExactProjectionCache(), _linear()
    _project(cache, lin, _cond())
    cond = _cond()
    cache.prepare(cond)
    cond.mul_(2)
    assert torch.equal(cache.project("mod", lin, cond, lambda: lin(F.silu(cond))), lin(F.silu(cond)))
    assert cache.hits == 0


def test_caller_mutating_a_returned_tensor_cannot_corrupt_the_cache():
    cache, lin = ExactProjectionCache(), _linear()
    expected = lin(F.silu(_cond()))
    _project(cache, lin, _cond()).mul_(0)  # mutate the miss result
    got = _project(cache, lin, _cond())
    assert torch.equal(got, expected)
    got.chunk(2, dim=-1)[0].add_(5)  # mutate a hit result through a view
    assert torch.equal(_project(cache, lin, _cond()), expected)


def test_byte_budget_is_never_exceeded_and_cyclic_schedules_keep_hitting():
    lin = _linear(o=32)
    steps = [_cond(v) for v in torch.linspace(0.1, 1, 10).tolist()]
    per_step = 2 * 8 * 4 + 2 * 32 * 4  # stored conditioning + output
    cache = ExactProjectionCache(max_bytes=4 * per_step + 10)  # room for 4 of 10 steps
    for _request in range(3):
        for cond in steps:
            _project(cache, lin, cond.clone())
            assert cache.bytes_used <= cache.max_bytes
    # A frozen set keeps the first 4 steps: 4 hits per request after the first. LRU would give 0.
    assert cache.hits == 8


def test_outputs_of_weights_gone_for_good_leave_their_room_to_the_new_ones():
    """A dtype move (or a ``load_state_dict``) also changes the conditioning, computed from the weights: the
    old entries are never seen again. They are dropped at the next miss, with their conditioning, so the
    new weights' outputs fit the budget they took (kept, the cache never hit again)."""
    lin = _linear(o=32)
    cache = ExactProjectionCache(max_bytes=2 * 8 * 8 + 2 * 32 * 8)  # one float64 conditioning and output
    _project(cache, lin, _cond())
    lin.double()
    for _ in range(2):  # the first call frees the room and stores, the second hits
        _project(cache, lin, _cond(2.0).double())
    assert cache.hits == 1 and cache.stale[WEIGHTS_CHANGED] == 1
    assert cache.bytes_used == 2 * 8 * 8 + 2 * 32 * 8
    replaced = lin.weight
    lin.weight = torch.nn.Parameter(replaced.detach() * 2)
    _project(cache, lin, _cond(3.0).double())  # a miss under a weight that may come back: nothing dropped
    lin.weight = replaced  # the very tensor again, alive and unwritten
    _project(cache, lin, _cond(2.0).double())
    assert cache.hits == 2


def test_clear_forgets_everything():
    cache, lin = ExactProjectionCache(), _linear()
    _project(cache, lin, _cond())
    cache.clear()
    assert cache.bytes_used == 0
    _project(cache, lin, _cond())
    assert cache.hits == 0


def test_precomputed_lookup_is_consulted_only_on_a_runtime_miss():
    lin = _linear()
    asked = []

    class Precomputed(ExactProjectionCache):
        def _lookup_precomputed(self, name, module, conditioning):
            asked.append(name)
            return module(F.silu(conditioning))

    cache = Precomputed()
    _project(cache, lin, _cond())
    _project(cache, lin, _cond())
    assert asked == ["mod"] and cache.hits == 1


def test_two_conditionings_in_one_forward():
    cache, lin = ExactProjectionCache(), _linear()
    a, b = _cond(1.0), _cond(2.0)
    cache.prepare(a)
    cache.prepare(b)
    assert torch.equal(cache.project("m", lin, a, lambda: lin(a)), lin(a))
    assert torch.equal(cache.project("m", lin, b, lambda: lin(b)), lin(b))
    assert cache.hits == 0 and cache.misses == 2


def test_a_weight_is_the_same_only_while_it_lives():
    """The stored state names each weight by a weak reference, not its id: a freed weight's id and address
    may come back as a new tensor's with other values, which must not match the entries stored for it."""
    from omni_accel.cache.projection import _module_state

    linear = torch.nn.Linear(4, 4)
    stored = _module_state(linear)
    assert _module_state(linear) == stored
    weight = linear.weight
    linear.weight = torch.nn.Parameter(torch.randn(4, 4))
    assert _module_state(linear) != stored
    linear.weight = weight  # the very tensor again: the entry holds
    assert _module_state(linear) == stored
    del weight, linear
    freed = stored[0][0]
    assert freed != freed  # a freed weight equals nothing, whatever tensor comes to hold its id


def test_another_threads_forward_leaves_this_forwards_conditioning_compared():
    """Two threads' forwards at once (a web server calling one pipeline, or pipelines sharing the transformer):
    the other's ``begin_forward`` dropped this forward's compared conditioning, so its next projections ran
    without the cache, counted under a reason naming inference mode or a write, neither of which happened."""
    cache, lin = ExactProjectionCache(), _linear()
    stored = _project(cache, lin, _cond())
    cond = _cond()
    cache.begin_forward()
    cache.ensure_prepared(cond)
    other = threading.Thread(target=cache.begin_forward)  # the other thread's forward starts
    other.start()
    other.join()
    got = cache.project("mod", lin, cond, lambda: lin(F.silu(cond)))
    assert got.data_ptr() == stored.data_ptr() and (cache.hits, cache.bypasses) == (1, 0)
