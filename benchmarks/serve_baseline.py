"""The server users write today, for `bench_serve.py` to compare with: Starlette (as FastAPI is)
around one `model.generate()` per request, one request at a time on the model, patched by
hf_paged_t5 (`--patched`) or stock HF. Same request shape as `python -m hf_paged_t5 serve`
(POST /v1/completions with token-id prompts, max_tokens, min_tokens; GET /health).

    python benchmarks/serve_baseline.py --model PATH --port 8001 [--patched] [--device cuda]
"""

from __future__ import annotations

import argparse
import threading

import torch


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--patched", action="store_true", help="patch the model with hf_paged_t5")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)

    import uvicorn
    from starlette.applications import Starlette
    from starlette.concurrency import run_in_threadpool
    from starlette.responses import JSONResponse
    from starlette.routing import Route
    from transformers import AutoModelForSeq2SeqLM

    import hf_paged_t5 as hp

    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    model = AutoModelForSeq2SeqLM.from_pretrained(args.model, dtype=dtype).to(args.device).eval()
    if args.patched:
        hp.patch_model(model)
    lock = threading.Lock()  # one generate() at a time on the model, as a sync endpoint would need

    def generate(prompt: list[int], max_tokens: int, min_tokens: int) -> list[int]:
        ids = torch.tensor([prompt], device=args.device)
        with lock, torch.inference_mode():
            out = model.generate(input_ids=ids, max_new_tokens=max_tokens, min_new_tokens=min_tokens or None)
        return out[0, 1:].tolist()

    async def completions(request):
        body = await request.json()
        tokens = await run_in_threadpool(generate, body["prompt"], int(body.get("max_tokens", 16)),
                                         int(body.get("min_tokens") or 0))
        return JSONResponse({"object": "text_completion", "choices": [{"index": 0, "text": "", "token_ids": tokens,
                                                                       "finish_reason": "length"}],
                             "usage": {"completion_tokens": len(tokens)}})

    async def health(request):
        return JSONResponse({"status": "ok"})

    app = Starlette(routes=[Route("/v1/completions", completions, methods=["POST"]),
                            Route("/health", health, methods=["GET"])])
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
