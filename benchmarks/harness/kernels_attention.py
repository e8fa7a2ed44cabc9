"""Attention kernels at our models' shapes: provider against provider, a key-padding mask served with and
without the mask, and attention beside an independent GEMM on a second stream."""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from omni_accel.attention import AttentionRequest, get_provider

from .kernels_run import Commands, Run, option
from .timing import interleaved, median_ms, timed

# (batch, query tokens, heads, head size, key tokens, log-sum-exp returned): one GPU, one rank's share of
# the heads under ulysses=2 and one of its two head stages, and a ring=2 rank's kernels: over one block of
# keys with the LSE (the local block first, then the peer's, merged) or over all keys at once.
SHAPES = {
    "flux_1024": (1, 4608, 24, 128, 4608, False),
    "flux_1024_ulysses2": (1, 4608, 12, 128, 4608, False),
    "flux_1024_ulysses2_stage": (1, 4608, 6, 128, 4608, False),  # one of Ulysses' two head stages
    "flux_1024_ring2_block": (1, 2304, 24, 128, 2304, True),
    "flux_1024_ring2_whole": (1, 2304, 24, 128, 4608, False),
    "wan14b_480p_81f": (1, 32760, 40, 128, 32760, False),
    "wan14b_480p_81f_ulysses2": (1, 32760, 20, 128, 32760, False),
    "wan14b_480p_81f_ulysses2_stage": (1, 32760, 10, 128, 32760, False),
    "wan14b_480p_81f_ring2_block": (1, 16380, 40, 128, 16380, True),
    "wan14b_480p_81f_ring2_whole": (1, 16380, 40, 128, 32760, False),
    # the generic tier's models (harness.models' shapes): joint image + text self-attention
    "sd35_large_1024": (1, 4429, 38, 64, 4429, False),
    "zimage_1024": (1, 4352, 30, 128, 4352, False),
    "flux2_1024": (1, 4608, 48, 128, 4608, False),
    "qwenimage_1024": (1, 4352, 24, 128, 4352, False),
    "ltx2_768x512_121f_video": (1, 6144, 32, 128, 6144, False),
    "hunyuanvideo15_480p_81f": (1, 35375, 16, 128, 35375, False),
}
TINY_SHAPES = {
    "tiny": (1, 64, 4, 128, 64, False),
    "tiny_ring2_block": (1, 32, 4, 128, 32, True),
    "tiny_ring2_whole": (1, 32, 4, 128, 64, False),
}
PROVIDERS = ("sdpa_cudnn", "sdpa_flash", "sdpa", "flashinfer")


def attention_shapes(run: Run, args: argparse.Namespace) -> None:
    """Attention providers at the shapes our models run: which is fastest where.

    Every lossless provider that can serve the shape (PyTorch's cuDNN and flash kernels, PyTorch's own
    dispatch, FlashInfer when installed) on the same inputs: median ms of warm calls (CUDA events), TFLOP/s,
    the first call's time (FlashInfer JIT-compiles its kernel there: a cold start), and the largest
    difference from the first provider's output (cuDNN's on a GPU)."""
    shapes = {**SHAPES, **TINY_SHAPES}
    for shape_name in args.shapes or (TINY_SHAPES if run.tiny else SHAPES):
        batch, tokens, heads, head_dim, kv_tokens, lse = shapes[shape_name]
        g = run.generator()
        q, k, v = (run.randn(batch, n, heads, head_dim, generator=g) for n in (tokens, kv_tokens, kv_tokens))
        flops = 4 * batch * heads * tokens * kv_tokens * head_dim
        reference, reference_name, rows = None, "", {}
        for name in PROVIDERS:
            provider = get_provider(name)
            reasons = provider.reasons_against(AttentionRequest.for_call(q, k))
            if reasons:
                rows[name] = {"unavailable": "; ".join(reasons)}
                run.skip(name, rows[name]["unavailable"])
                continue
            if lse and not provider.capabilities.returns_lse:
                rows[name] = {"unavailable": "does not return the log-sum-exp"}
                continue

            def call(provider=provider, q=q, k=k, v=v, lse=lse):
                out = provider.forward(q, k, v, return_lse=lse)
                return out[0] if lse else out

            out, first_ms = timed(call, run.device)
            if reference is None:
                reference, reference_name = out, name.removeprefix("sdpa_")
            median = statistics.median(timed(call, run.device)[1] for _ in range(args.calls))
            diff = (out.float() - reference.float()).abs().max().item()
            rows[name] = {
                "median_ms": median,
                "tflops": flops / median / 1e9,
                "first_call_ms": first_ms,
                f"max_abs_diff_vs_{reference_name}": diff,
            }
            print(f"{shape_name:26s} {name:12s} {median:8.2f} ms {flops / median / 1e9:6.0f} TFLOP/s "
                  f"first {first_ms / 1000:6.1f} s  diff {diff:.2e}", flush=True)  # fmt: skip
        run.results[shape_name] = rows


BACKENDS = {
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "flash": SDPBackend.FLASH_ATTENTION,
}
_CPU_BACKENDS = {"flash"}  # PyTorch's CPU SDPA has its flash and math kernels only


def _pinned(backend, q, k, v, mask):
    with sdpa_kernel([backend]):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _valid_keys_first(k, v, mask):
    """K and V (BHSD) with the valid keys first, by a stable device-side sort, and their count (int32, on
    the device): what the variable-length calls below take without a host sync."""
    order = torch.argsort((~mask).to(torch.int8), stable=True)
    return k.index_select(2, order), v.index_select(2, order), mask.sum().to(torch.int32).reshape(1)


def _thd(*bhsd):
    """[tokens, heads, head size] views of a batch of one."""
    return [t[0].transpose(0, 1) for t in bhsd]


def _flash_varlen(q, k, v, mask):
    """FlashAttention over the first ``seqused_k`` keys."""
    k, v, valid = _valid_keys_first(k, v, mask)
    thd = _thd(q, k, v)
    cu_q = torch.tensor([0, thd[0].shape[0]], device=q.device, dtype=torch.int32)
    cu_k = torch.tensor([0, thd[1].shape[0]], device=q.device, dtype=torch.int32)
    out = torch.ops.aten._flash_attention_forward(
        *thd, cu_q, cu_k, thd[0].shape[0], thd[1].shape[0], 0.0, False, False, seqused_k=valid
    )[0]
    return out.transpose(0, 1).unsqueeze(0)


def _cudnn_varlen(q, k, v, mask, contiguous=False):
    """PyTorch's ragged cuDNN call, told how many keys are valid by ``cum_seq_k``."""
    k, v, valid = _valid_keys_first(k, v, mask)
    thd = _thd(q, k, v)
    thd = [t.contiguous() for t in thd] if contiguous else thd
    cu_q = torch.tensor([0, thd[0].shape[0]], device=q.device, dtype=torch.int32)
    cu_k = torch.cat([valid.new_zeros(1), valid])
    out = torch.ops.aten._cudnn_attention_forward(
        *thd, None, cu_q, cu_k, thd[0].shape[0], thd[1].shape[0], False, 0.0, False, False
    )[0]
    return out.transpose(0, 1).unsqueeze(0)


def masked_attention(run: Run, args: argparse.Namespace) -> None:
    """A key-padding mask at Qwen-Image's attention shape: served with the dense mask or without one.

    Qwen-Image's padded text joined with the image tokens: the kernel PyTorch's SDPA dispatch runs with
    the dense mask (what plain Diffusers gets), each SDPA kernel pinned with the mask, and the ways to serve
    the mask without one (the padded keys dropped, then an unmasked kernel; FlashAttention's variable-length
    call and cuDNN's ragged call with the valid key count on the device, no host sync). Median ms of warm
    calls and the largest difference from a float32 reference; which pinned kernel the dispatch ran."""
    tokens = args.text + args.image
    g = run.generator()
    q, k, v = (run.randn(1, args.heads, tokens, 128, generator=g) for _ in range(3))
    mask = torch.ones(tokens, dtype=torch.bool, device=run.device)
    mask[args.text - args.padded : args.text] = False
    dense = mask[None, None, None, :]
    keep = mask.nonzero().flatten()
    reference = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=dense)
    cudnn = BACKENDS["cudnn"]
    variants = {  # name: (call, whether it needs CUDA)
        "dispatch, dense mask (plain Diffusers)": (
            lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=dense),
            False,
        ),
        **{
            f"{name}, dense mask": ((lambda b=b: _pinned(b, q, k, v, dense)), name not in _CPU_BACKENDS)
            for name, b in BACKENDS.items()
        },
        "cudnn, padded keys dropped (index known)": (
            lambda: _pinned(cudnn, q, k.index_select(2, keep), v.index_select(2, keep), None),
            True,
        ),
        "cudnn, no mask, all keys (speed bound)": (lambda: _pinned(cudnn, q, k, v, None), True),
        "flash varlen, valid keys first (no sync)": (lambda: _flash_varlen(q, k, v, mask), True),
        "cudnn varlen, valid keys first (no sync)": (lambda: _cudnn_varlen(q, k, v, mask), True),
        "cudnn varlen, contiguous inputs": (lambda: _cudnn_varlen(q, k, v, mask, contiguous=True), True),
    }
    run.results["args"] = {
        name: getattr(args, name) for name in ("text", "padded", "image", "heads", "calls")
    }
    outputs = {}
    for name, (fn, needs_cuda) in variants.items():
        if needs_cuda and not run.cuda:
            run.skip(name, "needs a CUDA kernel")
            continue
        try:
            outputs[name] = out = fn()
        except Exception as exc:  # a kernel that refuses: recorded, the others still run
            run.results[name] = {"error": str(exc).splitlines()[0][:200]}
        else:
            error = (out.float() - reference).abs().max().item()
            ms = median_ms(fn, run.device, warmup=3, runs=args.calls)["median_ms"]
            run.results[name] = {"ms": ms, "max_err_vs_fp32": error}
        print(name, run.results[name], flush=True)
    dispatched = outputs[next(iter(variants))]
    run.results["dispatch runs"] = [
        name for name in list(outputs)[1:] if "dense" in name and torch.equal(outputs[name], dispatched)
    ]
    print("dispatch bitwise equal to:", run.results["dispatch runs"])


# name: (query tokens, key tokens, heads, GEMM rows, GEMM output columns, GEMM input features), FLUX.1-dev
# at 1024x1024
BESIDE_SHAPES = {
    "one_gpu": (4608, 4608, 24, 4608, 12288, 3072),
    "ring2_rank": (2304, 4608, 24, 2304, 12288, 3072),
    "tp2_rank": (4608, 4608, 12, 4608, 6144, 3072),
    "ulysses2_rank": (4608, 4608, 12, 2304, 12288, 3072),  # both head stages' heads in one kernel
}
TINY_BESIDE_SHAPES = {"tiny_one_gpu": (64, 64, 4, 64, 256, 64), "tiny_ring2_rank": (32, 64, 4, 32, 256, 64)}


def _beside_variants(run: Run, shape: tuple[int, ...], provider: str) -> dict[str, Callable[[], object]]:
    q_len, kv_len, heads, rows, cols, features = shape
    g = run.generator()
    q, k, v = (run.randn(1, n, heads, 128, generator=g) for n in (q_len, kv_len, kv_len))
    x, w = run.randn(rows, features, generator=g), run.randn(cols, features, generator=g) / 64
    attend = get_provider(provider)

    def attention():
        attend.forward(q, k, v)

    def gemm():
        torch.mm(x, w.t())

    variants = {"attention": attention, "gemm": gemm, "one_after_the_other": lambda: (attention(), gemm())}
    if not run.cuda:
        run.skip("attention and GEMM at once on two streams, saved_us", "needs CUDA streams")
        return variants
    side = torch.cuda.Stream()

    def both_at_once(gemm_first: bool):
        def both():
            side.wait_stream(torch.cuda.current_stream())
            if gemm_first:
                with torch.cuda.stream(side):
                    gemm()
                attention()
            else:
                attention()
                with torch.cuda.stream(side):
                    gemm()
            torch.cuda.current_stream().wait_stream(side)

        return both

    variants["at_once_attention_launched_first"] = both_at_once(False)
    variants["at_once_gemm_launched_first"] = both_at_once(True)
    return variants


def attention_beside_gemm(run: Run, args: argparse.Namespace) -> None:
    """Attention and an independent GEMM one after the other or on two streams at once (FLUX's single block).

    At the shapes a FLUX single block runs per GPU (one GPU; a ring=2, tp=2 or Ulysses-2 rank): does the
    GEMM fill the SMs the attention kernel's last wave leaves idle? A rank's attention at two ranks is 432
    tiles of 128 queries (24 heads x 2304 queries, or 12 x 4608) on 132 SMs: four waves for 3.3 waves of
    work; one GPU's 864 tiles take seven for 6.5. The MLP-input GEMM of the same block does not depend on
    the attention. Each variant is captured as a CUDA graph of ``--calls`` calls and replayed; median ms
    per call of warm replays (CUDA events), interleaved rounds."""
    run.results["provider"] = args.provider
    for name, shape in (TINY_BESIDE_SHAPES if run.tiny else BESIDE_SHAPES).items():
        replays = {
            variant: run.replay(fn, args.calls, "thread_local")
            for variant, fn in _beside_variants(run, shape, args.provider).items()
        }
        stats = interleaved(replays, run.device, args.rounds, calls=3)
        row = run.results[name] = {variant: s["median_ms"] / args.calls for variant, s in stats.items()}
        at_once = [row[v] for v in row if v.startswith("at_once")]
        if at_once:
            row["saved_us"] = 1000 * (row["one_after_the_other"] - min(at_once))
        print(name, {key: round(value, 4) for key, value in row.items()}, flush=True)


LOSSY = ("flashinfer_fp8", "sage")
KEY_LENGTHS = (333, 1024, 2048, 4096, 4608, 8192)


def _fp64_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    q, k, v = (t.transpose(1, 2).double() for t in (q, k, v))
    return torch.softmax(q @ k.transpose(-1, -2) * scale, dim=-1).matmul(v).transpose(1, 2)


def lossy_attention(run: Run, args: argparse.Namespace) -> None:
    """How far the lossy providers are from fp64 attention on the same inputs, by key length.

    Random q/k/v (one sample, 24 heads of 128); per provider and length the cosine similarity and the
    ratio of output norms against fp64 attention, with a flat softmax (scores of std ~1) and a peaked one
    (q three times as large). A norm ratio below one is a kernel whose probabilities sum to less than one.
    ``sdpa`` is the lossless yardstick. Each call goes to the provider's kernel even where its capabilities
    refuse the length (the row says so): this is what such a refusal is measured from."""
    heads, head_dim = (4, 128) if run.tiny else (24, 128)
    for name in ("sdpa", *LOSSY):
        provider = get_provider(name)
        unavailable = provider.reasons_against(AttentionRequest(run.dtype, run.device, head_dim))
        if unavailable:
            run.skip(name, "; ".join(unavailable))
            continue
        rows = {}
        for keys in args.keys:
            g = torch.Generator(run.device).manual_seed(keys)
            q, k, v = (run.randn(1, keys, heads, head_dim, generator=g) for _ in range(3))
            refused = provider.reasons_against(AttentionRequest.for_call(q, k))
            row = {"refused": "; ".join(refused)} if refused else {}
            for softmax, query in (("flat", q), ("peaked", q * 3)):
                out = provider.forward(query, k, v).double()
                reference = _fp64_attention(query, k, v, head_dim**-0.5)
                row[f"{softmax}_cosine"] = F.cosine_similarity(
                    out.flatten(), reference.flatten(), dim=0
                ).item()
                row[f"{softmax}_norm_ratio"] = (out.norm() / reference.norm()).item()
            rows[keys] = row
            print(f"{name:15s} {keys:6d} keys  " + "  ".join(
                f"{key} {value:.4f}" for key, value in row.items() if key != "refused"
            ) + (f"  (refused: {row['refused']})" if "refused" in row else ""), flush=True)  # fmt: skip
        run.results[name] = rows


def plans_per_thread(run: Run, args: argparse.Namespace) -> None:
    """Whether an attention plan one thread built makes another thread's first call cheap.

    cuDNN builds a plan per shape at its first call (tens of ms). If plans were shared, a background thread
    could build them beside a compile and spare the first image that time. Per shape (each new to the
    process) the first and second call on the thread that builds it, and the first call of the same shape on
    the other thread: the main thread after a background thread built it, and a fresh thread after the main
    thread built it. Equal first calls mean plans are kept per thread."""
    import threading
    import time

    provider_name = "sdpa_cudnn" if run.cuda else "sdpa"
    if not run.cuda:
        run.skip("cuDNN's plans", "needs CUDA (the CPU runs PyTorch's SDPA: no plans to share)")
    provider = get_provider(provider_name)
    heads, head_dim = (4, 128) if run.tiny else (24, 128)

    def first_two(tokens: int) -> tuple[float, float]:
        q = run.randn(1, tokens, heads, head_dim, generator=run.generator())
        times = []
        for _ in range(2):
            run.synchronize()
            start = time.perf_counter()
            provider.forward(q, q, q)
            run.synchronize()
            times.append((time.perf_counter() - start) * 1e3)
        return times[0], times[1]

    def on_a_thread(tokens: int) -> tuple[float, float]:
        result: list[tuple[float, float]] = []
        thread = threading.Thread(target=lambda: result.append(first_two(tokens)))
        thread.start()
        thread.join()
        return result[0]

    first_two(32 if run.tiny else 1024)  # the process's own set-up (library load), not a plan
    for tokens in args.tokens:
        built_on_thread, main_after = on_a_thread(tokens), first_two(tokens)
        built_on_main = first_two(tokens + 64)
        thread_after = on_a_thread(tokens + 64)
        row = {
            "background thread builds: first, second ms": built_on_thread,
            "then the main thread: first, second ms": main_after,
            "main thread builds: first, second ms": built_on_main,
            "then a fresh thread: first, second ms": thread_after,
        }
        run.results[f"{tokens} tokens"] = row
        print(f"{provider_name} {tokens} tokens: " + "; ".join(
            f"{key} {a:.2f} / {b:.2f}" for key, (a, b) in row.items()
        ), flush=True)  # fmt: skip


def register(commands: Commands) -> None:
    parser = commands.add("attention-shapes", attention_shapes)
    parser.add_argument(
        "--shapes",
        nargs="+",
        choices=[*SHAPES, *TINY_SHAPES],
        help="default: all (the tiny ones with --tiny)",
    )
    option(parser, "--calls", 10, 2, "timed calls per provider")

    parser = commands.add("masked-attention", masked_attention)
    option(parser, "--text", 512, 16, "text tokens, padding included")
    option(parser, "--padded", 212, 6, "padded text tokens")
    option(parser, "--image", 4096, 48, "image tokens")
    option(parser, "--heads", 24, 2, "attention heads")
    option(parser, "--calls", 20, 2, "timed calls per variant")

    parser = commands.add("attention-beside-gemm", attention_beside_gemm)
    option(parser, "--calls", 20, 2, "calls per captured graph")
    option(parser, "--rounds", 5, 1, "interleaved rounds")
    option(parser, "--provider", "sdpa_cudnn", "sdpa", "attention provider", type=str)

    parser = commands.add("attention-plans-per-thread", plans_per_thread)
    option(
        parser, "--tokens", [4096, 4608], [48, 96], "tokens per shape (each new to the process)", nargs="+"
    )

    parser = commands.add("lossy-attention", lossy_attention)
    option(parser, "--keys", list(KEY_LENGTHS), [64, 333], "key lengths", nargs="+")
