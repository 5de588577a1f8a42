"""Block bookkeeping and the KV pool: the block manager (free list, reference counts) and the
per-layer K/V block tensors with their step metadata. Imports torch only (no transformers, no Triton).
"""
