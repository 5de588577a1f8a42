"""Batch jobs past one GPU: the batch engine inside each replica of a Ray Data job.

    import ray
    from hf_paged_t5.batch.ray_data import BatchReplica, replica_compute

    ds = ray.data.read_json("in.jsonl", lines=True)
    out = ds.map_batches(BatchReplica, fn_constructor_kwargs={"model": "/ckpt", "task": "summarization"},
                         num_gpus=1, batch_size=256, **replica_compute(replicas=4))
    out.write_json("out/")

`BatchReplica` loads and patches the model once per replica (a Ray actor) and runs every batch
Ray hands it through one online engine (`BatchGenerator` fed by a queue: continuous batching
inside the replica, also across the batches Ray runs at once in it); it returns
the input's id, the output text and the number of new tokens as columns; the input is a text
or token ids, and optional `max_new_tokens` / `min_new_tokens` columns set each row's lengths.
Replicas, GPUs per
replica and rows per batch are Ray's own knobs (`compute` / `concurrency`, `num_gpus`,
`batch_size`). Ray Data runs one call of an actor at a time unless told otherwise, which would
leave the engine one batch and its long tail: `replica_compute` gives the `compute` (and, on an
older Ray, `max_concurrency`) that lets several batches run at once in each replica. Ray
retries the batch of a replica that dies on a new one. The model path must be readable from every
node that runs a replica.

`run_ray_job` is the command line's `--ray` path (`python -m hf_paged_t5 summarize ... --ray`):
JSONL or Parquet in and out through Ray Data's readers and writers, the output a folder of shard
files, and a rerun skips the ids already in that folder, as the local command does.
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import json
import logging
import os
from typing import Any, Optional

logger = logging.getLogger(__name__)

ROWS_PER_BATCH = 256  # rows Ray hands a replica at a time (the CLI's; a caller of map_batches picks its own)
REPLICA_BATCHES = 8  # batches one replica runs at once, all in its one decode loop (the CLI's)


def replica_compute(replicas: int = 1, batches: int = REPLICA_BATCHES) -> dict:
    """`map_batches` keyword arguments for `replicas` BatchReplica actors, each running `batches`
    batches at once (their rows share the replica's decode loop).

    A Ray Data whose ActorPoolStrategy has `enable_true_multi_threading` runs one call per actor at
    a time unless it is set, whatever `max_concurrency` says; an older one takes `max_concurrency`.
    """
    import inspect

    import ray.data

    if replicas < 1 or batches < 1:
        raise ValueError(f"replicas and batches must be >= 1, got {replicas} and {batches}")
    options = inspect.signature(ray.data.ActorPoolStrategy).parameters
    if "enable_true_multi_threading" in options:
        return dict(compute=ray.data.ActorPoolStrategy(
            size=replicas, max_tasks_in_flight_per_actor=batches, max_concurrent_calls_per_actor=batches,
            enable_true_multi_threading=True))
    return dict(compute=ray.data.ActorPoolStrategy(size=replicas), max_concurrency=batches)


class BatchReplica:
    """A callable class for `ray.data.Dataset.map_batches` (see the module's docstring).

    model: a local checkpoint directory. task: a `task_specific_params` key whose prefix and
    generation defaults apply (as the command line's --task); prefix: text put before each input
    (instead of the task's). dtype: "auto" (bfloat16 on a GPU that supports it, else the
    checkpoint's), or a torch dtype name. device: default cuda if available. The rest are
    `BatchGenerator`'s arguments (max_batch_tokens, max_batch_rows, gpu_memory_utilization,
    generation options). A replica sizes its KV budget from its GPU's memory (0.9 of it by
    default): replicas that share a GPU (`num_gpus` < 1) each need their share of
    `gpu_memory_utilization`, e.g. 0.45 for two.
    """

    def __init__(self, model: str, task: Optional[str] = None, prefix: Optional[str] = None,
                 text_field: str = "text", id_field: str = "id", dtype: str = "auto",
                 device: Optional[str] = None, **generator_kwargs: Any) -> None:
        from . import cli as batch_cli
        from .online import OnlineEngine
        from ..demo import load_model
        from ..hf.patch import is_patched, patch_model

        device = batch_cli.resolve_device(device)
        config = batch_cli.read_model_config(model)
        _, task_prefix, defaults = batch_cli.task_settings(config, "generate", task)
        torch_dtype, _ = batch_cli.resolve_dtype(dtype, device, config)
        loaded, tokenizer, _ = load_model(model, device=device, dtype=torch_dtype)
        if not is_patched(loaded):
            patch_model(loaded)
        # one engine for every batch: batches Ray runs at once in this replica (replica_compute)
        # share the decode loop, so it does not drain between batches
        self.engine = OnlineEngine(loaded, tokenizer, **{**defaults, **generator_kwargs})
        self.prefix = task_prefix if prefix is None else prefix
        self.text_field, self.id_field = text_field, id_field

    def __call__(self, batch: dict) -> dict:
        import numpy as np

        from .requests import BatchRequest

        texts, ids = batch[self.text_field], batch[self.id_field]
        limits = batch.get("max_new_tokens"), batch.get("min_new_tokens")
        items = []
        for j, (record_id, text) in enumerate(zip(ids, texts)):
            if isinstance(text, str):
                item: Any = self.prefix + text
            elif isinstance(text, (list, np.ndarray)) and all(isinstance(t, (int, np.integer)) for t in text):
                item = [int(t) for t in text]  # token ids, as they are
            else:
                raise ValueError(f"input {_plain(record_id)!r}: field {self.text_field!r} is {text!r}, "
                                 "not a text or token ids")
            most, least = (None if column is None else _plain(column[j]) for column in limits)
            if most is not None or least is not None:
                item = BatchRequest(item, max_new_tokens=most, min_new_tokens=least)
            items.append(item)
        futures = [self.engine.submit(item) for item in items]
        try:
            results = [f.result() for f in futures]
        except BaseException:
            for f in futures:
                f.cancel()
            raise
        return {self.id_field: np.asarray(ids),
                "output": np.array([r.text for r in results], dtype=object),
                "num_new_tokens": np.array([r.num_new_tokens for r in results], dtype=np.int64)}


def _plain(value: Any) -> Any:
    """A numpy scalar as its Python value (ids read by Ray come as numpy scalars)."""
    return value.item() if hasattr(value, "item") else value


def id_key(value: Any) -> str:
    """The key an id is known by in the output, as the local command keys it (its JSON text)."""
    return json.dumps(_plain(value))


def output_format(path: str) -> str:
    return "parquet" if path.rstrip("/").endswith(".parquet") else "json"


def read_input(ray_data, path: str):
    """The input dataset: Parquet (a .parquet file or a folder of them) or JSON lines."""
    if path.rstrip("/").endswith(".parquet") or (os.path.isdir(path) and glob.glob(os.path.join(path, "*.parquet"))):
        return ray_data.read_parquet(path)
    return ray_data.read_json(path, lines=True)


def written_ids(path: str, id_field: str) -> set[str]:
    """The ids (`id_key`) in the shard files an earlier run wrote to the output folder `path`."""
    import pyarrow.json as pa_json
    import pyarrow.parquet as pq

    done: set[str] = set()
    if not os.path.isdir(path):
        return done
    for name in sorted(os.listdir(path)):
        file = os.path.join(path, name)
        try:
            if name.endswith(".parquet"):
                table = pq.read_table(file, columns=[id_field])
            elif name.endswith((".json", ".jsonl")):
                table = pa_json.read_json(file)
            else:
                continue
        except Exception as exc:  # noqa: BLE001 - a shard a crashed run left half written
            # set aside, so that its ids, which run again, are not also in a shard that readers read
            os.replace(file, file + ".unreadable")
            logger.warning("%s: not readable (%s); renamed to %s.unreadable, its ids run again", file, exc, name)
            continue
        if id_field in table.column_names:
            done.update(id_key(v) for v in table.column(id_field).to_pylist())
    return done


def check_ray() -> None:
    from .cli import CliError

    if importlib.util.find_spec("ray") is None or importlib.util.find_spec("pyarrow") is None:
        raise CliError("--ray needs Ray Data: pip install 'hf_paged_t5[ray]'")


def run_ray_job(command: str, args: argparse.Namespace) -> int:
    """The command line's `--ray` path; everything but the model is checked before any replica loads."""
    from . import cli as batch_cli

    CliError = batch_cli.CliError
    check_ray()
    batch_cli.check_options(args)
    if args.replicas is not None and args.replicas < 1:
        raise CliError(f"--replicas {args.replicas}: must be >= 1")
    if not os.path.exists(args.input):
        raise CliError(f"--input {args.input}: no such file or folder")
    if os.path.exists(args.output) and not os.path.isdir(args.output):
        raise CliError(f"--output {args.output}: with --ray the output is a folder of shard files, and this is a file")
    model_config = batch_cli.read_model_config(args.model)
    key, prefix, defaults = batch_cli.task_settings(model_config, command, args.task)
    kwargs = batch_cli.generation_kwargs(defaults, args)  # the task's defaults with the options given

    import ray
    import ray.data

    if not ray.is_initialized():
        ray.init(address=args.ray_address, log_to_driver=False)
    ds = read_input(ray.data, args.input)
    columns = ds.schema().names
    missing = [f for f in (args.text_field, args.id_field) if f not in columns]
    if missing:
        raise CliError(f"--input {args.input}: no {' or '.join(repr(f) for f in missing)} field (its fields: "
                       f"{', '.join(columns)}); with --ray every input needs a text and an id (--text-field, --id-field)")
    text_field, id_field = args.text_field, args.id_field
    bad = ds.filter(lambda row: not isinstance(row[text_field], str) or row[id_field] is None).take(1)
    if bad:
        raise CliError(f"--input {args.input}: an input without a text or an id: {bad[0]}")
    done = written_ids(args.output, id_field)
    total = ds.count()
    todo = ds.filter(lambda row: id_key(row[id_field]) not in done) if done else ds
    remaining = todo.count() if done else total
    if not remaining:
        logger.info("%d inputs, %d already done, nothing to run; output: %s", total, total, args.output)
        return 0
    batch_cli.log_task(key, prefix, defaults, args.task)
    resources = ray.cluster_resources()
    gpus = resources.get("GPU", 0)
    replicas = args.replicas or max(1, int(gpus))
    # CPU-only replicas leave a CPU to the reading and writing tasks (all CPUs held by replicas
    # would stall the job); a GPU replica asks for one CPU, as Ray's default
    cpus = 1.0 if gpus else max(0.1, min(1.0, (resources.get("CPU", 1) - 1) / replicas))
    logger.info("%d inputs, %d already done, %d to run on %d replica(s)%s", total, total - remaining, remaining,
                replicas, " with one GPU each" if gpus else "")
    results = todo.map_batches(
        BatchReplica, batch_size=ROWS_PER_BATCH, **replica_compute(replicas),
        num_gpus=1 if gpus else 0, num_cpus=cpus,
        fn_constructor_kwargs=dict(model=args.model, prefix=prefix, text_field=text_field, id_field=id_field,
                                   dtype=args.dtype, device=args.device, max_batch_tokens=args.batch_tokens,
                                   max_batch_rows=args.batch_rows,
                                   gpu_memory_utilization=args.gpu_memory_utilization, **kwargs))
    if output_format(args.output) == "parquet":
        results.write_parquet(args.output)
    else:
        results.write_json(args.output)
    logger.info("%d documents written; output: %s", remaining, args.output)
    return 0
