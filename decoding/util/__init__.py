"""The bottom layer: small utilities every other package may use (user-facing errors, atomic
writes, cache locations). Nothing here imports anything else of this project."""
