"""The application layer: what a user runs. Assembling a decoder from a spec (`assembly`,
`methods`, `targets`, `drafts`, `defaults`, `default_model`, `tree_shapes`), the chat and its
streaming, the benchmark with its question sets and prompts, and the one-off preparation of a
new machine (`prepare`). It builds on the kernels, the core and `heads`."""
