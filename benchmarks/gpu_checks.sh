#!/usr/bin/env bash
# The GPU session's checks in one go, for a machine with CUDA and no network (a lent GPU
# machine): the Triton kernels' benchmark on a quiet GPU, the engine-on-CUDA equality tests, then
# the kernel tests. Logs go to LOG_DIR (default benchmarks/out/gpu); STEPS picks among bench,
# engine and kernels (default all three, in that order). Missing wheels (msgspec) can sit in
# .whl/; they are installed into a scratch folder.
#   bash benchmarks/gpu_checks.sh [LOG_DIR [STEPS...]]
set -u
out=${1:-benchmarks/out/gpu}
shift || true
steps=${*:-bench engine kernels}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
{
    nvidia-smi -L
    python3 -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton", triton.__version__,
"transformers", transformers.__version__, torch.cuda.get_device_name())'
    grep -m1 "model name" /proc/cpuinfo; nproc; command -v cc
} 2>&1 | tee "$out/env.log"
# The compiled CPU kernels, as an install builds them (setup.py; build outputs do not travel).
timeout 300 python3 setup.py -q build_ext --inplace -j "$(nproc)" >"$out/build_native.log" 2>&1 \
    || echo "building the CPU kernels failed: see $out/build_native.log"
pytest_args=(-q -p no:cacheprovider -p no:benchmark -rfEs --durations=15 --timeout=150)
for step in $steps; do
    start=$SECONDS
    case $step in
        bench) timeout 150 python3 benchmarks/kernels.py --iters 30 2>&1 | tee "$out/kernels_bench.log" | grep -v '^RESULT'
               rc=${PIPESTATUS[0]} ;;
        engine) timeout 200 python3 -m pytest tests/engine/test_correctness.py tests/engine/test_bfloat16.py -k cuda \
                    "${pytest_args[@]}" >"$out/engine_tests.log" 2>&1
                rc=$?; tail -30 "$out/engine_tests.log" ;;
        # Workers run torch on two threads each: the CPU kernels' tests run here too.
        kernels) OMP_NUM_THREADS=2 timeout 200 python3 -m pytest tests/kernels -n 6 "${pytest_args[@]}" \
                     >"$out/kernel_tests.log" 2>&1
                 rc=$?; grep -E "^(FAILED|ERROR)" "$out/kernel_tests.log" | head -40; tail -22 "$out/kernel_tests.log" ;;
        *) echo "unknown step $step"; rc=2 ;;
    esac
    echo "== $step: exit $rc, $((SECONDS - start)) s"
done
