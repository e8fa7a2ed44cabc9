"""``omni-accel doctor``: what this machine can run, before a long job finds out.

Versions against the ranges a test run has shown (setup.cfg), the GPU, every attention provider (usable
here or exactly why not; on a GPU a short self-test against the math kernel at a FLUX-like shape),
distributed backends, and where compile and JIT caches live. A readable table, or ``--json``. The exit
status is non-zero when something asked for with ``--attention`` / ``--compile`` / ``--backend`` cannot
work here.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
from importlib import metadata
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from packaging.requirements import Requirement

from .attention import provider_names
from .attention.base import AttentionRequest
from .attention.registry import get_provider

_DIST = "omni-accel"
_OPTIONAL = ("peft", "sageattention", "flashinfer-python", "triton")


def _requirements() -> dict[str, Requirement]:
    try:
        lines = metadata.requires(_DIST) or []
    except metadata.PackageNotFoundError:  # a plain checkout: nothing installed, nothing to compare
        return {}
    found = {}
    for line in lines:
        req = Requirement(line)
        found.setdefault(req.name, req)
    return found


def packages() -> list[dict[str, Any]]:
    """The install requirements, then the optional packages omni_accel uses when present."""
    requirements = _requirements()
    core = [name for name, req in requirements.items() if req.marker is None]
    names = [*core, *_OPTIONAL]
    rows = []
    for name in dict.fromkeys(names):
        req = requirements.get(name)
        try:
            installed = metadata.version(name)
        except metadata.PackageNotFoundError:
            installed = None
        spec = str(req.specifier) if req is not None else ""
        ok = installed is not None and (req is None or req.specifier.contains(installed, prereleases=True))
        note = "" if ok else ("not installed" if installed is None else f"outside the tested range {spec}")
        rows.append({"name": name, "installed": installed, "tested": spec, "ok": ok, "note": note})
    return rows


def device() -> dict[str, Any]:
    if not torch.cuda.is_available():
        return {"type": "cpu", "name": platform.processor() or platform.machine(), "cuda": None}
    props = torch.cuda.get_device_properties(0)
    return {
        "type": "cuda",
        "name": props.name,
        "capability": f"{props.major}.{props.minor}",
        "memory_gib": round(props.total_memory / 1024**3, 1),
        "count": torch.cuda.device_count(),
        "cuda": torch.version.cuda,
    }


def _request(kind: str) -> AttentionRequest:
    if kind == "cuda":
        cap = torch.cuda.get_device_capability(0)
        return AttentionRequest(torch.bfloat16, "cuda", 128, compute_capability=cap)
    return AttentionRequest(torch.float32, "cpu", 128)


def _self_test(name: str, kind: str) -> float:
    """Max |out - math| / max |math| at a FLUX-like shape (1 x 1024 tokens x 24 heads x 128)."""
    dtype = torch.bfloat16 if kind == "cuda" else torch.float32
    g = torch.Generator(kind).manual_seed(0)
    q, k, v = (torch.randn(1, 1024, 24, 128, generator=g, device=kind, dtype=dtype) for _ in range(3))
    reference = get_provider("sdpa_math").forward(q.float(), k.float(), v.float())
    out = get_provider(name).forward(q, k, v).float()
    return ((out - reference).abs().max() / reference.abs().max()).item()


def providers(self_test: bool) -> list[dict[str, Any]]:
    kind = "cuda" if torch.cuda.is_available() else "cpu"
    request = _request(kind)
    rows = []
    for name in provider_names():
        provider = get_provider(name)
        reasons = provider.reasons_against(request)
        row = {
            "name": name,
            "lossless": provider.capabilities.lossless,
            "usable": not reasons,
            "why_not": "; ".join(reasons),
            "request": request.describe(),
        }
        if self_test and not reasons:
            try:
                row["self_test_err"] = _self_test(name, kind)
            except Exception as exc:  # a self-test failure is a finding, not a crash of the doctor
                row.update(usable=False, why_not=f"self-test failed: {type(exc).__name__}: {exc}")
        rows.append(row)
    return rows


def caches() -> dict[str, str]:
    user = os.environ.get("USER", "user")
    return {
        "torch.compile (inductor)": os.environ.get(
            "TORCHINDUCTOR_CACHE_DIR", str(Path(tempfile.gettempdir()) / f"torchinductor_{user}")
        ),
        "triton": os.environ.get("TRITON_CACHE_DIR", str(Path.home() / ".triton" / "cache")),
        "flashinfer JIT": os.environ.get(
            "FLASHINFER_WORKSPACE_BASE", str(Path.home() / ".cache" / "flashinfer")
        ),
    }


def collect(self_test: bool = True) -> dict[str, Any]:
    return {
        "python": sys.version.split()[0],
        "packages": packages(),
        "device": device(),
        "providers": providers(self_test),
        "distributed": {"gloo": dist.is_gloo_available(), "nccl": dist.is_nccl_available()},
        "caches": caches(),
    }


def problems(report: dict[str, Any], attention: str | None, compile_: bool, backend: str | None) -> list[str]:
    """What the user asked for that cannot work here."""
    found = []
    if attention and attention != "auto":
        row = next((r for r in report["providers"] if r["name"] == attention), None)
        if row is None:
            found.append(f"--attention {attention}: no such provider ({', '.join(provider_names())})")
        elif not row["usable"]:
            found.append(f"--attention {attention}: {row['why_not']}")
    if compile_ and report["device"]["type"] == "cuda":
        triton = next(r for r in report["packages"] if r["name"] == "triton")
        if not triton["installed"]:
            found.append("--compile: torch.compile on CUDA needs triton, which is not installed")
    if backend and not report["distributed"].get(backend):
        found.append(f"--backend {backend}: this torch build has no {backend} backend")
    return found


def render(report: dict[str, Any], found: list[str]) -> str:
    lines = [f"omni_accel doctor (python {report['python']})", "", "packages:"]
    for row in report["packages"]:
        mark = "ok " if row["ok"] else "-- "
        lines.append(
            f"  {mark}{row['name']:20s} {row['installed'] or '-':14s} tested {row['tested'] or '-'}  {row['note']}"
        )
    dev = report["device"]
    lines += [
        "",
        f"device: {dev['type']} {dev['name']}"
        + (
            f", sm {dev['capability']}, {dev['memory_gib']} GiB x{dev['count']}, CUDA {dev['cuda']}"
            if dev["type"] == "cuda"
            else ""
        ),
    ]
    lines.append("")
    lines.append(f"attention providers ({report['providers'][0]['request'] if report['providers'] else ''}):")
    for row in report["providers"]:
        state = "usable" if row["usable"] else "no"
        extra = f"self-test err {row['self_test_err']:.1e}" if "self_test_err" in row else row["why_not"]
        lossy = "" if row["lossless"] else " (lossy)"
        lines.append(f"  {row['name']:15s} {state:7s}{lossy} {extra}")
    lines += [
        "",
        "distributed: " + ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in report["distributed"].items()),
    ]
    lines += ["", "caches:"] + [f"  {k}: {v}" for k, v in report["caches"].items()]
    if found:
        lines += ["", "problems:"] + [f"  {p}" for p in found]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="omni-accel doctor", description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.add_argument("--no-self-test", action="store_true", help="skip the GPU kernel self-tests")
    parser.add_argument("--attention", help="fail if this provider cannot run here")
    parser.add_argument("--compile", action="store_true", help="fail if torch.compile cannot run here")
    parser.add_argument("--backend", choices=["gloo", "nccl"], help="fail if this backend is missing")
    args = parser.parse_args(argv)
    report = collect(self_test=not args.no_self_test)
    found = problems(report, args.attention, args.compile, args.backend)
    report["problems"] = found
    sys.stdout.write((json.dumps(report, indent=2) if args.json else render(report, found)) + "\n")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
