"""Compile every CUDA kernel of rlrunbook.kernels.gpu for a GPU architecture, on any machine (Triton ships ptxas).

    python tests/unit/kernels/compile_cuda.py 90   # H100, H200
    python tests/unit/kernels/compile_cuda.py 80   # A100
    python tests/unit/kernels/compile_cuda.py 89   # L4, L40S, RTX 4090

Prints one line per kernel and dtype: its name, whether it uses the tensor cores, and its shared memory in bytes.
Run without TRITON_INTERPRET (interpreted kernels cannot be compiled).
"""

from __future__ import annotations

import sys

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from rlrunbook.kernels import gpu, gpu_layer

HEAD_DIM = 128  # the larger of the built-in shapes (Qwen2.5-1.5B; SmolLM2 has 64)


_TORCH = {"bf16": "bfloat16", "fp32": "float32"}


def kernels(dtype: str):
    ints = lambda *names: {name: "i32" for name in names}
    attention = {"q_ptr": f"*{dtype}", "k_ptr": f"*{dtype}", "v_ptr": f"*{dtype}", "qpos_ptr": "*i64",
                 "kpos_ptr": "*i64", "kvalid_ptr": "*i8"}
    blocks = {"D": "constexpr", "DP": "constexpr", "BT": "constexpr", "BS": "constexpr", "F32DOT": "constexpr"}
    shape = {"D": HEAD_DIM, "DP": HEAD_DIM, "F32DOT": False}
    torch_dtype = getattr(torch, _TORCH[dtype])
    forward, backward = gpu.ATTN_BLOCKS["forward"][torch_dtype], gpu.ATTN_BLOCKS["backward"][torch_dtype]
    matmul = {"a_ptr": f"*{dtype}", "b_ptr": f"*{dtype}", "bias_ptr": "*fp32", "base_ptr": f"*{dtype}",
              "c_ptr": f"*{dtype}", **ints("M", "N", "K", "sam", "sak", "sbk", "sbn", "sbase", "scm", "scn"),
              "scaling": "fp32", "HAS_BIAS": "constexpr", "HAS_BASE": "constexpr", "DELTA": "constexpr",
              "BM": "constexpr", "BN": "constexpr", "BK": "constexpr", "F32DOT": "constexpr"}
    tiles = {"BM": gpu.BLOCK_M, "BN": gpu.BLOCK_N, "BK": gpu.BLOCK_K, "F32DOT": False, "DELTA": gpu._TL_DTYPES[torch_dtype]}
    yield gpu._matmul_kernel, matmul, {"HAS_BIAS": True, "HAS_BASE": False, **tiles}
    yield gpu._matmul_kernel, matmul, {"HAS_BIAS": False, "HAS_BASE": True, **tiles}  # a LoRA update added
    if dtype == "fp32":  # a bf16 input read as float32 by a float32 factor (LoRA's first, beside a bf16 model)
        yield gpu._matmul_kernel, {**matmul, "a_ptr": "*bf16"}, {"HAS_BIAS": False, "HAS_BASE": False, **tiles}
    yield gpu._row_sumsq_kernel, {"x_ptr": f"*{dtype}", "out_ptr": "*fp32", "E": "i32", "sx": "i32",
                                  "BLOCK": "constexpr"}, {"BLOCK": gpu.ROW_BLOCK}
    yield gpu._row_logsumexp_kernel, {"x_ptr": "*fp32", "out_ptr": "*fp32", "V": "i32", "sx": "i32",
                                      "BLOCK": "constexpr"}, {"BLOCK": gpu.ROW_BLOCK}
    yield gpu._attention_fwd_kernel, {
        **attention, "out_ptr": f"*{dtype}", "lse_ptr": "*fp32",
        **ints("T", "S", "H", "G", "sq_r", "sq_t", "sk_r", "sk_s", "sp_r"), "scale": "fp32", **blocks}, {
        **shape, "BT": forward[0], "BS": forward[1]}
    gradients = {"do_ptr": f"*{dtype}", "delta_ptr": "*fp32", "lse_ptr": "*fp32"}
    yield gpu._attention_dkdv_kernel, {
        **attention, **gradients, "dk_ptr": f"*{dtype}", "dv_ptr": f"*{dtype}",
        **ints("T", "S", "H", "G", "sq_r", "sq_t", "sk_r", "sk_s", "sp_r", "sdk_r", "sdk_s"), "scale": "fp32",
        **blocks}, {
        **shape, "BT": backward[0], "BS": backward[1]}
    yield gpu._attention_dq_kernel, {
        **attention, **gradients, "dq_ptr": f"*{dtype}",
        **ints("T", "S", "H", "G", "sq_r", "sq_t", "sk_r", "sk_s", "sp_r"), "scale": "fp32", **blocks}, {
        **shape, "BT": backward[0], "BS": backward[1]}


    rows = {"E": "i32", "BLOCK": "constexpr"}
    yield gpu_layer._rms_norm_kernel, {
        "x_ptr": f"*{dtype}", "w_ptr": f"*{dtype}", "out_ptr": f"*{dtype}", "rstd_ptr": "*fp32", **rows,
        **ints("sx", "so"), "eps": "fp32"}, {"BLOCK": gpu_layer.ROW_BLOCK}
    yield gpu_layer._rms_norm_backward_kernel, {
        "x_ptr": f"*{dtype}", "w_ptr": f"*{dtype}", "rstd_ptr": "*fp32", "g_ptr": f"*{dtype}", "dx_ptr": f"*{dtype}",
        **rows, **ints("sx", "sg", "sdx")}, {"BLOCK": gpu_layer.ROW_BLOCK}
    for backward in (False, True):
        yield gpu_layer._rotary_kernel, {
            "x_ptr": f"*{dtype}", "cos_ptr": f"*{dtype}", "sin_ptr": f"*{dtype}", "out_ptr": f"*{dtype}",
            **ints("sxr", "sxh", "sc", "sor", "soh"), "HALF": "constexpr", "HP": "constexpr",
            "BACKWARD": "constexpr"}, {"HALF": HEAD_DIM // 2, "HP": HEAD_DIM // 2, "BACKWARD": backward}
        yield gpu_layer._silu_mul_kernel, {
            "gate_ptr": f"*{dtype}", "up_ptr": f"*{dtype}", "g_ptr": f"*{dtype}", "out_ptr": f"*{dtype}",
            "d_up_ptr": f"*{dtype}", **ints("I", "sg_r", "su_r", "sgr_r", "so_r"), "BLOCK": "constexpr",
            "BACKWARD": "constexpr"}, {"BLOCK": gpu_layer.ELEMENT_BLOCK, "BACKWARD": backward}


def main(arch: int) -> None:
    target = GPUTarget("cuda", arch, 32)
    for dtype in ("bf16", "fp32"):
        for fn, signature, constexprs in kernels(dtype):
            compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs), target=target,
                                      options={"num_warps": gpu.NUM_WARPS})
            ptx = compiled.asm["ptx"]
            tensor_cores = "mma" in ptx
            print(f"{fn.__name__} {dtype} tensor_cores={tensor_cores} shared={compiled.metadata.shared}", flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]))
