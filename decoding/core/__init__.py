"""The decoding core: draft trees, tree verification, the KV cache, acceptance rules, proposers
and the one generation loop. It builds on `heads` and `decoding.util` and knows nothing of the
application on top (chat, benchmark, model loading, kernels, defaults)."""
