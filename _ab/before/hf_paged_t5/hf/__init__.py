"""What Hugging Face code sees: patch_model / unpatch_model and the patched generate() and
forward, the transformers Cache adapter, the serve / fall back / refuse policy, the pipelines.
The only package that knows HF's private helpers.
"""
