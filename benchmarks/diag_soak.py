"""Which allocations stay (or go) across one call of the GPU soak: the memory a call leaves behind.

Runs `tests/test_soak.py::test_soak_gpu` itself (its model, warm-up, call sequence, checked calls
and `soak()` loop, imported from tests/), for the first `--upto` calls, recording PyTorch's CUDA
allocation history. After every call it prints the change of allocated bytes (after a sync and a
small allocation, so deferred frees are processed) and of graphs captured; for each call in
`--calls` it prints the blocks that appeared or disappeared during the call, with the innermost
hf_paged_t5 / transformers / torch frames that allocated them.

    python benchmarks/diag_soak.py [--calls 21,26] [--upto 30] [--gc] [--unchecked]

--gc collects Python garbage before every measurement (is the drift reference cycles freed late?);
--unchecked skips the stock-HF comparisons (do they leave something behind?).
"""

from __future__ import annotations

import argparse
import collections
import gc
import pathlib
import sys

import torch

import common  # benchmarks/ is on sys.path
import hf_paged_t5 as hp

TESTS = pathlib.Path(__file__).resolve().parent.parent / "tests"


def where(frames) -> str:
    """The innermost three frames of the project, transformers or torch that allocated a block."""
    picked = [f"{f['filename'].split('/')[-1]}:{f.get('line')} {f.get('name')}" for f in frames
              if any(part in f.get("filename", "") for part in ("hf_paged_t5", "transformers", "tests/", "torch/"))]
    return " < ".join(picked[:3]) or "other"


def live_blocks() -> dict[int, tuple[int, str]]:
    """address -> (bytes, allocating frames) of every live CUDA allocation now."""
    blocks = {}
    for seg in torch.cuda.memory._snapshot()["segments"]:
        for block in seg["blocks"]:
            if block["state"] == "active_allocated":
                blocks[block["address"]] = (block["size"], where(block.get("frames", [])))
    return blocks


def print_diff(before: dict, after: dict) -> None:
    appeared, gone = collections.Counter(), collections.Counter()
    for addr, (size, frames) in after.items():
        if addr not in before or before[addr][0] != size:
            appeared[frames] += size
    for addr, (size, frames) in before.items():
        if addr not in after or after[addr][0] != size:
            gone[frames] += size
    for label, counter in (("appeared", appeared), ("gone", gone)):
        for frames, size in counter.most_common(12):
            print(f"    {label} {size:>10d} B  {frames}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", default="21,26", help="calls whose before/after blocks are compared")
    ap.add_argument("--upto", type=int, default=30, help="run calls 0 .. upto - 1")
    ap.add_argument("--gc", action="store_true", help="gc.collect() before every measurement")
    ap.add_argument("--unchecked", action="store_true", help="no stock-HF comparisons")
    args = ap.parse_args(argv)
    common.require_cuda("diag_soak.py")
    sys.path.insert(0, str(TESTS))
    from oracle import stock_copy  # noqa: E402
    from test_soak import Sizes, checked_calls, random_calls, soak, warm_up_graphs  # noqa: E402

    from hf_paged_t5 import tiny

    watch = {int(c) for c in args.calls.split(",") if c}
    sizes = Sizes(max_batch=16, min_src=5, max_src=300, max_new=64, beams=4, vocab=32128)
    model = tiny.build_model("t5-small", vocab_size=sizes.vocab, initializer_factor=1.5, device="cuda")
    stock_model = stock_copy(model)
    config = hp.PagedCacheConfig()
    hp.patch_model(model, config)
    warm_up_graphs(model, sizes, config.block_size)
    torch.cuda.memory._record_memory_history(max_entries=500_000)
    state = {"i": 0, "memory": None, "graphs": hp.runtime_stats(model)["graphs_captured"], "blocks": None}

    def measure() -> int:
        i = state["i"]
        if args.gc:
            gc.collect()
        torch.cuda.synchronize()
        torch.empty(1, device="cuda")  # processes the frees deferred for tensors used on another stream
        memory, graphs = torch.cuda.memory_allocated(), hp.runtime_stats(model)["graphs_captured"]
        if state["memory"] is not None:
            print(f"call {i}: memory {memory - state['memory']:+d} B, graphs {graphs - state['graphs']:+d}", flush=True)
        if i in watch and state["blocks"] is not None:
            print_diff(state["blocks"], live_blocks())
        state.update(i=i + 1, memory=memory, graphs=graphs, blocks=live_blocks() if i + 1 in watch else None)
        return memory

    calls = ((c.seed, c.kwargs(sizes.vocab, "cuda")) for c in random_calls(args.upto, sizes, seed=11))
    checked = set() if args.unchecked else checked_calls(1000, 30, seed=12)
    soak(model, stock_model, calls, checked, measure)
    torch.cuda.memory._record_memory_history(enabled=None)


if __name__ == "__main__":
    main()
