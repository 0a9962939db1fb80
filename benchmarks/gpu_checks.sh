#!/usr/bin/env bash
# The GPU session's checks in one go, for a machine with CUDA and no network (a lent GPU
# machine): the engine-on-CUDA equality tests (CUDA graphs against eager and transformers), the
# engine benchmark (benchmarks/gpu_engine.py: its models made on the device), KV reads of GPU
# memory between two processes over NIXL (benchmarks/kv_transfer_gpu.py: GB/s and UCX's transport),
# 1P+1D against colocated served through the proxy (benchmarks/gpu_served.py, on the engine
# benchmark's llama-1b), the KV pull streamed chunk by chunk against whole (benchmarks/kv_streaming.py,
# same model, two nodes on the GPU), the kernel tests, the Triton kernels' benchmark, and the engine's
# host side per decode step on this machine's CPU (benchmarks/host_ceiling.py). STEPS picks
# among engine, gpu_engine, kv, served, stream, tp, kernels, bench and host (default: engine kv gpu_engine
# served tp stream, each with a short limit, so that a run on a GPU meets every area once; their
# limits add up past TOTAL_S, their usual times do not; stream, last, needs about 60 s).
# GPU_ENGINE_PRESETS (default llama-1b) are the engine benchmark's models: llama-8b (making it takes
# ~2 minutes) fits a run of that step alone.
# TOTAL_S (default 540) bounds the whole: each step's timeout is cut to what is left, and a step with
# under 20 s left is skipped. PDSERVE_COMMIT names the commit in the results where the copy has no .git. Logs go to a scratch folder; OUT_DIR (default benchmarks/out/gpu) gets summary.txt as it
# grows, and after each step results/*.json and all the logs as gpu_checks.tgz (a device call brings
# back 8 files, and nothing written after it is cut off).
# The wheels the device image lacks sit in .whl/ (made here by `.venv/bin/python benchmarks/gpu_wheels.py`,
# carried with the call) and are installed into a scratch folder.
#   bash benchmarks/gpu_checks.sh [OUT_DIR [STEPS...]]     # on the device: bash benchmarks/gpu_checks.sh "$OUT"
set -u
dest=${1:-benchmarks/out/gpu}
shift || true
steps=${*:-engine kv gpu_engine served tp stream}
total=${TOTAL_S:-540}
out=$(mktemp -d "${TMPDIR:-/tmp}/gpu_checks.XXXXXX")
mkdir -p "$out/results" "$dest/results"
summary="$dest/summary.txt"
: >"$summary"
export PYTHONUNBUFFERED=1 PDSERVE_RESULTS_DIR="$out/results"
export PDSERVE_COMMIT=${PDSERVE_COMMIT:-$(git rev-parse --short=7 HEAD 2>/dev/null)}
# A step's timeout: its own, or what is left of TOTAL_S if less (at least 1 s: timeout 0 never ends).
limit() { local left=$((total - SECONDS)); echo $(( $1 < left ? $1 : (left > 1 ? left : 1) )); }
# timeout, then SIGKILL 45 s after its SIGTERM (a step's cleanup stops the servers it started: up to 10 s for
# each of the proxy, the prefill nodes and the decode nodes).
run_for() { timeout -k 45 "$@"; }
# Every process a step starts carries this mark in its environment. The servers a step starts run in
# sessions of their own (pdserve/cluster.py), so a step's timeout does not reach them: what a step
# leaves is ended before the next one starts, by the mark (no other process is touched).
export PDSERVE_GPU_CHECK_RUN="$$-$RANDOM$RANDOM"
sweep() {
    local pid left=()
    for pid in $(pgrep -d ' ' .); do
        [ "$pid" = "$$" ] && continue
        tr '\0' '\n' <"/proc/$pid/environ" 2>/dev/null | grep -qx "PDSERVE_GPU_CHECK_RUN=$PDSERVE_GPU_CHECK_RUN" \
            && left+=("$pid")
    done
    if [ ${#left[@]} -gt 0 ]; then
        kill -9 "${left[@]}" 2>/dev/null
        echo "== $1: ended ${#left[@]} processes it left running" | tee -a "$summary"
    fi
}
# What a cut-off call still brings back: the results and the logs so far.
save() {
    cp "$out"/results/*.json "$dest/results/" 2>/dev/null
    tar czf "$dest/gpu_checks.tgz" -C "$out" .
}
if compgen -G ".whl/*.whl" >/dev/null; then
    if python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
            .whl/*.whl >"$out/wheels.log" 2>&1; then
        export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    else
        echo "== wheels: install failed (see wheels.log)" | tee -a "$summary"
    fi
fi
{
    nvidia-smi -L
    python3 -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton", triton.__version__,
"transformers", transformers.__version__, torch.cuda.get_device_name())'
    grep -m1 "model name" /proc/cpuinfo; nproc; command -v cc; uname -r; echo "commit ${PDSERVE_COMMIT:-unknown}"
    # the image's versions of what the carried wheels install over without their dependencies
    python3 -m pip list 2>/dev/null | grep -iE '^(anyio|idna|h11|httpcore|sniffio|multidict|aiosignal|propcache|numpy) '

    # settings that change how KV moves (see kv_transfer/ucx.py) or how float32 matmuls round (TF32 overrides)
    env | grep -E '^(PYTORCH|TORCH|NVIDIA|UCX|NCCL|CUDA)_' || true
    # RDMA: the host's verbs providers (beside NIXL's own: see kv_transfer.ucx.exit_now) and its ports
    echo "rdma-core providers: $(ls /etc/libibverbs.d 2>/dev/null | tr '\n' ' ')"
    echo "rdma ports: $(ls /sys/class/infiniband 2>/dev/null | tr '\n' ' ')"
} 2>&1 | tee "$out/env.log"
# Every import the steps need, up front: a missing wheel named in 2 s, not inside a step.
# Without them every step fails: stop there.
if python3 -c "import fastapi, uvicorn, httptools, msgspec, zmq, pydantic, xgrammar, gguf, httpx, aiohttp, nixl, \
openai, prometheus_client, xdist, pytest_timeout" >>"$out/env.log" 2>&1; then
    echo "== imports: ok" | tee -a "$summary"
    # What pdserve itself sees: its GPUs (free memory, UUIDs), the NIXL build and plugins, RDMA ports.
    timeout 60 python3 -m pdserve.cli env >>"$out/env.log" 2>&1 || echo "pdserve env failed: see env.log" | tee -a "$summary"
else
    echo "== imports: FAILED" | tee -a "$summary"; tail -3 "$out/env.log" | tee -a "$summary"
    save; exit 1
fi
pytest_args=(-q -p no:cacheprovider -p no:benchmark -rfEs --durations=15 --timeout=150)
for step in $steps; do
    start=$SECONDS
    if [ $((total - SECONDS)) -lt 20 ]; then
        echo "== $step: skipped, $((total - SECONDS)) s of TOTAL_S left" | tee -a "$summary"
        continue
    fi
    case $step in
        bench) run_for "$(limit 150)" python3 benchmarks/kernels.py --iters 30 2>&1 | tee "$out/kernels_bench.log" | grep -v '^RESULT'
               rc=${PIPESTATUS[0]} ;;
        # A test's own timeout under the step's: a hang shows its traceback instead of being cut off.
        engine) run_for "$(limit 150)" python3 -m pytest tests/engine/test_decode_graphs.py tests/engine/test_mixed_graphs.py \
                    tests/engine/test_correctness.py \
                    tests/engine/test_bfloat16.py tests/engine/test_sampler.py tests/engine/test_warm_up.py \
                    tests/kernels/test_triton_variants.py tests/kv_transfer/test_device_copy.py \
                    tests/kernels/test_small_linear.py -k "cuda or (small_linear and bfloat16)" \
                    "${pytest_args[@]}" --timeout=90 >"$out/engine_tests.log" 2>&1
                rc=$?; tail -30 "$out/engine_tests.log" ;;
        # llama-1b took 33 s on an H200 with the phases of c0e8b24; profile, layouts, weights as stored
        # and the short prompts add about as much again, the fused layers and the attention tunings ~30 s.
        gpu_engine) left=$(limit 150)
                    run_for "$left" python3 benchmarks/gpu_engine.py --presets "${GPU_ENGINE_PRESETS:-llama-1b}" \
                        --budget-s $((left - 10)) \
                        2>&1 | tee "$out/gpu_engine.log" | grep -v '^RESULT'
                    rc=${PIPESTATUS[0]} ;;
        kv) run_for "$(limit 120)" python3 benchmarks/kv_transfer_gpu.py --timeout-s 25 2>&1 \
                | tee "$out/kv_transfer_gpu.log" | grep -v '^RESULT'
            rc=${PIPESTATUS[0]} ;;
        # Split models on the GPU: reads between caches split over ranks (NIXL and gloo), a worker
        # rank opening the cache rank 0 allocated for it (CUDA IPC), a TP=2 engine's decode steps
        # captured as graphs between its collectives, and split prefill and decode nodes served end
        # to end (their ranks sharing the one GPU: PDSERVE_TP_SHARE_GPU). One file per worker: the
        # end-to-end file's nodes are one module fixture.
        tp) run_for "$(limit 120)" python3 -m pytest tests/kv_transfer/test_tensor_parallel_reads.py \
                tests/engine/test_tensor_parallel.py tests/e2e/test_tensor_parallel_disagg.py -k cuda -n 3 \
                --dist loadfile "${pytest_args[@]}" --timeout=100 >"$out/tp_tests.log" 2>&1
            rc=$?; tail -15 "$out/tp_tests.log" ;;
        # Prompts of 512 and 4,096 tokens, each at rate inf then Poisson near colocated's capacity.
        served) left=$(limit 120)
                run_for "$left" python3 benchmarks/gpu_served.py --prompt-lens 512 4096 --budget-s $((left - 5)) \
                    --log-dir "$out/served_logs" \
                    2>&1 | tee "$out/gpu_served.log" | grep -v '^RESULT'
                rc=${PIPESTATUS[0]} ;;
        # The model gpu_engine and served make; made here where neither ran before (this step alone).
        stream) [ -f .cache/models/llama-1b-bf16/config.json ] || run_for "$(limit 40)" python3 -m pdserve.cli make-model \
                    .cache/models/llama-1b-bf16 --preset llama-1b --dtype bfloat16 --device cuda >"$out/stream_model.log" 2>&1
                run_for "$(limit 60)" python3 benchmarks/kv_streaming.py --device cuda --dtype bfloat16 \
                    --model-dir .cache/models/llama-1b-bf16 --rounds 4 2>&1 | tee "$out/kv_streaming.log" | grep -v '^RESULT'
                rc=${PIPESTATUS[0]}; cp -r benchmarks/out/kv_streaming/logs "$out/stream_logs" 2>/dev/null ;;
        # Workers run torch on two threads each: the CPU kernels' tests run here too, built first as an
        # install builds them (setup.py; build outputs do not travel).
        kernels) run_for "$(limit 120)" python3 setup.py -q build_ext --inplace -j "$(nproc)" \
                     >"$out/build_native.log" 2>&1 || echo "building the CPU kernels failed: see $out/build_native.log"
                 OMP_NUM_THREADS=2 run_for "$(limit 200)" python3 -m pytest tests/kernels -n 6 "${pytest_args[@]}" \
                     --deselect tests/kernels/test_native.py::test_no_build_uses_march_native \
                     >"$out/kernel_tests.log" 2>&1
                 rc=$?; grep -E "^(FAILED|ERROR)" "$out/kernel_tests.log" | head -40; tail -22 "$out/kernel_tests.log" ;;
        # The engine's host side per decode step with the device's work free, on this machine's CPU
        # (benchmarks/host_ceiling.py: beside the newest gpu_engine record's step; the CPU kernels
        # are not built here, and only the prompts' prefill would use them).
        host) run_for "$(limit 90)" python3 benchmarks/host_ceiling.py --kernel-backend reference 2>&1 \
                  | tee "$out/host_ceiling.log" | grep -v '^RESULT'
              rc=${PIPESTATUS[0]} ;;
        *) echo "unknown step $step"; rc=2 ;;
    esac
    echo "== $step: exit $rc, $((SECONDS - start)) s" | tee -a "$summary"
    sweep "$step"
    save
done
grep -hE "passed|failed" "$out"/engine_tests.log "$out"/tp_tests.log "$out"/kernel_tests.log 2>/dev/null | tail -4 >>"$summary"
grep -v '^RESULT' "$out/gpu_engine.log" 2>/dev/null | grep -E "decode batch|prefill [0-9]|offline|transformers generate|graphs|\
profile batch|by kind|prompt alone|weights kept|fused small-batch|attention batch|enforce-eager|x    1 rows|x  256 rows|\
skipped|failed|stopped" >>"$summary"
grep -v '^RESULT' "$out/kv_transfer_gpu.log" 2>/dev/null | grep -E "GB/s|failed|timed out" >>"$summary"
grep -v '^RESULT' "$out/gpu_served.log" 2>/dev/null | grep -E "tok/s|colocated|failed|skipped|greedy|stopped" >>"$summary"
grep -v '^RESULT' "$out/kv_streaming.log" 2>/dev/null | grep -E "^\| [0-9]|streamed / whole|stopped|Error" >>"$summary"
grep -v '^RESULT' "$out/host_ceiling.log" 2>/dev/null | grep -E "prefix caching|batch|Error" >>"$summary"
save
cat "$summary"
