"""Data-parallel batch summarization: one patched model per GPU, launched by accelerate.

    accelerate launch --num_processes 2 examples/data_parallel.py --model PATH \
        --input in.jsonl --output out.jsonl
    python examples/data_parallel.py --model PATH --input in.jsonl --output out.jsonl   # one process
    torchrun --nproc_per_node 2 examples/data_parallel.py --device cpu ...             # two CPU processes

Same options and output as `batch_jsonl.py` (default task: summarization). Every process loads
the model on its own device (`PartialState().device`: cuda:0, cuda:1, ...) and patches it. The
batches are formed once from all inputs (sorted by length), so each batch, and so each output,
is the same whatever the number of processes; `split_between_processes` hands each process
every N-th batch. The main process gathers the results and writes them in input order.
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


def interleave(items: list, parts: int) -> list:
    """Reorder so that cutting the list into `parts` contiguous shares (as `split_between_processes`
    does, earlier shares one longer) gives share r the items r, r + parts, r + 2 * parts, ...:
    short and long batches spread evenly over the processes."""
    return [item for r in range(parts) for item in items[r::parts]]


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
    batches = interleave(make_batches(tokenizer, texts, args.batch_size), state.num_processes)
    start = time.perf_counter()
    with state.split_between_processes(batches) as my_batches:
        outputs = generate_all(model, tokenizer, texts, my_batches, **kwargs)
        seconds = time.perf_counter() - start
        print(f"process {state.process_index} on {state.device}: {len(outputs)} inputs in {seconds:.1f} s",
              flush=True)
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
