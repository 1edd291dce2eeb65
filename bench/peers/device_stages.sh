#!/bin/bash
# The device session's measurements as named stages, so a whole plan is a few `run` calls.
#
#   bash bench/peers/device_stages.sh STAGE [STAGE ...]      # on the device, in the repo root
#
# Prepare here (PyPI reachable; the paths are git-ignored through .git/info/exclude):
#   echo /.whl/ >> .git/info/exclude; echo /.gpu/ >> .git/info/exclude
#   bash bench/peers/device_wheels.sh .whl                      # ~18 MiB: carry on a fresh machine
#   python bench/throughput_ab.py --export REV .gpu/base         # an older tree, for stage `tracing`
#   bash ../shared/peers/vllm/make_bundle.sh /tmp/bundle         # vLLM 0.26.0, two parts of ~38 MiB, then
#   cat /tmp/bundle/*.part0 /tmp/bundle/*.part1 | split -n 3 -d -a 1 - /tmp/bpart
#   for i in 0 1 2; do mkdir -p .gpu/q$i; mv /tmp/bpart$i .gpu/q$i/p; done   # ~26 MiB each
# The tracked tree is ~39 MB and a call carries at most 64 MiB, so one part per call: stages
# q0 and q1 park parts 0 and 1 in /tmp, and `vs` (carrying .gpu/q2) joins the three. Those
# calls must follow each other within the machine's ~30 s warm window, or /tmp is gone.
# A call on a fresh machine carries .whl (installed once into /tmp/site). Each stage writes
# its JSON/logs under $OUT, named with the card (h100, h200).
#
# Stages:
#   skinny   bench/skinny_gemm.py sweep -> paste its rows (paste_tuned_rows.py) -> the skinny
#            GPU tests -> A/B of VLLM_ANATOMY_SKINNY_GEMM 0 vs tuned (AB_ROUNDS, default 2)
#   fuse     the fused q/k-norm+RoPE+KV-write GPU tests, A/B of its switch 0 vs 1
#   fuse_rope  Llama's RoPE + KV-write fusion: its GPU tests, A/B of VLLM_ANATOMY_FUSE_ROPE_KVCACHE 0 vs 1
#            on the SmolLM2-135M shape
#   pdl      the PDL GPU tests, bench/pdl_chain.py, bench/pdl_layers.py, A/B of VLLM_ANATOMY_PDL 0 vs 1
#            with the committed rows
#   pdltune  bench/skinny_gemm.py --pdl (the rows chosen in context, with PDL) -> paste its rows
#            (paste_tuned_rows.py; they replace any `skinny` rows of the same call) -> A/B of the
#            committed rows without PDL (a copy of the package from before the paste) against
#            those rows with VLLM_ANATOMY_PDL=1, then PDL 0 vs 1 at SKINNY_GEMM=1. Its own call:
#            the sweep and two A/Bs take most of the 10 minutes.
#   incontext  bench/skinny_gemm.py --in-context (rows chosen after their producer, PDL off) -> paste
#            its rows -> the skinny engine GPU tests -> A/B of the committed rows (a copy of the package
#            before the paste) against them, both PDL off. Its own call.
#   pdlx     A/B: PDL off (default) vs PDL on for every kernel but unified_attention (a patched copy)
#   tracing  bench/tracing_overhead.py --gpu off,spans: .gpu/base's tree, then this one, two rounds
#   gil      A/B at trace level spans: the span exporter offering the GIL every 0.5 ms (the default,
#            tracing/gil_yield.py) against never (VLLM_ANATOMY_TRACE_GIL_OFFER_US=0)
#   breakdown  bench/gpu_breakdown.py --gc-log, ours only: kernel time by kind, idle gaps, what overlapped them
#   ttft     bench/gpu_breakdown.py --workload ttft:4096, ours only: one 4k prompt's host and GPU time
#   ttfthost  the same at 4k and 8k with --host-profile (bench/ttft_host.py): unprofiled walls (the
#            first call of a length against the rest), each step's host phases, every CUDA sync, cProfile
#   ttftcfg  ttfthost's 8k (and 4k) pass on a copy of the tree whose prefill kernel takes the config of
#            before fb796a8 (64 x 64 tiles, 4 warps, device-side TMA, no warp specialisation): did the
#            128 x 128 warp-specialised default (a many-prompt sweep's pick) slow a single long prompt?
#   launch   bench/launch_overhead.py: host us per eager launch (Triton's JIT path, a CompiledKernel
#            launched directly, torch.empty / an ATen op / a cuBLAS GEMM, the reshape_and_cache wrapper)
#   cold     an A/A run on an emptied Triton cache (the first variant cold): compiles mid-workload
#   q0, q1   park a vLLM bundle part in /tmp (carry .gpu/q0, then .gpu/q1)
#   vs       join the parts (carry .gpu/q2), unpack, bench/vs_vllm.py --skip-gpu-time (R: round)
#   vs2      another round, --skip-latency, on the unpacked bundle (R: round)
set -uo pipefail
export PYTHONUNBUFFERED=1
if [ -d .whl ] && [ ! -f /tmp/site/.done ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && touch /tmp/site/.done || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD
CARD=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -o 'H[0-9][0-9]*' | head -1 | tr A-Z a-z)
echo "card=$CARD"; nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv
T0=$SECONDS
quiet() { grep -v "Capturing\|it/s\]"; }
ab() {  # ab NAME A_ENV B_ENV [more --a-env/--b-env flags]
  local name=$1; shift
  python3 bench/throughput_ab.py "$@" --rounds "${AB_ROUNDS:-2}" --model-dir /tmp/ab-model \
    --out "$OUT/throughput_ab_${name}_$CARD.json" 2>&1 | quiet | tail -6
}
vllm_env() {
  local cu13
  cu13=$(PYTHONPATH=/tmp/vllm-site python3 -c 'import nvidia,os;print(os.path.join(list(nvidia.__path__)[0],"cu13","lib"))' 2>/dev/null || true)
  if [ -n "$cu13" ] && [ -d "$cu13" ]; then export LD_LIBRARY_PATH=$cu13${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}; fi
}
for STAGE in "$@"; do
  echo "=== stage $STAGE at $((SECONDS - T0)) s"
  case $STAGE in
  skinny)
    python3 bench/skinny_gemm.py --budget-s "${SK_BUDGET:-60}" --out "$OUT/skinny_gemm_$CARD.json" 2>&1 \
      | tee "$OUT/skinny_log_$CARD.txt" | tail -40
    python3 bench/peers/paste_tuned_rows.py "$OUT/skinny_gemm_$CARD.json" && cp vllm_anatomy/kernels/skinny_gemm.py "$OUT/"
    timeout 300 python3 -m pytest -q -rs tests/kernel_tests/test_skinny_gemm.py tests/gpu/test_skinny_gemm_engine.py 2>&1 \
      | tee "$OUT/skinny_tests_$CARD.log" | tail -6
    ab skinny --a-env VLLM_ANATOMY_SKINNY_GEMM=0 --b-env VLLM_ANATOMY_SKINNY_GEMM=tuned --a-label cublas --b-label tuned ;;
  fuse)
    timeout 200 python3 -m pytest -q -rs tests/kernel_tests/test_fused_qk_norm_rope_kvcache.py \
      tests/gpu/test_fused_qk_norm_rope_kvcache_engine.py 2>&1 | tee "$OUT/fuse_tests_$CARD.log" | tail -6
    ab fuse_kv --a-env VLLM_ANATOMY_FUSE_QK_NORM_ROPE_KVCACHE=0 --b-env VLLM_ANATOMY_FUSE_QK_NORM_ROPE_KVCACHE=1 \
      --a-label split --b-label fused ;;
  fuse_rope)
    timeout 300 python3 -m pytest -q -rs tests/kernel_tests/test_fused_rope_kvcache.py tests/gpu/test_fused_rope_kvcache_engine.py \
      2>&1 | tee "$OUT/fuse_rope_tests_$CARD.log" | tail -6
    python3 bench/throughput_ab.py --shape smollm2-135m --a-env VLLM_ANATOMY_FUSE_ROPE_KVCACHE=0 \
      --b-env VLLM_ANATOMY_FUSE_ROPE_KVCACHE=1 --a-label split --b-label fused --rounds "${AB_ROUNDS:-2}" \
      --model-dir /tmp/ab-model-smollm2 --out "$OUT/throughput_ab_fuse_rope_kv_$CARD.json" 2>&1 | quiet | tail -6 ;;
  pdl)
    timeout 300 python3 -m pytest -q -rs tests/kernel_tests/test_pdl.py tests/gpu/test_pdl_engine.py \
      tests/gpu/test_skinny_gemm_engine.py 2>&1 | tee "$OUT/pdl_tests_$CARD.log" | tail -6
    python3 bench/pdl_chain.py --out "$OUT/pdl_chain_$CARD.json" 2>&1 | tail -6
    python3 bench/pdl_layers.py --out "$OUT/pdl_layers_$CARD.json" 2>&1 | tail -9
    ab pdl --a-env VLLM_ANATOMY_PDL=0 --b-env VLLM_ANATOMY_PDL=1 --a-label off --b-label pdl ;;
  pdltune)
    # NOTE: A keeps the committed rows (a copy of the package before the paste) without PDL;
    # B runs the rows chosen in context with PDL on: the engine as each switch would ship it.
    rm -rf /tmp/a_tree && mkdir -p /tmp/a_tree && cp -r vllm_anatomy /tmp/a_tree/
    python3 bench/skinny_gemm.py --pdl --budget-s 60 --out "$OUT/skinny_gemm_pdl_$CARD.json" 2>&1 \
      | tee "$OUT/skinny_pdl_log_$CARD.txt" | tail -40
    python3 bench/peers/paste_tuned_rows.py "$OUT/skinny_gemm_pdl_$CARD.json" \
      && cp vllm_anatomy/kernels/skinny_gemm.py "$OUT/skinny_gemm_pdl_rows.py"
    ab pdl_tuned --a /tmp/a_tree --a-env VLLM_ANATOMY_PDL=0 --b-env VLLM_ANATOMY_PDL=1 \
      --a-label committed_rows_off --b-label pdl_rows_pdl
    ab pdl_skinny1 --a-env VLLM_ANATOMY_PDL=0 --a-env VLLM_ANATOMY_SKINNY_GEMM=1 \
      --b-env VLLM_ANATOMY_PDL=1 --b-env VLLM_ANATOMY_SKINNY_GEMM=1 --a-label off_skinny1 --b-label pdl_skinny1 ;;
  incontext)
    # NOTE: A keeps the committed rows (a copy of the package before the paste), B the rows chosen
    # in context; both PDL off, as the default engine ships. If B's rows are committed, commit their
    # JSON too and point tests/bench/test_paste_tuned_rows.py's RESULT at it.
    rm -rf /tmp/a_tree && mkdir -p /tmp/a_tree && cp -r vllm_anatomy /tmp/a_tree/
    python3 bench/skinny_gemm.py --in-context --budget-s 60 --out "$OUT/skinny_gemm_incontext_$CARD.json" 2>&1 \
      | tee "$OUT/skinny_incontext_log_$CARD.txt" | tail -40
    python3 bench/peers/paste_tuned_rows.py "$OUT/skinny_gemm_incontext_$CARD.json" \
      && cp vllm_anatomy/kernels/skinny_gemm.py "$OUT/skinny_gemm_incontext_rows.py"
    timeout 200 python3 -m pytest -q -rs tests/gpu/test_skinny_gemm_engine.py 2>&1 | tee "$OUT/skinny_incontext_tests_$CARD.log" | tail -4
    ab incontext_tuned --a /tmp/a_tree --a-env VLLM_ANATOMY_PDL=0 --b-env VLLM_ANATOMY_PDL=0 \
      --a-label committed_rows --b-label incontext_rows ;;
  pdlx)
    # NOTE: an experiment, not a switch: B is a copy of the package whose unified_attention launches
    # without PDL (every other kernel with it), against the default (PDL off).
    rm -rf /tmp/b_tree && mkdir -p /tmp/b_tree && cp -r vllm_anatomy /tmp/b_tree/
    sed -i 's/seq_order=self._seq_order(attn_metadata, split), pdl=self.pdl)/seq_order=self._seq_order(attn_metadata, split), pdl=False)/' \
      /tmp/b_tree/vllm_anatomy/attention/backends/triton_attn.py
    grep -c "split), pdl=False)" /tmp/b_tree/vllm_anatomy/attention/backends/triton_attn.py || exit 3
    ab pdl_no_attention --b /tmp/b_tree --a-env VLLM_ANATOMY_PDL=0 --b-env VLLM_ANATOMY_PDL=1 \
      --a-label off --b-label pdl_but_attention ;;
  tracing)
    for r in 1 2; do
      PYTHONPATH=/tmp/site:$PWD/.gpu/base python3 bench/tracing_overhead.py --gpu --levels off,spans \
        --out "$OUT/tracing_overhead_${CARD}_base_r$r.json" 2>&1 | tail -4
      python3 bench/tracing_overhead.py --gpu --levels off,spans --out "$OUT/tracing_overhead_${CARD}_r$r.json" 2>&1 | tail -4
    done ;;
  gil)
    ab gil_offer_spans --trace-level spans --a-env VLLM_ANATOMY_TRACE_GIL_OFFER_US=0 \
      --b-env VLLM_ANATOMY_TRACE_GIL_OFFER_US=500 --a-label no_offer --b-label offer_500us ;;
  breakdown)
    python3 bench/gpu_breakdown.py --gc-log --out "$OUT/gpu_breakdown_${CARD}_gaps_gc.json" 2>&1 | quiet | tail -45 ;;
  ttft)
    python3 bench/gpu_breakdown.py --workload ttft:4096 --out "$OUT/gpu_breakdown_ttft4096_$CARD.json" 2>&1 | quiet | tail -30 ;;
  ttfthost)
    for n in 4096 8192; do
      python3 bench/gpu_breakdown.py --workload ttft:$n --host-profile --out "$OUT/gpu_breakdown_ttft${n}_host_$CARD.json" \
        2>&1 | quiet | tail -40
    done ;;
  ttftcfg)
    rm -rf /tmp/cfgtree && mkdir -p /tmp/cfgtree && cp -r vllm_anatomy bench /tmp/cfgtree/
    python3 - /tmp/cfgtree/vllm_anatomy/kernels/prefill_attention.py <<'PYEOF' || exit 3
import sys
p = sys.argv[1]; s = open(p).read()
new_default = 'if _has_tma():\n        return dict(block_m=128, block_n=128, num_warps=8'
old_fallback = 'tma="off", warp_specialize=False, fold_scale=False)\n\n\n@functools.cache'
assert s.count(new_default) == 1 and s.count(old_fallback) == 1, "pick_config changed: update the stage"
s = s.replace(new_default, new_default.replace("if _has_tma():", "if False:"))
s = s.replace(old_fallback, old_fallback.replace('tma="off"', 'tma="device"'))
open(p, "w").write(s)
PYEOF
    for n in ${TTFT_LENS:-8192 4096}; do
      (cd /tmp/cfgtree && python3 bench/gpu_breakdown.py --workload ttft:$n --host-profile \
        --out "$OUT/gpu_breakdown_ttft${n}_host_cfg64_$CARD.json") 2>&1 | quiet | tail -25
    done ;;
  launch)
    python3 bench/launch_overhead.py --out "$OUT/launch_overhead_$CARD.json" 2>&1 | tail -12 ;;
  cold)
    export TRITON_CACHE_DIR=/tmp/tc_fresh; rm -rf /tmp/tc_fresh
    AB_ROUNDS=1 ab cold_cache --a-env VLLM_ANATOMY_X=cold --b-env VLLM_ANATOMY_X=warm --a-label cold_cache --b-label warm_cache
    find /tmp/tc_fresh -type f -name "*.cubin" -printf "%TT %f\n" | sort > "$OUT/cold_cache_mtimes_$CARD.txt"
    unset TRITON_CACHE_DIR ;;
  q0|q1)
    cp ".gpu/$STAGE/p" "/tmp/vpart_$STAGE" && ls -la /tmp/vpart_* ;;
  vs)
    cat /tmp/vpart_q0 /tmp/vpart_q1 .gpu/q2/p > /tmp/b.tar.xz && rm -rf /tmp/vllm-site && mkdir -p /tmp/vllm-site \
      && tar -C /tmp/vllm-site -xJf /tmp/b.tar.xz && echo "unpacked at $((SECONDS - T0)) s" || exit 1
    vllm_env
    python3 bench/vs_vllm.py --vllm-site /tmp/vllm-site --skip-gpu-time ${VS_ARGS:-} \
      --out "$OUT/vs_vllm_${CARD}_r${R:-1}.json" 2>&1 | quiet | tail -14 ;;
  vs2)
    vllm_env
    python3 bench/vs_vllm.py --vllm-site /tmp/vllm-site --skip-gpu-time --skip-latency ${VS_ARGS:-} \
      --out "$OUT/vs_vllm_${CARD}_r${R:-2}.json" 2>&1 | quiet | tail -10 ;;
  *) echo "unknown stage $STAGE"; exit 2 ;;
  esac
done
echo "=== done at $((SECONDS - T0)) s"
