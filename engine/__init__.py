"""The inference engine: model code, paged KV cache, prefix cache, scheduler, sampling, KV transfer.

Importing this package is cheap; the heavy modules (torch) load when used.
"""
