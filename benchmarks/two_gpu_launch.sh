#!/usr/bin/env bash
# The two-GPU runs pending since the last two-GPU launch (docs/archive/performance-history.md, "Built since the last two-GPU
# launch"): one part per device call, each meant to end well inside a call's 10 minutes, its log and JSON
# under $OUT (./out elsewhere). On nvidia-h200-x2, with the carried wheels installed:
#
#     bash benchmarks/two_gpu_launch.sh tests           # parity of the replayed layouts (NCCL vs peer writes)
#     bash benchmarks/two_gpu_launch.sh flux            # eager A/Bs of the tuned choices, 8-step calls
#     bash benchmarks/two_gpu_launch.sh flux-before     # the same launch from commit e357fac, with the
#                                                       # changes whose predecessor has no config undone
#     bash benchmarks/two_gpu_launch.sh flux-compiled   # issue 9's compiled comparison, Diffusers' included
#     bash benchmarks/two_gpu_launch.sh wan             # Wan 14B with CFG: placed inputs, head stages, ring
#
# A variant (`+name`, benchmarks/harness/layouts.py) is a LayoutTuning choice changed: where it wins, the
# default changes. Changes with no config to undo them compare against the launch from e357fac.
set -euo pipefail
part=${1:?"which part: tests, flux, flux-before, flux-compiled or wan"}
out=$(realpath -m "${OUT:-out}")
mkdir -p "$out"
cd "$(dirname "$0")"
flux=(torchrun --nproc-per-node 2 layouts.py --steps 8 --repeats 2)
case $part in
tests)
    (cd .. && python3 -m pytest -q -p no:logging -m gpu tests/test_cuda_graphs.py -k parallel_replays) ;;
flux)
    "${flux[@]}" --no-diffusers --out "$out/flux.json" --layouts 1gpu ulysses2 ulysses2+packed_inputs \
        ulysses2+one_stage ulysses2+nccl_exchange ring2 tp2 tp2+replicated_tokens ;;
flux-before)
    # that commit's tree, library included (its variants patch names this one no longer has): $BEFORE, or
    # a worktree made here (where no .git travels, as to a lent machine, carry `git archive e357fac` unpacked)
    before=${BEFORE:-/tmp/before}
    [ -d "$before" ] || (cd .. && git worktree add -f "$before" e357fac >/dev/null)
    (cd "$before/benchmarks" && PYTHONPATH="$before:${PYTHONPATH:-}" torchrun --nproc-per-node 2 \
        flux_parallel.py --steps 8 --repeats 2 \
        --no-diffusers --out "$out/flux_before.json" --layouts 1gpu ulysses2 ulysses2+returned_apart \
        ulysses2+modulation_per_block ring2 ring2+modulation_per_block tp2 tp2+copied_gathers \
        tp2+streams_apart tp2+modulation_per_block) ;;
flux-compiled)
    "${flux[@]}" --compile --out "$out/flux_compiled.json" --layouts 1gpu ulysses2 ulysses2+packed_inputs \
        ring2 tp2 ;;
wan)
    torchrun --nproc-per-node 2 layouts.py --model wan14b --steps 2 --repeats 1 --no-diffusers \
        --out "$out/wan.json" --layouts 1gpu \
        ulysses2+unstacked ulysses2+unstacked+packed_inputs ulysses2+unstacked+one_placed_stage ulysses2 ring2 ;;
*)
    echo "unknown part $part: tests, flux, flux-before, flux-compiled or wan" >&2
    exit 2 ;;
esac 2>&1 | tee "$out/$part.log"
