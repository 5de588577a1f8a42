"""Registers and spills of the decode step's Triton kernels at sm_90, compiled here, no GPU needed.

Triton compiles for a target it is given (`GPUTarget("cuda", 90, 32)`) with the `ptxas` and
`cuobjdump` its wheel carries, so a machine without a GPU can read what the H200 would run: the
registers per thread, the stack frame, the local-memory loads and stores (spills) in the SASS, and
whether the programmatic-dependent-launch instructions are there. Each row is one launch
configuration the package picks (`kernels.linear`, `kernels.gemv`, `kernels.decode`,
`kernels.rmsnorm`) at the t5-large / flan-t5-xl decode shapes.

    python benchmarks/diag_ptxas.py [--arch 90] [--prefill] [--match TEXT]

`--prefill` reports the encoder's prefill kernel instead (bf16, 64-wide heads, T5's bidirectional
table): the default configuration with its band split into three loops, the same with one loop
(`PrefillConfig.one_loop`), 128 x 32 tiles on 8 warps, and the gathered bias without the split.
Every row also gives the seconds `triton.compile` took here (`TRITON_ALWAYS_COMPILE`: no cache
hits; not the `cuobjdump` reads after it; the median of `--repeats`, after one untimed compile
that pays the process's one-time start-up) and whether the compile linked libdevice's bitcode:
the prefill binary is the longest compile of a cold process's first call.

To read what the GPU machine's Triton makes (another version than this machine's), install that
version's wheel into a folder of its own and put it first on the path, e.g.
`pip install --no-deps --target /tmp/triton36 triton==3.6.0` then
`PYTHONPATH=/tmp/triton36 python benchmarks/diag_ptxas.py`.
"""

from __future__ import annotations

import argparse
import importlib
import os
import subprocess
import tempfile
import time

import common  # benchmarks/ is on sys.path (the scripts' import rule)


def compile_report(kernel, constexprs: dict, types: dict, num_warps: int, arch: int, pdl: bool,
                   unaligned: frozenset = frozenset(), num_stages: int = 3) -> dict:
    """One kernel compiled for sm_`arch`: its registers, stack, spill instructions and PDL instructions.

    Specialized as the package's launches are: every pointer and every integer argument
    16-divisible (tensors from torch's allocator, strides and sizes of the t5 shapes), except the
    kernel's `do_not_specialize` arguments and `unaligned` (a stride the launch does not make a
    multiple of 16). Without that, Triton cannot prove 16-byte alignment and compiles scalar loads.
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = kernel.arg_names
    signature = {n: "constexpr" if n in constexprs else types.get(n, "*bf16" if n.endswith("_ptr") else "i32")
                 for n in names}
    plain = set(unaligned) | {names[i] if isinstance(i, int) else i for i in getattr(kernel, "do_not_specialize", ())}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if signature[n].startswith("*") or (signature[n] == "i32" and n not in plain)}
    source = ASTSource(fn=kernel, signature=signature,
                       constexprs={(names.index(k),): v for k, v in constexprs.items()}, attrs=attrs)
    links = []  # libdevice links of this compile (`kernels.fast_math`: the package's kernels need none)
    import triton.backends.nvidia.compiler as nvidia

    real_link = nvidia.llvm.link_extern_libs
    nvidia.llvm.link_extern_libs = lambda module, paths: (links.append(paths), real_link(module, paths))
    try:
        start = time.perf_counter()
        compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32),
                                  options=dict(num_warps=num_warps, num_stages=num_stages, launch_pdl=pdl))
        compile_s = time.perf_counter() - start  # the compile alone, not the cuobjdump reads below
    finally:
        nvidia.llvm.link_extern_libs = real_link
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        usage = subprocess.run([os.path.join(tools, "cuobjdump"), "-res-usage", f.name],
                               capture_output=True, text=True).stdout
        sass = subprocess.run([os.path.join(tools, "cuobjdump"), "-sass", f.name],
                              capture_output=True, text=True).stdout
    fields = dict(item.split(":") for line in usage.splitlines() if "REG:" in line for item in line.split()
                  if ":" in item and item.split(":")[1].isdigit())
    return dict(registers=int(fields.get("REG", -1)), stack=int(fields.get("STACK", -1)),
                spill_loads=sass.count("LDL"), spill_stores=sass.count("STL"),
                pdl_instructions=compiled.asm["ptx"].count("griddepcontrol"), compile_s=compile_s,
                libdevice=bool(links))


def cases() -> list[tuple]:
    """(label, kernel, constexprs, argument types, num_warps, pdl, unaligned integer arguments,
    num_stages) the decode step launches."""
    from hf_paged_t5.kernels.gemv import gemv_config

    linear = importlib.import_module("hf_paged_t5.kernels.linear")
    gemv = importlib.import_module("hf_paged_t5.kernels.gemv")
    decode = importlib.import_module("hf_paged_t5.kernels.decode")
    rmsnorm = importlib.import_module("hf_paged_t5.kernels.rmsnorm")
    out = []
    shapes = [("t5-large", 1024, 4096, False), ("flan-t5-xl", 2048, 5120, True)]
    for model, d_model, d_ff, gated in shapes:
        for rows in (1, 4):
            block_m = 1 if rows == 1 else 4
            steps = [("qkv+store", d_model, d_model, linear._STORE_KV, True), ("o+residual", d_model, d_model,
                     linear._RESIDUAL, False), ("wi+act", d_ff, d_model, linear._GATED_GELU if gated else linear._RELU,
                     True), ("wo+residual", d_model, d_ff, linear._RESIDUAL, False)]
            for what, n, k, epilogue, norm in steps:
                block_n, block_k, warps = linear.fused_config(rows, n, k, epilogue == linear._GATED_GELU)
                const = dict(NORM=norm, EPILOGUE=epilogue, CACHE_BLOCK=16, BLOCK_M=block_m, BLOCK_N=block_n,
                             BLOCK_K=block_k, ONE_K=k <= block_k, PDL=True,
                             EARLY=epilogue in (linear._STORE_KV, linear._RESIDUAL))
                out.append((f"fused_linear {model} {what} rows {rows}", linear._fused_linear_kernel, const,
                            dict(eps="fp32", slot_mapping_ptr="*i32"), warps, True, frozenset(), 3))
        block_n, block_k, warps = gemv_config(1, d_model, d_model)
        out.append((f"gemv {model} rows 1", gemv._gemv_kernel, dict(BLOCK_M=1, BLOCK_N=block_n, BLOCK_K=block_k),
                    {}, warps, False, frozenset(), 3))
    decode_types = dict(scale="fp32", block_table_ptr="*i32", seq_lens_ptr="*i32", bias_ptr="*fp32",
                        part_ptr="*fp32", ticket_ptr="*i32", slot_mapping_ptr="*i32")
    # a step's launches pass its counters, so the fused merge is compiled in at any split count;
    # the self-attention table [heads, max_distance + 1] has rows of 129 (not 16-divisible)
    table = frozenset({"stride_bias_head", "stride_bias_key"})
    for label, block_n, warps, bias, prefetch, stages, store in (
        ("self", 128, 4, 1, 0, 1, False), ("cross", 128, 4, 0, 0, 1, False),
        # many rows (`decode_config`'s async loads): self-attention over <= 256 keys, then over more,
        # each as it stores the step's new K/V itself and without
        ("self, many rows, 32-key tiles (async loads, 2 deep)", 32, 1, 1, 2, 2, False),
        ("self, many rows, 32-key tiles (async loads, 2 deep), storing", 32, 1, 1, 2, 2, True),
        ("self, many rows (async loads, 2 deep)", 128, 4, 1, 2, 2, False),
        ("self, many rows (async loads, 2 deep), storing", 128, 4, 1, 2, 2, True),
        ("cross, many rows (async loads, 2 deep)", 128, 4, 0, 2, 2, False),
        # one split of two 256-key tiles (ab_replay.py --variant one-split-two-tiles), and on 4 warps
        ("cross, one split, 256-key tiles", 256, 8, 0, 0, 1, False),
        ("cross, one split, 256-key tiles", 256, 4, 0, 0, 1, False),
    ):
        const = dict(BIAS_MODE=bias, BLOCK_SIZE=16, BLOCK_N=block_n, BLOCK_D=64,
                     MERGE_CHUNK=16, FUSED_COMBINE=True, PREFETCH=prefetch, NUM_STAGES=stages, PDL=True,
                     READY=1 if bias else 2, STORE=store)  # the step's self- ("past") and cross-attention ("all")
        out.append((f"paged_decode {label}", decode._paged_decode_kernel, const, decode_types, warps, True,
                    table if bias else frozenset(), stages))
    out.append(("rms_norm d_model 1024", rmsnorm._rms_norm_kernel,
                dict(HAS_RESIDUAL=False, SPLITS=0, HALF_WEIGHT=True, BLOCK=1024, PDL=True), dict(eps="fp32"), 4,
                True, frozenset(), 3))
    out.append(("rms_norm d_model 1024, wo's two float32 partials", rmsnorm._rms_norm_kernel,
                dict(HAS_RESIDUAL=True, SPLITS=2, HALF_WEIGHT=True, BLOCK=1024, PDL=True),
                dict(eps="fp32", residual_ptr="*fp32"), 4, True, frozenset(), 3))
    return out


def prefill_cases() -> list[tuple]:
    """The encoder's prefill launches (bf16, head_dim 64, bidirectional table), as `cases`."""
    from hf_paged_t5.kernels.prefill import PrefillConfig

    prefill = importlib.import_module("hf_paged_t5.kernels.prefill")
    types = dict(scale="fp32", cu_seqlens_ptr="*i32", wide_ptr="*fp32")
    # the table [heads, 2 * 128 + 1] has rows of 257 (not 16-divisible); a key stride of 1
    unaligned = frozenset({"stride_bias_head", "stride_bias_key"})
    out = []
    for label, config in (
        ("prefill 64x32, band tiles in three loops (default)", PrefillConfig(64, 32, 4, 3, band_tiles=True)),
        ("prefill 64x32, band tiles in one loop", PrefillConfig(64, 32, 4, 3, band_tiles=True, one_loop=True)),
        ("prefill 64x32, band tiles in one loop, 2 stages", PrefillConfig(64, 32, 4, 2, band_tiles=True, one_loop=True)),
        ("prefill 64x32, band tiles in one loop, 1 stage", PrefillConfig(64, 32, 4, 1, band_tiles=True, one_loop=True)),
        ("prefill 128x32, band tiles in three loops", PrefillConfig(128, 32, 8, 3, band_tiles=True)),
        ("prefill 64x32, gathered bias, no band split", PrefillConfig(64, 32, 4, 3, band_split=False)),
    ):
        band_tiles = config.band_tiles and config.tile_ranges and config.band_split
        const = dict(CAUSAL=False, BIAS_MODE=1, BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_D=64,
                     EVEN_D=True, NUM_STAGES=config.num_stages, TILE_RANGES=config.tile_ranges,
                     BAND_SPLIT=config.band_split, TOEPLITZ=False, BAND_TILES=band_tiles,
                     ONE_LOOP=band_tiles and config.one_loop, INPUT_PRECISION="tf32")
        out.append((label, prefill._prefill_kernel, const, types, config.num_warps, False, unaligned,
                    config.num_stages))
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", type=int, default=90, help="compute capability to compile for (90: Hopper)")
    ap.add_argument("--prefill", action="store_true", help="the encoder's prefill kernel instead of the step's")
    ap.add_argument("--repeats", type=int, default=1, help="compiles per row (the median's seconds are reported)")
    ap.add_argument("--match", default="", help="only the rows whose label holds this text")
    args = ap.parse_args(argv)
    os.environ["TRITON_ALWAYS_COMPILE"] = "1"  # each row's compile timed in full, no cache hit
    todo = [case for case in (prefill_cases() if args.prefill else cases()) if args.match in case[0]]
    try:  # Triton's one-time start-up (its backends, ptxas's version) is not the first row's
        compile_report(*todo[0][1:4], todo[0][4], args.arch, *todo[0][5:])
    except Exception:
        pass  # the row itself reports it
    rows = []
    for label, kernel, const, types, warps, pdl, unaligned, stages in todo:
        try:
            reports = [compile_report(kernel, const, types, warps, args.arch, pdl, unaligned, stages)
                       for _ in range(max(args.repeats, 1))]
            report = dict(reports[-1], compile_s=round(common.median([r["compile_s"] for r in reports]), 2))
            rows.append(dict(kernel=label, warps=warps, **report))
        except Exception as exc:  # a configuration that does not compile is reported, not fatal
            rows.append(dict(kernel=label, warps=warps, error=f"{type(exc).__name__}: {str(exc)[-300:]}"))
    common.print_table(
        ["kernel", "warps", "registers", "stack", "spill loads", "spill stores", "PDL instr.", "compile s", "libdevice",
         "error"],
        ([r["kernel"], r["warps"], r.get("registers"), r.get("stack"), r.get("spill_loads"), r.get("spill_stores"),
          r.get("pdl_instructions"), r.get("compile_s"), r.get("libdevice"), r.get("error", "")] for r in rows),
        title=f"sm_{args.arch}: the {'prefill' if args.prefill else 'decode step'}'s kernels as the package launches them")


if __name__ == "__main__":
    main()
