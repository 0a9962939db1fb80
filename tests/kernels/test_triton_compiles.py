"""The Triton small-batch projection kernels (kernels/triton/small_linear.py) compiled for a GPU
without one: every variant the fused decode layers launch, in each dtype and on both weight forms
(the QKV projection with rotary and the KV write: on W as stored, for heads of 64 and 128),
through Triton's own compiler and ptxas to a Hopper (sm_90) and an Ampere (sm_80) binary, specialized
as Triton's launcher specializes a real launch (16-byte aligned tensors, sizes and strides divisible
by 16, the unit stride a constant). Each must stream its weight through shared memory with
asynchronous copies (a pipelined loop: without it the kernel waits on every load) and keep within
the 99 KiB of shared memory the smallest of those GPUs give a program. The interpreter (the other
kernel tests) checks what the kernel computes; this checks that a GPU can build and launch it. The
layer loop's rotary-and-write kernel (heads in groups) is compiled alongside, its loads vectorized, and
so are the projection's other tunings the GPU benchmark times (benchmarks/gpu_engine.py's SMALL_TUNINGS,
in bfloat16 for Hopper, within the 227 KiB it gives a program)."""

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# Run without TRITON_INTERPRET (the kernels are then compiled, not interpreted), in a cache of the test's own.
COMPILE = r"""
import json, torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernels.triton.elementwise import _rotary_write_kv_kernel
from benchmarks.gpu_engine import SMALL_TUNINGS
from kernels.triton.small_linear import _qkv_rotary_kernel, _small_linear_kernel, launch_config

TYPES = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32"}


def build(kernel, capability, arguments, constants, divisible, options):
    # arguments: the runtime ones, name -> type; divisible: those a launch specializes as divisible by
    # 16 (tensors on their 16-byte alignment, sizes and strides), by their places in the kernel's arguments
    signature = dict(arguments) | {name: "constexpr" for name in constants}
    attrs = {(kernel.arg_names.index(name),): [["tt.divisibility", 16]] for name in divisible}
    compiled = triton.compile(ASTSource(kernel, signature, constants, attrs), target=GPUTarget("cuda", capability, 32),
                              options=options)
    ptx = compiled.asm["ptx"]
    return {"sm": capability, "shared": compiled.metadata.shared, "cubin": len(compiled.asm["cubin"]),
            "async_copies": ptx.count("cp.async"), "vector_loads": ptx.count("ld.global.v")}


def tiles(dtype, *tuning):
    # the projections' tiles and launch options, as small_linear launches them
    config = launch_config(dtype, 8192, *tuning)
    return config, {"num_warps": config.pop("num_warps"), "num_stages": config.pop("num_stages")}


POINTERS = ("x_ptr", "res_ptr", "norm_ptr", "w_ptr", "bias_ptr", "out_ptr", "new_res_ptr")
FLAGS = ("NORM", "HAS_RESIDUAL", "GATED", "HAS_BIAS")
VARIANTS = [  # O and down; QKV (the first layer's, with Qwen2's bias); QKV of the other layers; gate/up
    (False, False, False, False), (True, False, False, True), (True, True, False, False), (True, True, True, False)]
out = []
for capability in (90, 80):
    for dtype, pointer in TYPES.items():
        for flags in VARIANTS:
            for unit, other in (("stride_wk", "stride_wn"), ("stride_wn", "stride_wk")):  # W, then W^T
                config, options = tiles(dtype)
                arguments = {name: pointer for name in POINTERS} | {"M": "i32", "N": "i32", "K": "i32", "eps": "fp32",
                                                                    other: "i32"}
                constants = dict(zip(FLAGS, flags)) | {"DOT_FP32": dtype == torch.float32, unit: 1} | config
                record = build(_small_linear_kernel, capability, arguments, constants, (*POINTERS, "N", "K", other),
                               options)
                out.append(record | {"dtype": str(dtype), "flags": flags, "unit_stride": unit})
# The benchmark's other tunings: gate/up (the most shared memory) on W as stored, bfloat16, Hopper.
for tuning in SMALL_TUNINGS:
    config, options = tiles(torch.bfloat16, tuning)
    arguments = {name: "*bf16" for name in POINTERS} | {"M": "i32", "N": "i32", "K": "i32", "eps": "fp32",
                                                       "stride_wn": "i32"}
    constants = dict(zip(FLAGS, VARIANTS[-1])) | {"DOT_FP32": False, "stride_wk": 1} | config
    record = build(_small_linear_kernel, 90, arguments, constants, (*POINTERS, "N", "K", "stride_wn"), options)
    out.append(record | {"dtype": "torch.bfloat16", "flags": ["tuning", repr(tuning)], "unit_stride": "stride_wk"})
# The QKV projection with rotary and the KV write (W as stored: its unit stride along K), for heads of 64
# and 128 values, without and with a residual (the first layer's, the others'), with Qwen2's bias.
ROTARY_POINTERS = ("x_ptr", "res_ptr", "norm_ptr", "w_ptr", "bias_ptr", "q_ptr", "new_res_ptr", "positions_ptr",
                   "cos_sin_ptr", "cache_ptr", "slot_ptr")
ROTARY_STRIDES = ("stride_wn", "stride_cos_sin", "stride_cache_block", "stride_cache_kv", "stride_cache_offset",
                  "stride_cache_head")
INDICES = {"positions_ptr": "*i64", "slot_ptr": "*i64"}
for capability in (90, 80):
    for dtype in (torch.bfloat16, torch.float32):
        for head_dim in (64, 128):
            for residual, bias in ((False, True), (True, False)):
                config, options = tiles(dtype)
                del config["BLOCK_N"]
                arguments = {name: INDICES.get(name, TYPES[dtype]) for name in ROTARY_POINTERS}
                arguments |= {"M": "i32", "K": "i32", "eps": "fp32"} | {name: "i32" for name in ROTARY_STRIDES}
                constants = {"NUM_HEADS": 32, "NUM_KV_HEADS": 8, "HEAD_DIM": head_dim, "BLOCK_SIZE": 16,
                             "HAS_RESIDUAL": residual, "HAS_BIAS": bias, "DOT_FP32": dtype == torch.float32,
                             "stride_wk": 1} | config
                record = build(_qkv_rotary_kernel, capability, arguments, constants,
                               (*ROTARY_POINTERS, "K", *ROTARY_STRIDES), options)
                out.append(record | {"dtype": str(dtype), "flags": ["qkv_rotary", head_dim, residual, bias],
                                     "unit_stride": "stride_wk"})
# Rotary with the KV write (kernels/triton/elementwise.py, the layer loop's): 32 query and 8 KV heads in
# groups of 16, heads of 64 and 128.
WRITE_POINTERS = ("q_ptr", "k_ptr", "v_ptr", "positions_ptr", "cache_sin_cos_ptr", "cache_ptr", "slot_ptr")
WRITE_STRIDES = ("stride_q_token", "stride_q_head", "stride_k_token", "stride_k_head", "stride_v_token",
                 "stride_v_head", "stride_table_pos", "stride_cache_block", "stride_cache_kv", "stride_cache_offset",
                 "stride_cache_head")
for capability in (90, 80):
    for dtype in (torch.bfloat16, torch.float32):
        for head_dim in (64, 128):
            arguments = {name: INDICES.get(name, TYPES[dtype]) for name in WRITE_POINTERS}
            arguments |= {name: "i32" for name in WRITE_STRIDES}
            constants = {"NUM_HEADS": 32, "NUM_KV_HEADS": 8, "BLOCK_SIZE": 16, "HALF": head_dim // 2,
                         "BLOCK": head_dim // 2, "BLOCK_H": 16}
            record = build(_rotary_write_kv_kernel, capability, arguments, constants, (*WRITE_POINTERS, *WRITE_STRIDES),
                           {"num_warps": 4})
            out.append(record | {"dtype": str(dtype), "flags": ["rotary_write_kv", head_dim]})
print(json.dumps(out))
"""


def test_every_fused_variant_compiles_for_hopper_and_ampere_pipelined_within_their_shared_memory(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env |= {"TRITON_CACHE_DIR": str(tmp_path), "PYTHONPATH": str(REPO), "TRITON_DEFAULT_FP_FUSION": "1"}
    proc = subprocess.run([sys.executable, "-c", COMPILE], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    kernels = json.loads(proc.stdout.strip().splitlines()[-1])
    tunings = [kernel for kernel in kernels if kernel["flags"][0] == "tuning"]
    assert len(tunings) == 6
    for kernel in tunings:  # the benchmark's only: on an H100 or H200
        assert kernel["cubin"] > 0 and kernel["async_copies"] > 0 and 0 < kernel["shared"] <= 227 * 1024, kernel
    projections = [kernel for kernel in kernels if kernel["flags"][0] not in ("rotary_write_kv", "tuning")]
    assert len(projections) == 2 * 3 * 4 * 2 + 2 * 2 * 2 * 2
    for kernel in projections:
        assert kernel["cubin"] > 0, kernel
        assert kernel["async_copies"] > 0, kernel
        assert 0 < kernel["shared"] <= 99 * 1024, kernel
    rotary = [kernel for kernel in kernels if kernel["flags"][0] == "rotary_write_kv"]
    assert len(rotary) == 2 * 2 * 2
    for kernel in rotary:  # a row-wise kernel: little shared memory (layout scratch), loads several values wide
        assert kernel["cubin"] > 0 and kernel["shared"] <= 16 * 1024 and kernel["vector_loads"] > 0, kernel
