"""Talk to `python -m hf_paged_t5 serve` with the official `openai` client: a completion, the same
one streamed, and a batch of prompts in one request.

    python -m hf_paged_t5 serve --model PATH --task summarization &      # then:
    python examples/serve_client.py --url http://127.0.0.1:8000

    python examples/serve_client.py --model PATH                         # starts a server itself

Needs `pip install "hf_paged_t5[serve]" openai`.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import openai


def start_server(model: str, device: str) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "hf_paged_t5", "serve", "--model", model, "--port", str(port),
                             "--device", device, "--task", "summarization"])
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with status {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=1):
                return proc, url
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise SystemExit("the server did not start within 120 s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="a running server (default: start one with --model)")
    ap.add_argument("--model", help="checkpoint directory for a server started here")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    if not (args.url or args.model):
        ap.error("give --url of a running server, or --model to start one")
    proc = None
    url = args.url
    if url is None:
        proc, url = start_server(args.model, args.device)
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key=os.environ.get("OPENAI_API_KEY", "unused"))
        name = client.models.list().data[0].id
        text = "The city council voted on Tuesday to build a new bridge across the river."
        done = client.completions.create(model=name, prompt=text, max_tokens=24)
        print("completion:", done.choices[0].text)
        print("finish reason:", done.choices[0].finish_reason, "| tokens:", done.usage.completion_tokens)
        pieces = [c.choices[0].text for c in client.completions.create(model=name, prompt=text, max_tokens=24,
                                                                        stream=True)]
        print("streamed in", len(pieces), "pieces; streamed equals plain:", "".join(pieces) == done.choices[0].text)
        batch = client.completions.create(model=name, prompt=[text, "Heavy rain is expected tonight."], max_tokens=8)
        for choice in batch.choices:
            print(f"batch[{choice.index}]:", choice.text)
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)


if __name__ == "__main__":
    main()
