"""The test contract every native model passes. A model's test file subclasses ``NativeContract``, says how
to build its Diffusers module with random weights and its inputs, and inherits every check:

* parity with Diffusers' own forward on the same weights (fp32, CPU, <= 1e-5), with no block falling back;
* every weight of the native blocks matters, and still matches Diffusers after it changes in place;
* the module's state_dict (names, tensors) is unchanged by accelerate and by restore, and it loads back
  strictly;
* the exact projection cache on gives bitwise the output with it off, and hits on repeated conditioning;
* one compiled graph per native block class;
* every parallel layout (tp, ulysses, ring, cfg; gloo ranks) against one rank, replicas bitwise equal.
"""

from __future__ import annotations

import copy
from typing import Any, ClassVar

import pytest
import torch
import torch.distributed as dist
from conftest import rel_err
from diffusers import DiffusionPipeline
from multirank import run_multirank
from torch import nn

import omni_accel
from omni_accel import ParallelConfig
from omni_accel.models.registry import spec_for
from omni_accel.parallel import Colwise


class _Holder(DiffusionPipeline):
    """The smallest pipeline around a transformer, so the public accelerate() can take a bare module."""

    def __init__(self, transformer: nn.Module) -> None:
        super().__init__()
        self.register_modules(transformer=transformer)


def _block_lists(module: nn.Module) -> list[str]:
    return list(spec_for(module).native_model().blocks)


def _run(module: nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
    """The output sample (one per sample stacked, for a model that returns a list of them: Z-Image's)."""
    with torch.no_grad():
        out = module(**copy.copy(inputs), return_dict=False)[0]
    return torch.stack(out) if isinstance(out, list | tuple) else out


class NativeContract:
    """``cases``: (module config overrides, input shape arguments) pairs the parity test runs; the first is
    the one the other checks use. ``layouts``: the parallel layouts checked on two ranks, each with the
    overrides that make it apply (e.g. a head count tp divides) and the input shapes (None: the first
    case's)."""

    cases: ClassVar[list[tuple[dict, dict]]]
    layouts: ClassVar[list[tuple[ParallelConfig, dict, dict | None]]] = []

    @staticmethod
    def make_module(seed: int = 0, **overrides: Any) -> nn.Module:
        raise NotImplementedError

    @staticmethod
    def make_inputs(module: nn.Module, **shapes: Any) -> dict[str, Any]:
        raise NotImplementedError

    @classmethod
    def accelerated(cls, seed: int = 0, overrides: dict | None = None, **config: Any) -> nn.Module:
        module = cls.make_module(seed, **(overrides or {}))
        holder = omni_accel.accelerate(_Holder(module), **config)
        module._test_holder = holder  # keeps describe()/restore() reachable
        return module

    @staticmethod
    def runtime(module: nn.Module):
        return omni_accel.describe(module._test_holder).components[0].runtime

    def test_parity_with_diffusers(self):
        for overrides, shapes in self.cases:
            plain = self.make_module(0, **overrides)
            fast = self.accelerated(0, overrides)
            inputs = self.make_inputs(plain, **shapes)
            expected, got = _run(plain, inputs), _run(fast, inputs)
            assert got.shape == expected.shape
            assert rel_err(got, expected) <= 1e-5, f"{overrides} {shapes}"
            assert not self.runtime(fast).fallbacks, f"{overrides}: {dict(self.runtime(fast).fallbacks)}"

    def test_every_weight_matters_and_edits_are_seen(self):
        overrides, shapes = self.cases[0]
        plain = self.make_module(0, **overrides)
        fast = self.accelerated(0, overrides)
        inputs = self.make_inputs(plain, **shapes)
        base = _run(fast, inputs)
        blocks = _block_lists(fast)
        fast_params = dict(fast.named_parameters())
        with torch.no_grad():
            for name, param in plain.named_parameters():
                if not name.startswith(tuple(blocks)):
                    continue
                param.add_(0.5)
                fast_params[name].add_(0.5)
                got = _run(fast, inputs)
                assert not torch.equal(got, base), f"{name} does not influence the output"
                assert rel_err(got, _run(plain, inputs)) <= 1e-5, f"an edit of {name} is not seen"
                param.sub_(0.5)
                fast_params[name].sub_(0.5)

    def test_state_dict_is_unchanged_and_loads_strictly(self):
        overrides, shapes = self.cases[0]
        expected = self.make_module(0, **overrides).state_dict()
        fast = self.accelerated(0, overrides)
        for state in (fast.state_dict(), None):
            if state is None:
                omni_accel.restore(fast._test_holder)
                state = fast.state_dict()
            assert list(state) == list(expected)
            assert all(torch.equal(state[k], expected[k]) for k in expected)
        fast = self.accelerated(1, overrides)
        fast.load_state_dict(expected, strict=True)
        inputs = self.make_inputs(fast, **shapes)
        assert rel_err(_run(fast, inputs), _run(self.make_module(0, **overrides), inputs)) <= 1e-5

    def test_projection_cache_on_is_bitwise_off(self):
        overrides, shapes = self.cases[0]
        on = self.accelerated(0, overrides)
        off = self.accelerated(0, overrides, projection_cache_bytes=0)
        inputs = self.make_inputs(on, **shapes)
        for _ in range(2):
            assert torch.equal(_run(on, inputs), _run(off, inputs))
        model = spec_for(on).native_model()
        cache = self.runtime(on).cache
        assert (cache is not None and cache.hits > 0) if model.projection_cache else cache is None

    def test_one_compiled_graph_per_block_class(self):
        overrides, shapes = self.cases[0]
        torch._dynamo.reset()
        counters = torch._dynamo.utils.counters
        counters.clear()
        fast = self.accelerated(0, overrides, compile={"backend": "aot_eager"}, compile_in_background=False)
        inputs = self.make_inputs(fast, **shapes)
        expected = _run(self.make_module(0, **overrides), inputs)
        assert rel_err(_run(fast, inputs), expected) <= 1e-5
        assert counters["stats"]["unique_graphs"] == len(_block_lists(fast))

    def test_modulations_are_column_split_linears(self):
        """What ``SplitModulation`` computes for a block: linears it reads, split by outputs under tp."""
        model = spec_for(self.make_module(0, **self.cases[0][0])).native_model()
        for block in model.blocks.values():
            for name in block.modulations:
                assert isinstance(block.tp_plan.get(block.linears.get(name)), Colwise), (block, name)

    @pytest.mark.multirank
    def test_parallel_layouts_match_one_rank(self):
        if not self.layouts:
            pytest.skip("this model declares no parallel layouts")
        run_multirank(_layouts_body, 2, type(self), timeout=400)


def _layouts_body(rank: int, world: int, contract: type[NativeContract]) -> None:
    torch.set_num_threads(1)
    for layout, overrides, shapes in contract.layouts:
        shapes = shapes or contract.cases[0][1]
        oracle_module = contract.make_module(0, **overrides)
        inputs = contract.make_inputs(oracle_module, **shapes)
        expected = _run(oracle_module, inputs)
        got = _run(contract.accelerated(0, overrides, parallel=layout), inputs)
        assert rel_err(got, expected) <= 1e-5, f"{layout}: {rel_err(got, expected):.2e} against one rank"
        replicas = [torch.empty_like(got) for _ in range(world)]
        dist.all_gather(replicas, got)
        assert all(torch.equal(r, replicas[0]) for r in replicas), f"{layout}: ranks disagree"
