"""Ray Data jobs (`batch/ray_data.py`, the command line's --ray): a local Ray on CPU, the tiny model.

The outputs are compared with the local command's on the same inputs: each id exactly once, the
same text and token count; also after a replica process dies mid-job, and across a resumed run.
"""

import json
import os
import random

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("pyarrow")
import ray.data  # noqa: E402

from hf_paged_t5 import tiny  # noqa: E402
from hf_paged_t5.__main__ import main  # noqa: E402
from hf_paged_t5.batch import ray_data  # noqa: E402

WORDS = "the a model of text long short summary input token batch replica ray data engine".split()
NEW = ["--max-new-tokens", "6", "--no-progress"]


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """(checkpoint, input JSONL of 200 rows, the local command's results by id)."""
    folder = tmp_path_factory.mktemp("ray")
    checkpoint = tiny.save_demo_checkpoint(folder / "ckpt")
    rng = random.Random(0)
    rows = [{"id": f"doc-{i}", "text": " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 40)))}
            for i in range(200)]
    source = folder / "in.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    local = folder / "local.jsonl"
    assert main(["generate", "--model", checkpoint, "--input", str(source), "--output", str(local), *NEW]) == 0
    expected = {r["id"]: r for r in map(json.loads, local.read_text().splitlines())}
    assert len(expected) == 200
    return checkpoint, source, expected


def shards(folder) -> list[dict]:
    rows = []
    for name in sorted(os.listdir(folder)):
        if name.endswith(".json"):
            rows += [json.loads(line) for line in (folder / name).read_text().splitlines() if line]
    return rows


def check_once(rows: list[dict], expected: dict) -> None:
    ids = [r["id"] for r in rows]
    assert sorted(ids) == sorted(expected), "every id exactly once"
    for r in rows:
        assert (r["output"], r["num_new_tokens"]) == (expected[r["id"]]["output"], expected[r["id"]]["num_new_tokens"])


def test_two_replicas_give_the_local_outputs_and_a_rerun_resumes(cluster, job, tmp_path):
    checkpoint, source, expected = job
    half = tmp_path / "half.jsonl"
    half.write_text("".join(source.read_text().splitlines(keepends=True)[:100]))
    out = tmp_path / "out"
    assert main(["generate", "--model", checkpoint, "--input", str(half), "--output", str(out), "--ray",
                 "--replicas", "2", *NEW]) == 0
    first = shards(out)
    assert len(first) == 100
    # the full input into the same folder: only the 100 ids not written yet run
    assert main(["generate", "--model", checkpoint, "--input", str(source), "--output", str(out), "--ray",
                 "--replicas", "2", *NEW]) == 0
    check_once(shards(out), expected)
    before = sorted(os.listdir(out))
    assert main(["generate", "--model", checkpoint, "--input", str(source), "--output", str(out), "--ray",
                 *NEW]) == 0
    assert sorted(os.listdir(out)) == before  # nothing left to run: nothing written
    # a shard a crashed run left half written is set aside and its ids run again: each id still once
    shard = next(out / name for name in sorted(os.listdir(out)) if name.endswith(".json"))
    lost = {json.loads(line)["id"] for line in shard.read_text().splitlines()}
    shard.write_text(shard.read_text()[:-10])
    assert main(["generate", "--model", checkpoint, "--input", str(source), "--output", str(out), "--ray",
                 *NEW]) == 0
    assert (out / (shard.name + ".unreadable")).exists() and lost
    check_once(shards(out), expected)


def test_a_replica_that_dies_mid_job_is_retried(cluster, job, tmp_path):
    checkpoint, source, expected = job
    marker = str(tmp_path / "died")

    class DiesOnce(ray_data.BatchReplica):
        def __call__(self, batch):
            try:  # the first replica to get here ends its process, once
                os.close(os.open(marker, os.O_CREAT | os.O_EXCL))
            except FileExistsError:
                return super().__call__(batch)
            os._exit(1)

    ds = ray.data.read_json(str(source), lines=True)
    rows = ds.map_batches(DiesOnce, batch_size=25, compute=ray.data.ActorPoolStrategy(size=2), num_cpus=0.5,
                          fn_constructor_kwargs=dict(model=checkpoint, max_new_tokens=6)).take_all()
    assert os.path.exists(marker)
    check_once([{k: ray_data._plain(v) for k, v in r.items()} for r in rows], expected)


def test_bad_input_is_one_line_before_any_model_loads(cluster, job, tmp_path, caplog, monkeypatch):
    checkpoint, source, _ = job
    out = tmp_path / "out"
    no_text = tmp_path / "no_text.jsonl"
    no_text.write_text('{"id": 1, "body": "x"}\n')
    assert main(["generate", "--model", checkpoint, "--input", str(no_text), "--output", str(out), "--ray"]) == 2
    assert "no 'text' field" in caplog.text and not out.exists()
    caplog.clear()
    one_missing = tmp_path / "one_missing.jsonl"
    one_missing.write_text('{"id": 1, "text": "a"}\n{"id": 2}\n')
    assert main(["generate", "--model", checkpoint, "--input", str(one_missing), "--output", str(out), "--ray"]) == 2
    assert "an input without a text or an id" in caplog.text and not out.exists()
    caplog.clear()
    assert main(["generate", "--model", checkpoint, "--input", str(tmp_path / "none.jsonl"), "--output", str(out),
                 "--ray"]) == 2
    assert "no such file" in caplog.text
    caplog.clear()
    real = ray_data.importlib.util.find_spec
    monkeypatch.setattr(ray_data.importlib.util, "find_spec", lambda name: None if name == "ray" else real(name))
    assert main(["generate", "--model", checkpoint, "--input", str(source), "--output", str(out), "--ray"]) == 2
    assert "pip install 'hf_paged_t5[ray]'" in caplog.text


def test_parquet_in_and_out(cluster, job, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    checkpoint, source, expected = job
    rows = [json.loads(line) for line in source.read_text().splitlines()[:50]]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "in.parquet")
    out = tmp_path / "out.parquet"
    assert main(["generate", "--model", checkpoint, "--input", str(tmp_path / "in.parquet"), "--output", str(out),
                 "--ray", "--replicas", "1", *NEW]) == 0
    written = pq.read_table(out).to_pylist()
    check_once(written, {r["id"]: expected[r["id"]] for r in rows})



def test_replica_compute_runs_batches_at_once_in_one_replica(cluster):
    """Ray Data runs one call per actor unless told otherwise: the batches replica_compute lets a
    replica run at once overlap in time (the engine sees all their rows), one replica."""

    class Overlap:  # a stand-in replica whose calls each take 0.5 s and say when they ran (defined
        # here: Ray's workers receive it by value, not by importing this test module)
        def __call__(self, batch):
            import time

            began = time.time()
            time.sleep(0.5)
            return {"id": batch["id"], "began": [began] * len(batch["id"]), "ended": [time.time()] * len(batch["id"])}

    rows = ray.data.range(8).map_batches(Overlap, batch_size=2, num_cpus=0.5,
                                         **ray_data.replica_compute(1, batches=4)).take_all()
    spans = sorted((r["began"], r["ended"]) for r in rows)
    assert len({r["id"] for r in rows}) == 8
    overlapping = max(sum(b <= t < e for b, e in spans) for t, _ in spans) // 2  # rows -> batches (2 each)
    assert overlapping >= 2, spans
    with pytest.raises(ValueError, match="replicas and batches must be >= 1"):
        ray_data.replica_compute(0)
