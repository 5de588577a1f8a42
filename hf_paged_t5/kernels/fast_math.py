"""`exp2` and `rsqrt` for the kernels, as the instructions Triton's own `tl.exp2` / `tl.math.rsqrt`
become, without libdevice.

On NVIDIA GPUs Triton lowers `tl.exp2` and `tl.math.rsqrt` on float32 to libdevice's `__nv_exp2f` /
`__nv_rsqrtf`, and a kernel that calls any libdevice function links the whole library's bitcode
into its LLVM module at compile time (`link_extern_libs`: ~35 ms of a CPU core a compile with
Triton 3.6, ~65 ms beside a cold pass's other compiles) before LLVM inlines the one instruction
each becomes under Triton's flush-to-zero setting: `ex2.approx.ftz.f32` and
`rsqrt.approx.ftz.f32`. These helpers write those instructions as inline PTX: the same
instruction, the same bits, and a kernel that calls nothing else of libdevice compiles without
the link (`tests/test_kernels.py::test_kernels_link_no_libdevice`; on a GPU
`test_gpu_fast_math_matches_triton`).

Triton's interpreter runs no inline PTX: under `TRITON_INTERPRET=1` (read when this module is
imported, as Triton reads it when it decorates the kernels) they are Triton's own functions.
Both take and return float32.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._checks import interpreting

if interpreting():

    @triton.jit
    def exp2(x):
        return tl.exp2(x)

    @triton.jit
    def rsqrt(x):
        return tl.math.rsqrt(x)

else:

    @triton.jit
    def exp2(x):
        return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32,
                                         is_pure=True, pack=1)

    @triton.jit
    def rsqrt(x):
        return tl.inline_asm_elementwise("rsqrt.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32,
                                         is_pure=True, pack=1)
