"""The Triton small-batch projection kernels (kernels/triton/small_linear.py) compiled for a GPU
without one: every variant the fused decode layers launch, in each dtype and on both weight forms
(the QKV projection with rotary and the KV write: on W as stored, for heads of 64 and 128),
through Triton's own compiler and ptxas to a Hopper (sm_90) and an Ampere (sm_80) binary, specialized
as Triton's launcher specializes a real launch (16-byte aligned tensors, sizes and strides divisible
by 16, the unit stride a constant). Each must stream its weight through shared memory with
asynchronous copies (a pipelined loop: without it the kernel waits on every load) and keep within
the 99 KiB of shared memory the smallest of those GPUs give a program. The interpreter (the other
kernel tests) checks what the kernel computes; this checks that a GPU can build and launch it. The
layer loop's rotary-and-write kernel (heads in groups) is compiled alongside, its loads vectorized."""

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
from kernels.triton.small_linear import _qkv_rotary_kernel, _small_linear_kernel, launch_config

TYPES = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32"}
POINTERS = ("x_ptr", "res_ptr", "norm_ptr", "w_ptr", "bias_ptr", "out_ptr", "new_res_ptr")
FLAGS = ("NORM", "HAS_RESIDUAL", "GATED", "HAS_BIAS")
VARIANTS = [  # O and down; QKV (the first layer's, with Qwen2's bias); QKV of the other layers; gate/up
    (False, False, False, False), (True, False, False, True), (True, True, False, False), (True, True, True, False)]
out = []
for capability in (90, 80):
    for dtype, pointer in TYPES.items():
        for flags in VARIANTS:
            for unit, other in (("stride_wk", "stride_wn"), ("stride_wn", "stride_wk")):  # W, then W^T
                config = launch_config(dtype, 8192)
                options = {"num_warps": config.pop("num_warps"), "num_stages": config.pop("num_stages")}
                signature = {name: pointer for name in POINTERS} | {"M": "i32", "N": "i32", "K": "i32", "eps": "fp32"}
                signature |= {"stride_wk": "i32", "stride_wn": "i32"}
                constants = dict(zip(FLAGS, flags)) | {"DOT_FP32": dtype == torch.float32, unit: 1} | config
                signature |= {name: "constexpr" for name in constants}
                names = list(signature)
                divisible = {(names.index(name),): [["tt.divisibility", 16]] for name in (*POINTERS, "N", "K", other)}
                kernel = triton.compile(ASTSource(_small_linear_kernel, signature, constants, divisible),
                                        target=GPUTarget("cuda", capability, 32), options=options)
                out.append({"sm": capability, "dtype": str(dtype), "flags": flags, "unit_stride": unit,
                            "shared": kernel.metadata.shared, "cubin": len(kernel.asm["cubin"]),
                            "async_copies": kernel.asm["ptx"].count("cp.async")})
# The QKV projection with rotary and the KV write (W as stored: its unit stride along K), for heads of 64
# and 128 values, without and with a residual (the first layer's, the others'), with Qwen2's bias.
ROTARY_POINTERS = ("x_ptr", "res_ptr", "norm_ptr", "w_ptr", "bias_ptr", "q_ptr", "new_res_ptr", "positions_ptr",
                   "cos_sin_ptr", "cache_ptr", "slot_ptr")
for capability in (90, 80):
    for dtype in (torch.bfloat16, torch.float32):
        for head_dim in (64, 128):
            for residual, bias in ((False, True), (True, False)):
                config = launch_config(dtype, 8192)
                options = {"num_warps": config.pop("num_warps"), "num_stages": config.pop("num_stages")}
                del config["BLOCK_N"]
                types = {"positions_ptr": "*i64", "slot_ptr": "*i64"}
                signature = {name: types.get(name, TYPES[dtype]) for name in ROTARY_POINTERS}
                signature |= {"M": "i32", "K": "i32", "eps": "fp32", "stride_wk": "i32", "stride_wn": "i32",
                              "stride_cos_sin": "i32", "stride_cache_block": "i32", "stride_cache_kv": "i32",
                              "stride_cache_offset": "i32", "stride_cache_head": "i32"}
                constants = {"NUM_HEADS": 32, "NUM_KV_HEADS": 8, "HEAD_DIM": head_dim, "BLOCK_SIZE": 16,
                             "HAS_RESIDUAL": residual, "HAS_BIAS": bias, "DOT_FP32": dtype == torch.float32,
                             "stride_wk": 1} | config
                signature |= {name: "constexpr" for name in constants}
                names = list(signature)
                divisible = {(names.index(name),): [["tt.divisibility", 16]]
                             for name in (*ROTARY_POINTERS, "K", "stride_wn", "stride_cos_sin", "stride_cache_block",
                                          "stride_cache_kv", "stride_cache_offset", "stride_cache_head")}
                kernel = triton.compile(ASTSource(_qkv_rotary_kernel, signature, constants, divisible),
                                        target=GPUTarget("cuda", capability, 32), options=options)
                out.append({"sm": capability, "dtype": str(dtype), "flags": ["qkv_rotary", head_dim, residual, bias],
                            "unit_stride": "stride_wk", "shared": kernel.metadata.shared,
                            "cubin": len(kernel.asm["cubin"]), "async_copies": kernel.asm["ptx"].count("cp.async")})
# Rotary with the KV write (kernels/triton/elementwise.py, the layer loop's): 32 query and 8 KV heads in
# groups of 16, heads of 64 and 128.
from kernels.triton.elementwise import _rotary_write_kv_kernel
for capability in (90, 80):
    for dtype in (torch.bfloat16, torch.float32):
        for head_dim in (64, 128):
            pointers = ("q_ptr", "k_ptr", "v_ptr", "positions_ptr", "cache_sin_cos_ptr", "cache_ptr", "slot_ptr")
            types = {"positions_ptr": "*i64", "slot_ptr": "*i64"}
            signature = {name: types.get(name, TYPES[dtype]) for name in pointers}
            strides = ("stride_q_token", "stride_q_head", "stride_k_token", "stride_k_head", "stride_v_token",
                       "stride_v_head", "stride_table_pos", "stride_cache_block", "stride_cache_kv",
                       "stride_cache_offset", "stride_cache_head")
            signature |= {name: "i32" for name in strides}
            constants = {"NUM_HEADS": 32, "NUM_KV_HEADS": 8, "BLOCK_SIZE": 16, "HALF": head_dim // 2,
                         "BLOCK": head_dim // 2, "BLOCK_H": 16}
            signature |= {name: "constexpr" for name in constants}
            names = list(signature)
            divisible = {(names.index(name),): [["tt.divisibility", 16]] for name in (*pointers, *strides)}
            kernel = triton.compile(ASTSource(_rotary_write_kv_kernel, signature, constants, divisible),
                                    target=GPUTarget("cuda", capability, 32), options={"num_warps": 4})
            out.append({"sm": capability, "dtype": str(dtype), "flags": ["rotary_write_kv", head_dim],
                        "shared": kernel.metadata.shared, "cubin": len(kernel.asm["cubin"]),
                        "vector_loads": kernel.asm["ptx"].count("ld.global.v")})
print(json.dumps(out))
"""


def test_every_fused_variant_compiles_for_hopper_and_ampere_pipelined_within_their_shared_memory(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env |= {"TRITON_CACHE_DIR": str(tmp_path), "PYTHONPATH": str(REPO), "TRITON_DEFAULT_FP_FUSION": "1"}
    proc = subprocess.run([sys.executable, "-c", COMPILE], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    kernels = json.loads(proc.stdout.strip().splitlines()[-1])
    projections = [kernel for kernel in kernels if kernel["flags"][0] != "rotary_write_kv"]
    assert len(projections) == 2 * 3 * 4 * 2 + 2 * 2 * 2 * 2
    for kernel in projections:
        assert kernel["cubin"] > 0, kernel
        assert kernel["async_copies"] > 0, kernel
        assert 0 < kernel["shared"] <= 99 * 1024, kernel
    rotary = [kernel for kernel in kernels if kernel["flags"][0] == "rotary_write_kv"]
    assert len(rotary) == 2 * 2 * 2
    for kernel in rotary:  # a row-wise kernel: little shared memory (layout scratch), loads several values wide
        assert kernel["cubin"] > 0 and kernel["shared"] <= 16 * 1024 and kernel["vector_loads"] > 0, kernel
