"""Serving under an open-loop Poisson load: `python -m hf_paged_t5 serve` against the servers users
write today, each in its own process, the load from this one.

Systems: (a) `paged-server`: this package's server (continuous batching, streaming), its engine
in a process of its own (the default; `paged-server-one-process`, not run unless named in
--systems: the same with `--no-engine-process`, engine and HTTP server in one process); (b)
`generate-server`: Starlette around one patched `generate()` per request (`serve_baseline.py
--patched`); (c) `stock-server`: the same over stock HF. One random-weight checkpoint
(`tiny.save_demo_checkpoint`, `--shape`), bf16 on a GPU. Requests: token-id prompts of long-tailed
lengths, each with its own forced length (min_tokens = max_tokens), arriving as a Poisson process
at each `--rates` value (the stock server: `--stock-rates`; the per-request server: `--generate-rates`,
default `--rates`) for `--duration` seconds, after
`--warmup` seconds of unmeasured load (kernel compiles, graph captures), sent by `--clients`
processes that share the rate (one process parsing every streamed event would be what limits the
measured rate); (a) streams (time to first token = first event),
(b) and (c) answer whole (first token = the answer). Per system and rate: completed requests,
errors, generated tokens/s over the load's wall time, p50 / p99 time to first token and
end-to-end latency. A system's sustained rate is the highest rate whose p99 end-to-end latency
stays under `--slo` seconds with no errors; its sweep stops at the first rate past 5x that.

    python benchmarks/bench_serve.py [--shape t5-large] [--rates 1,2,4,8,16,32,64] [--duration 30]
        [--stock-rates 0.125,0.25,0.5,1] [--generate-rates R,...] [--warmup 10] [--clients 4]
        [--systems paged-server,generate-server,stock-server] [--quick] [--out DIR]
    python benchmarks/bench_serve.py --systems paged-server,paged-server-one-process   # the two modes

Needs the serve extra and httpx (`pip install "hf_paged_t5[serve]" httpx`). Writes DIR/serve.json
(default DIR: benchmarks/results/<date>-<gpu>/, with its env.json).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import multiprocessing
import os
import pathlib
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time

import common  # benchmarks/ is on sys.path

ROOT = pathlib.Path(__file__).resolve().parent.parent
SYSTEMS = ("paged-server", "paged-server-one-process", "generate-server", "stock-server")
DEFAULT_SYSTEMS = ("paged-server", "generate-server", "stock-server")
PAGED = {"paged-server": "engine process", "paged-server-one-process": "one process (--no-engine-process)"}


def workload(n: int, vocab: int, quick: bool, seed: int = 0) -> list[tuple[list[int], int]]:
    """(prompt ids, forced new tokens): prompt lengths log-uniform in 20-2000 (quick: 4-60), new
    tokens 20-200 (quick: 2-12)."""
    rng = random.Random(seed)
    low, high = (4, 60) if quick else (20, 2000)
    new_low, new_high = (2, 12) if quick else (20, 200)
    return [([rng.randrange(2, vocab) for _ in range(int(round(low * (high / low) ** rng.random())))],
             rng.randint(new_low, new_high)) for _ in range(n)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(system: str, checkpoint: str, device: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    if system in PAGED:
        command = [sys.executable, "-m", "hf_paged_t5", "serve", "--model", checkpoint, "--port", str(port),
                   "--device", device, "--drain", "2"] + (["--no-engine-process"] if system != "paged-server" else [])
    else:
        command = [sys.executable, str(ROOT / "benchmarks" / "serve_baseline.py"), "--model", checkpoint,
                   "--port", str(port), "--device", device] + (["--patched"] if system == "generate-server" else [])
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen(command, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    import urllib.request

    end = time.monotonic() + 600
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{system} exited ({proc.returncode}):\n{proc.stdout.read()[-3000:]}")
        try:
            with urllib.request.urlopen(base + "/health", timeout=1) as r:
                if r.status == 200:
                    return proc, base
        except OSError:
            pass
        if time.monotonic() > end:
            proc.kill()
            raise RuntimeError(f"{system} did not start within 600 s")
        time.sleep(0.2)


async def one(client, base: str, prompt: list[int], new: int, stream: bool) -> dict:
    body = {"prompt": prompt, "max_tokens": new, "min_tokens": new, "stream": stream}
    t0 = time.perf_counter()
    first = None
    tokens = 0
    if stream:
        async with client.stream("POST", base + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                return dict(ok=False, status=r.status_code)
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    first = first if first is not None else time.perf_counter() - t0
                    tokens += len(json.loads(line[6:])["choices"][0].get("token_ids", []))
    else:
        r = await client.post(base + "/v1/completions", json=body)
        if r.status_code != 200:
            return dict(ok=False, status=r.status_code)
        tokens = len(r.json()["choices"][0]["token_ids"])
        first = time.perf_counter() - t0
    return dict(ok=True, ttft=first, e2e=time.perf_counter() - t0, tokens=tokens)


async def _load(base: str, rate: float, duration: float, items, stream: bool, seed: int) -> tuple[list, float]:
    """One client process's share of the load: Poisson arrivals at `rate` for `duration` seconds;
    (a record per request, wall seconds until the last answer)."""
    import httpx

    rng = random.Random(seed)
    tasks, t, i = [], 0.0, rng.randrange(len(items))
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=httpx.Limits(max_connections=None)) as client:
        start = time.perf_counter()
        while True:
            t += rng.expovariate(rate)
            if t > duration:
                break
            await asyncio.sleep(max(0.0, start + t - time.perf_counter()))
            prompt, new = items[i % len(items)]
            i += 1
            tasks.append(asyncio.create_task(one(client, base, prompt, new, stream)))
        done = await asyncio.gather(*tasks, return_exceptions=True)
        wall = time.perf_counter() - start
    return [d if isinstance(d, dict) else dict(ok=False, status=type(d).__name__) for d in done], wall


_ITEMS = None  # the workload, built once per client process


def _client_init(vocab: int, quick: bool) -> None:
    global _ITEMS
    _ITEMS = workload(4096, vocab, quick)


def _client(base: str, rate: float, duration: float, stream: bool, seed: int) -> tuple[list, float]:
    return asyncio.run(_load(base, rate, duration, _ITEMS, stream, seed))


def load(clients, k: int, base: str, rate: float, duration: float, stream: bool) -> dict:
    """The load at `rate`, split over the `k` client processes of `clients` (a sum of Poisson processes is one), so
    that parsing the answers is not what limits the measured rate."""
    parts = [clients.submit(_client, base, rate / k, duration, stream, int(rate * 1000) * k + j) for j in range(k)]
    records, wall = [], 0.0
    for part in parts:
        got, seconds = part.result()
        records += got
        wall = max(wall, seconds)
    ok = [d for d in records if d.get("ok")]
    statuses: dict[str, int] = {}
    for d in records:
        if not d.get("ok"):
            statuses[str(d.get("status"))] = statuses.get(str(d.get("status")), 0) + 1

    def pct(key: str, q: float):
        values = sorted(d[key] for d in ok if d.get(key) is not None)
        return values[min(len(values) - 1, int(q * len(values)))] if values else None

    return dict(rate=rate, requests=len(records), completed=len(ok), errors=len(records) - len(ok),
                error_statuses=statuses, wall_s=wall,
                tokens_per_s=sum(d["tokens"] for d in ok) / wall if wall else 0.0,
                ttft_p50=pct("ttft", 0.5), ttft_p99=pct("ttft", 0.99), e2e_p50=pct("e2e", 0.5),
                e2e_p99=pct("e2e", 0.99))


def kernel_binaries(base: str) -> int:
    """The paged server's hf_paged_t5_kernel_binaries gauge."""
    import urllib.request

    with urllib.request.urlopen(base + "/metrics", timeout=5) as r:
        text = r.read().decode()
    return int(next(line.split()[-1] for line in text.splitlines() if line.startswith("hf_paged_t5_kernel_binaries ")))


def sweep(clients, k: int, system: str, base: str, rates, duration: float, slo: float, warmup: float) -> list[dict]:
    stream = system in PAGED
    if warmup:  # kernel compiles and graph captures of the shapes the load meets, not measured
        load(clients, k, base, min(rates[0], 4.0), warmup, stream)
    rows = []
    for rate in rates:
        binaries = kernel_binaries(base) if stream else None
        row = load(clients, k, base, rate, duration, stream)
        if binaries is not None:  # kernels met for the first time under this load (each a compile stall)
            row["kernel_binaries_added"] = kernel_binaries(base) - binaries
        rows.append(row)
        print(f"{system} rate {rate}/s: {row['completed']}/{row['requests']} done, {row['tokens_per_s']:.0f} tok/s, "
              f"ttft p99 {row['ttft_p99']}, e2e p50 {row['e2e_p50']} p99 {row['e2e_p99']}"
              + (f", kernel binaries added {row['kernel_binaries_added']}" if "kernel_binaries_added" in row else "")
              + (f", errors {row['error_statuses']}" if row["errors"] else ""), flush=True)
        if row["errors"] or row["e2e_p99"] is None or row["e2e_p99"] > 5 * slo:
            break
    return rows


def wait_for_gpu_memory(device: str, timeout: float = 60.0) -> None:
    """Until the GPU's memory is free again (at least 80% of it) after a server process ended."""
    if not device.startswith("cuda"):
        return
    import torch

    end = time.monotonic() + timeout
    while time.monotonic() < end:
        free, total = torch.cuda.mem_get_info(torch.device(device))
        if free >= 0.8 * total:
            return
        time.sleep(0.5)
    print(f"warning: only {free / 2**30:.1f} of {total / 2**30:.1f} GiB free after the server ended", flush=True)


def sustained(rows: list[dict], slo: float) -> float:
    good = [r["rate"] for r in rows if not r["errors"] and r["e2e_p99"] is not None and r["e2e_p99"] < slo]
    return max(good) if good else 0.0


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default=None, help="tiny.SHAPES layout (default: t5-large; --quick: tiny)")
    ap.add_argument("--rates", default=None, help="requests per second, comma-separated (default: 1,2,4,...,64)")
    ap.add_argument("--stock-rates", default=None,
                    help="the stock server's rates (default: 0.125,0.25,0.5,1; quick: as --rates)")
    ap.add_argument("--generate-rates", default=None,
                    help="the patched per-request server's rates (default: as --rates)")
    ap.add_argument("--duration", type=float, default=None, help="seconds of load per rate (default 30; quick 3)")
    ap.add_argument("--slo", type=float, default=2.0, help="p99 end-to-end seconds of a sustained rate (default 2)")
    ap.add_argument("--systems", default=",".join(DEFAULT_SYSTEMS),
                    help=f"comma-separated, of {', '.join(SYSTEMS)} (default: {','.join(DEFAULT_SYSTEMS)})")
    ap.add_argument("--device", default=None, help="the servers' device (default: cuda if available)")
    ap.add_argument("--warmup", type=float, default=None,
                    help="seconds of unmeasured load before each system's sweep (default 10; quick 2)")
    ap.add_argument("--clients", type=int, default=None,
                    help="client processes that share the load (default: 4, 1 with --quick)")
    ap.add_argument("--quick", action="store_true", help="tiny layout, low rates, short loads (a smoke run)")
    ap.add_argument("--out", default=None, help="folder for serve.json (default: benchmarks/results/<date>-<gpu>)")
    args = ap.parse_args(argv)
    systems = [s for s in args.systems.split(",") if s]
    if not systems or any(s not in SYSTEMS for s in systems):
        ap.error(f"--systems: give some of {', '.join(SYSTEMS)}")
    import torch

    from hf_paged_t5 import tiny

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    shape = args.shape or ("tiny" if args.quick else "t5-large")
    rates = [float(r) for r in (args.rates or ("1,2,4" if args.quick else "1,2,4,8,16,32,64")).split(",")]
    duration = args.duration or (3.0 if args.quick else 30.0)
    stock_rates = [float(r) for r in args.stock_rates.split(",")] if args.stock_rates else (
        rates if args.quick else [0.125, 0.25, 0.5, 1.0])
    generate_rates = [float(r) for r in args.generate_rates.split(",")] if args.generate_rates else rates
    rates_of = {"stock-server": stock_rates, "generate-server": generate_rates}
    out = common.start_suite(args.out, "serve")
    with tempfile.TemporaryDirectory() as folder:
        checkpoint = tiny.save_demo_checkpoint(pathlib.Path(folder) / shape, shape=shape)
        vocab = json.loads((pathlib.Path(checkpoint) / "config.json").read_text())["vocab_size"]
        warmup = args.warmup if args.warmup is not None else (2.0 if args.quick else 10.0)
        workers = args.clients or (1 if args.quick else 4)
        clients = concurrent.futures.ProcessPoolExecutor(
            workers, mp_context=multiprocessing.get_context("spawn"),
            initializer=_client_init, initargs=(vocab, args.quick))
        results, logs = {}, {}

        def report() -> dict:  # written after each system: a run cut short keeps what it measured
            rate_of = {s: sustained(rows, args.slo) for s, rows in results.items()}
            out_ = dict(shape=shape, device=device, slo_s=args.slo, duration_s=duration, warmup_s=warmup,
                        client_processes=workers, rates=rates, stock_rates=stock_rates, generate_rates=generate_rates,
                        sustained_rate=rate_of, systems=results, server_output_on_errors=logs,
                        paged_server_modes={s: PAGED[s] for s in results if s in PAGED})
            if "paged-server" in rate_of:
                for other in ("generate-server", "stock-server"):
                    if other in rate_of:
                        out_[f"sustained_vs_{other}"] = (rate_of["paged-server"] / rate_of[other] if rate_of[other]
                                                         else None)  # None: the other sustains no rate
                if "paged-server-one-process" in rate_of:
                    one = rate_of["paged-server-one-process"]
                    out_["sustained_vs_paged-server-one-process"] = rate_of["paged-server"] / one if one else None
            common.write_json(out / "serve.json", out_)
            return out_

        for system in systems:
            proc, base = start(system, checkpoint, device)
            try:
                results[system] = sweep(clients, workers, system, base, rates_of.get(system, rates), duration,
                                        args.slo, warmup)
            finally:
                proc.send_signal(signal.SIGTERM)
                try:
                    output = proc.communicate(timeout=60)[0] or ""
                except subprocess.TimeoutExpired:
                    proc.kill()
                    output = proc.communicate()[0] or ""
                wait_for_gpu_memory(device)  # the next server must not start beside this one's KV pool
            if any(row["errors"] for row in results.get(system, [])):
                logs[system] = output[-4000:]  # what the server said about its failed requests
                print(f"{system} output (last lines):\n{output[-2000:]}", flush=True)
            report()
        clients.shutdown()
    rate_of = report()["sustained_rate"]
    fmt = common.fmt
    common.print_table(
        ["system", "rate /s", "done", "errors", "tokens/s", "TTFT p50 s", "TTFT p99 s", "E2E p50 s", "E2E p99 s"],
        ([s, r["rate"], f"{r['completed']}/{r['requests']}", r["errors"], f"{r['tokens_per_s']:.0f}",
          fmt(r["ttft_p50"], ".3f"), fmt(r["ttft_p99"], ".3f"), fmt(r["e2e_p50"], ".3f"), fmt(r["e2e_p99"], ".3f")]
         for s, rows in results.items() for r in rows),
        title=f"{shape} on {device}, Poisson arrivals, {duration:g} s per rate")
    print("sustained rate (p99 E2E < %g s): %s" % (args.slo, ", ".join(f"{s} {v:g}/s" for s, v in rate_of.items())))


if __name__ == "__main__":
    main()
