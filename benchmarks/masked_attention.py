"""A key-padding mask (Qwen-Image's padded text, joined with the image tokens) at the model's attention
shape: the kernel PyTorch's SDPA dispatch runs with the dense mask (what plain Diffusers gets), each SDPA
kernel pinned with the mask, and the ways to serve the mask without one (the padded keys dropped, then an
unmasked kernel; FlashAttention's variable-length call and cuDNN's ragged and padded calls with the valid
key count on the device, no host sync). Median ms of warm calls and the largest difference from a float32 reference.

    python benchmarks/masked_attention.py --out masked_attention.json
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from timing import median_ms, write_json

BACKENDS = {
    "cudnn": torch.nn.attention.SDPBackend.CUDNN_ATTENTION,
    "efficient": torch.nn.attention.SDPBackend.EFFICIENT_ATTENTION,
    "flash": torch.nn.attention.SDPBackend.FLASH_ATTENTION,
}


def _ms(fn, calls: int) -> float:
    return median_ms(fn, "cuda", warmup=3, runs=calls)["median_ms"]


def _pinned(backend, q, k, v, mask):
    with torch.nn.attention.sdpa_kernel([backend]):
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


def _cudnn_padded(q, k, v, mask):
    """nvidia-cudnn-frontend's padded-batch call (``torch.ops.cudnn.sdpa_fwd`` with per-sample
    ``seq_len_kv``). Measured slower than the dense mask (0.98 against 0.74 ms), so the library version of
    it (commit 8515bd7) stays out."""
    import cudnn

    cudnn.sdpa_torch  # noqa: B018  (the lazy export registers the op)
    k, v, valid = _valid_keys_first(k, v, mask)
    queries = torch.full((1,), q.shape[2], device=q.device, dtype=torch.int32)
    scale = q.shape[-1] ** -0.5
    return torch.ops.cudnn.sdpa_fwd(q, k, v, scale, seq_len_q=queries, seq_len_kv=valid, return_lse=False)[0]


@torch.no_grad()
def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--text", type=int, default=512)
    parser.add_argument("--padded", type=int, default=212)
    parser.add_argument("--image", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=24)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    tokens = args.text + args.image
    g = torch.Generator("cuda").manual_seed(0)
    q, k, v = (
        torch.randn(1, args.heads, tokens, 128, device="cuda", dtype=torch.bfloat16, generator=g)
        for _ in range(3)
    )
    mask = torch.ones(tokens, dtype=torch.bool, device="cuda")
    mask[args.text - args.padded : args.text] = False
    dense = mask[None, None, None, :]
    keep = mask.nonzero().flatten()
    reference = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=dense)
    variants = {
        "dispatch, dense mask (plain Diffusers)": lambda: F.scaled_dot_product_attention(
            q, k, v, attn_mask=dense
        ),
        **{f"{name}, dense mask": (lambda b=b: _pinned(b, q, k, v, dense)) for name, b in BACKENDS.items()},
        "cudnn, padded keys dropped (index known)": lambda: _pinned(
            BACKENDS["cudnn"], q, k.index_select(2, keep), v.index_select(2, keep), None
        ),
        "cudnn, no mask, all keys (speed bound)": lambda: _pinned(BACKENDS["cudnn"], q, k, v, None),
        "flash varlen, valid keys first (no sync)": lambda: _flash_varlen(q, k, v, mask),
        "cudnn varlen, valid keys first (no sync)": lambda: _cudnn_varlen(q, k, v, mask),
        "cudnn varlen, contiguous inputs": lambda: _cudnn_varlen(q, k, v, mask, contiguous=True),
        "cudnn-frontend padded call, valid keys first (no sync)": lambda: _cudnn_padded(q, k, v, mask),
    }
    results = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "args": vars(args)}
    outputs = {}
    for name, fn in variants.items():
        try:
            outputs[name] = out = fn()
        except Exception as exc:  # a kernel or package that refuses: recorded, the others still run
            results[name] = {"error": str(exc).splitlines()[0][:200]}
        else:
            error = (out.float() - reference).abs().max().item()
            results[name] = {"ms": _ms(fn, args.calls), "max_err_vs_fp32": error}
        print(name, results[name], flush=True)
    dispatched = outputs[next(iter(variants))]
    results["dispatch runs"] = [
        name for name in list(outputs)[1:] if "dense" in name and torch.equal(outputs[name], dispatched)
    ]
    print("dispatch bitwise equal to:", results["dispatch runs"])
    write_json(results, args.out)
    return results


if __name__ == "__main__":
    main()
