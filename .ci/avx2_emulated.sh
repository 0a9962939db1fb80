#!/usr/bin/env bash
# The CPU kernels' tests on an emulated AVX2-only CPU, from any x86-64 machine: the repository's .venv
# python under qemu-x86_64 (user-mode emulation, Debian's qemu-user) with an AVX2 CPU model, so an
# AVX-512 or AMX instruction anywhere on the path is SIGILL, as on an AVX2-only EPYC. qemu-user passes the
# host's /proc/cpuinfo through, so a copy without the AVX-512/AMX flags is bind-mounted over it in a mount
# namespace of the run's own (root). The model's CPUID makes torch, oneDNN and the kernels' probe agree.
# Slow (about 30x native; the default selection takes ~15 minutes on one core) and not part of make test.
# Processes a test starts run natively.
#
#   sudo .ci/avx2_emulated.sh [pytest arguments]      (CPU=Haswell to pick another model)
set -euo pipefail
cd "$(dirname "$0")/.."
command -v qemu-x86_64 >/dev/null || { echo "avx2_emulated: needs qemu-x86_64 (apt-get install qemu-user)" >&2; exit 2; }
[ -x .venv/bin/python ] || { echo "avx2_emulated: no .venv: run make install first" >&2; exit 2; }
cpu=${CPU:-EPYC-Rome}
args=("$@")
[ ${#args[@]} -gt 0 ] || args=(tests/kernels/test_native_levels.py tests/kernels/test_backends.py
                                tests/kernels/test_linear.py tests/kernels/test_greedy_head.py)
cpuinfo=$(mktemp)
trap 'rm -f "$cpuinfo"' EXIT
sed -E '/^flags/ s/ (avx512[a-z0-9_]*|amx_[a-z0-9]*|avx_vnni[a-z0-9_]*)//g' /proc/cpuinfo >"$cpuinfo"
# NOTE: qemu warns once per CPUID feature its emulation lacks; those lines are dropped.
unshare -m bash -c 'mount --bind "$0" /proc/cpuinfo && exec "$@"' "$cpuinfo" \
    qemu-x86_64 -cpu "$cpu" .venv/bin/python -m pytest -q -p no:cacheprovider "${args[@]}" \
    2> >(grep -v "TCG doesn't support requested feature" >&2)
