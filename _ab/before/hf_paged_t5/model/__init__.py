"""The T5 model pieces on the paged cache: relative-position bias tables, attention over the
cache, and the encoder / decoder-layer / cross-store stacks. Imports kv/ and the kernel namespaces.
"""
