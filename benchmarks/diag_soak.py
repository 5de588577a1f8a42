"""Which allocations stay (or go) across one call of the GPU soak: the memory a call leaves behind.

Runs `tests/test_soak.py::test_soak_gpu`'s model and call sequence (its helpers are imported from
tests/, so the calls are exactly the soak's), without the stock-HF comparisons, recording PyTorch's
CUDA allocation history. After every call it reads the allocated bytes (after a sync and a small
allocation, so deferred frees are processed) and the graphs captured. For each call in `--calls`,
it compares the live blocks before and after the call and prints the blocks that appeared or
disappeared, with the innermost hf_paged_t5 / transformers frame that allocated them.

    python benchmarks/diag_soak.py [--calls 21,26] [--upto 30]
"""

from __future__ import annotations

import argparse
import collections
import pathlib
import sys

import torch

import common  # benchmarks/ is on sys.path
import hf_paged_t5 as hp
from diag_memory import caller

TESTS = pathlib.Path(__file__).resolve().parent.parent / "tests"


def live_blocks() -> dict[int, tuple[int, str]]:
    """address -> (bytes, allocating frame) of every live CUDA allocation now."""
    blocks = {}
    for seg in torch.cuda.memory._snapshot()["segments"]:
        for block in seg["blocks"]:
            if block["state"] == "active_allocated":
                blocks[block["address"]] = (block["size"], caller(block.get("frames", [])))
    return blocks


def measure() -> int:
    torch.cuda.synchronize()
    torch.empty(1, device="cuda")  # processes the frees deferred for tensors used on another stream
    return torch.cuda.memory_allocated()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", default="21,26", help="calls whose before/after blocks are compared")
    ap.add_argument("--upto", type=int, default=30, help="run calls 0 .. upto - 1")
    args = ap.parse_args(argv)
    common.require_cuda("diag_soak.py")
    sys.path.insert(0, str(TESTS))
    from test_soak import Sizes, random_calls, warm_up_graphs  # noqa: E402  (the soak's own sequence)

    from hf_paged_t5 import tiny

    watch = {int(c) for c in args.calls.split(",") if c}
    sizes = Sizes(max_batch=16, min_src=5, max_src=300, max_new=64, beams=4, vocab=32128)
    model = tiny.build_model("t5-small", vocab_size=sizes.vocab, initializer_factor=1.5, device="cuda")
    config = hp.PagedCacheConfig()
    hp.patch_model(model, config)
    warm_up_graphs(model, sizes, config.block_size)
    torch.cuda.memory._record_memory_history(max_entries=200_000)
    previous_memory, previous_graphs = measure(), hp.runtime_stats(model)["graphs_captured"]
    for i, call in enumerate(random_calls(args.upto, sizes, seed=11)):
        before = live_blocks() if i in watch else None
        torch.manual_seed(call.seed)
        out = model.generate(**call.kwargs(sizes.vocab, "cuda"))
        del out
        memory, graphs = measure(), hp.runtime_stats(model)["graphs_captured"]
        print(f"call {i}: {call}; memory {memory - previous_memory:+d} B, graphs {graphs - previous_graphs:+d}",
              flush=True)
        if before is not None:
            after = live_blocks()
            appeared = collections.Counter()
            gone = collections.Counter()
            for addr, (size, where) in after.items():
                if addr not in before or before[addr][0] != size:
                    appeared[where] += size
            for addr, (size, where) in before.items():
                if addr not in after or after[addr][0] != size:
                    gone[where] += size
            for label, counter in (("appeared", appeared), ("gone", gone)):
                for where, size in counter.most_common(12):
                    print(f"    {label} {size:>10d} B  {where}")
        previous_memory, previous_graphs = memory, graphs
    torch.cuda.memory._record_memory_history(enabled=None)


if __name__ == "__main__":
    main()
