"""Decode attention configs timed as a decode step launches them, and the encoder's prefill
configs at T5 v1.1 XXL's head count; each per call inside a CUDA graph.

    python benchmarks/tune_step_decode.py [--out DIR]

Decode (bf16, 16 heads x 64, block size 16): 1, 2, 4, 8, 16 and 32 rows x 512 keys without bias
(cross-attention) and 1 and 16 rows x 128 keys with the causal table in a 256-key table (self),
each launched with programmatic dependent launch and a step's tickets (the fused split merge),
as `model/fused_layer.py` and the op-by-op step launch it: 4 or 8 warps x 1, 2 or 4 splits x
64- or 128-key tiles, against `decode_config`'s pick; the calls cycle over copies of the K/V
that pass 3x the L2 size (tune_kernels.py's inputs and timing), so each reads cold K/V.
Prefill: T5 v1.1 XXL's encoder at 1 x 512 and 1 x 77 (64 heads) as 4 sequences at 16 heads
(the same (sequence, head) programs), bidirectional table: tiles 64/128 x 32/64/128, 4/8 warps,
2/3 stages, band tiles on/off, against `prefill_config`'s pick and SDPA without bias.
Writes DIR/step_decode.json (default DIR: benchmarks/results/<date>-<gpu>/, with its env.json).
"""

from __future__ import annotations

import argparse

import torch

import common  # benchmarks/ is on sys.path
import tune_kernels as tk  # its inputs, timing and tolerances (without CUDA it sets TRITON_INTERPRET)
from hf_paged_t5 import reference
from hf_paged_t5.kernels import paged_decode, prefill
from hf_paged_t5.kernels.decode import DecodeConfig, decode_config
from hf_paged_t5.kernels.prefill import PrefillConfig, prefill_config

DECODE_SHAPES = [dict(name=f"{b}x512 cross", batch=b, keys=512, head_dim=64, bias=False) for b in (1, 2, 4, 8, 16, 32)]
DECODE_SHAPES += [dict(name=f"{b}x128 self", batch=b, keys=128, head_dim=64, bias=True, capacity=256) for b in (1, 16)]
PREFILL_SHAPES = [dict(name="4x512", batch=4, length=512, head_dim=64), dict(name="4x77", batch=4, length=77, head_dim=64)]


def decode_rows() -> list[dict]:
    rows = []
    for shape in DECODE_SHAPES:
        kv_bytes = 2 * shape["batch"] * shape["keys"] * tk.HEADS * shape["head_dim"] * 2
        copies = max(1, min(256, -(-3 * tk.l2_bytes() // kv_bytes)))
        data = tk.decode_inputs(shape, torch.bfloat16, copies)
        args, tables = tk.decode_args(data), data["tables"]
        order = tk.graph_calls_per_copy(copies)
        tickets = torch.zeros(shape["batch"] * tk.HEADS, dtype=torch.int32, device=tk.DEVICE)
        ref = reference.paged_decode(data["query"].float(), data["key_cache"], data["value_cache"], tables[0],
                                     data["seq_lens"], **data["bias"])
        base = decode_config(shape["batch"], tk.HEADS, shape["head_dim"], tables.shape[2] * tk.BLOCK_SIZE, tk.num_sms())
        row = {"shape": shape["name"], "default": base.__dict__, "us": {}}
        for warps in (4, 8):
            for splits in (1, 2, 4):
                for block_n in (64, 128):
                    cfg = DecodeConfig(block_n=block_n, num_warps=warps, num_splits=splits, fused_combine=splits > 1)
                    name = f"w{warps} s{splits} n{block_n}"
                    try:
                        out = paged_decode(block_table=tables[0], config=cfg, pdl=True, tickets=tickets, **args)
                        if not tk.rel_err(out, ref) < tk.TOLERANCE[torch.bfloat16]:
                            row["us"][name] = "wrong result"
                            continue
                        calls = [(lambda i=i: paged_decode(block_table=tables[i], config=cfg, pdl=True, tickets=tickets,
                                                           **args)) for i in order]
                        row["us"][name] = round(common.graph_us(calls), 2)
                    except Exception as exc:  # out of resources: record and go on
                        row["us"][name] = tk.error_text(exc)
        print(row["shape"], "default", base, flush=True)
        for name, us in sorted(row["us"].items(), key=lambda kv: kv[1] if isinstance(kv[1], float) else 1e9):
            print("   ", name, us)
        rows.append(row)
    return rows


def prefill_rows() -> list[dict]:
    rows = []
    for shape in PREFILL_SHAPES:
        args = tk.prefill_args(shape, torch.bfloat16)
        base = prefill_config(shape["head_dim"], torch.bfloat16, shape["length"])
        configs = [base] + [
            PrefillConfig(block_m=bm, block_n=bn, num_warps=w, num_stages=st, band_tiles=tiles, band_split=tiles)
            for bm in (64, 128) for bn in (32, 64, 128) for w in (4, 8) for st in (2, 3) for tiles in (True, False)
            if not (tiles and bm % bn)
        ]  # fmt: skip
        row = {"shape": shape["name"], "default": base.__dict__, "us": []}
        for cfg in configs:
            try:
                row["us"].append((round(tk.prefill_graph_ms(lambda: prefill(**args, config=cfg)) * 1e3, 2), cfg.__dict__))
            except Exception as exc:
                row["us"].append((float("inf"), cfg.__dict__, tk.error_text(exc)))
        q, k, v = (t.view(shape["batch"], shape["length"], tk.HEADS, shape["head_dim"]).transpose(1, 2)
                   for t in (args["query"], args["key"], args["value"]))
        row["sdpa_nobias_us"] = tk.prefill_graph_ms(
            lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=1.0)) * 1e3
        row["default_us"] = row["us"][0][0]
        row["us"].sort(key=lambda t: t[0])
        print(shape["name"], "default", row["default_us"], "sdpa without bias", round(row["sdpa_nobias_us"], 2), flush=True)
        for entry in row["us"][:8]:
            print("   ", entry)
        rows.append(row)
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="folder for step_decode.json (default: benchmarks/results/<date>-<gpu>)")
    args = ap.parse_args(argv)
    common.require_cuda("tune_step_decode.py")
    out_dir = common.start_suite(args.out, "step-decode")
    result = {"decode": decode_rows(), "prefill": prefill_rows()}
    common.write_json(out_dir / "step_decode.json", result)


if __name__ == "__main__":
    main()
