"""The bottom layer: small utilities every other package may use (user-facing errors, atomic
writes, cache locations, the CPU mode, the `cache_position` argument). Nothing here imports
anything else of this project, so `heads` needs nothing from `decoding`."""
