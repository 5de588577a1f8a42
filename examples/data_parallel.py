"""Data-parallel batch summarization: one patched model per GPU, launched by accelerate.

    accelerate launch --num_processes 2 examples/data_parallel.py --model PATH \
        --input in.jsonl --output out.jsonl
    python examples/data_parallel.py --model PATH --input in.jsonl --output out.jsonl   # one process
    torchrun --nproc_per_node 2 examples/data_parallel.py --device cpu ...             # two CPU processes

Same options and output as `batch_jsonl.py` (default task: summarization). Every process loads
the model on its own device (`PartialState().device`: cuda:0, cuda:1, ...; `--device` overrides
it) and patches it. The inputs, sorted by length, are dealt out in turn: of N processes, process
r takes inputs r, r + N, r + 2N, ..., so each gets its share (the same count, give or take one,
and short and long inputs alike) whatever `--batch-size`, and makes its own batches from it.
The main process gathers the results and writes them in input order.
"""

from __future__ import annotations

import argparse
import time

import torch
from accelerate import PartialState
from accelerate.utils import gather_object

# batch_jsonl.py sits next to this file: running a script puts its directory on sys.path.
from batch_jsonl import (
    add_job_arguments,
    add_model_arguments,
    generate_all,
    job_kwargs,
    load,
    make_batches,
    read_jsonl,
    write_jsonl,
)


def share(items: list, rank: int, num_processes: int) -> list:
    """The items of process `rank`: items[rank], items[rank + num_processes], ...

    Every process gets len(items) // num_processes items or one more, so none is left idle while
    there are at least as many items as processes.
    """
    return items[rank::num_processes]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_model_arguments(parser)
    add_job_arguments(parser)
    parser.set_defaults(task="summarization")
    args = parser.parse_args()
    # cpu=True makes a multi-process CPU run (torchrun, no GPU) use gloo instead of looking for GPUs.
    state = PartialState(cpu=(args.device or "").startswith("cpu") or not torch.cuda.is_available())
    model, tokenizer = load(args.model, args.device or str(state.device), args.dtype)
    prefix, kwargs = job_kwargs(model, args)
    records = read_jsonl(args.input, args.text_field)
    texts = [prefix + r[args.text_field] for r in records]
    # Every input, shortest first (make_batches' order); this process's share keeps that order,
    # so its consecutive runs of --batch-size are batches of similar lengths.
    order = [i for batch in make_batches(tokenizer, texts, args.batch_size) for i in batch]
    mine = share(order, state.process_index, state.num_processes)
    batches = [mine[i : i + args.batch_size] for i in range(0, len(mine), args.batch_size)]
    start = time.perf_counter()
    outputs = generate_all(model, tokenizer, texts, batches, **kwargs)
    seconds = time.perf_counter() - start
    print(f"process {state.process_index} of {state.num_processes} on {model.device}: {len(outputs)} inputs "
          f"in {seconds:.1f} s", flush=True)
    gathered = gather_object(sorted(outputs.items()))  # [(index, text)] of every process
    if state.is_main_process:
        write_jsonl(args.output, records, dict(gathered))
        print(f"{len(records)} inputs on {state.num_processes} process(es) in "
              f"{time.perf_counter() - start:.1f} s -> {args.output}")
    state.wait_for_everyone()
    # torch.distributed's threads torn down at interpreter exit instead can abort a process
    # ("terminate called without an active exception"; seen on a loaded 2-core machine)
    state.destroy_process_group()


if __name__ == "__main__":
    main()
