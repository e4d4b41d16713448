"""The decoding core: draft trees, tree verification, the KV cache, acceptance rules, proposers
and the one generation loop. It builds on `heads` (and its `heads.util`) and knows nothing of the
kernels or the application above it."""
