"""Online serving: an OpenAI-style HTTP API (`app`) over the online batch engine
(`batch.online.OnlineEngine`), here or in a process of its own (`engine_client.EngineClient`,
`engine_process`), and its command line (`cli`: `python -m hf_paged_t5 serve`).
Needs the `serve` extra (Starlette, uvicorn).
"""
