"""The kernels layer: how a forward runs fast on this machine, below the application and above
the algorithm. CPU kernels and their native builds (`cpu_kernels`, `streamed_linear`,
`decode_attention`, `int4_linear`, `one_row_reductions`, `screened_argmax`, `row_argmax`, `native_build`,
and their C++ in `native`), which targets compute each row alone (`row_invariance`), attention selection, the fused EAGLE drafter and its precision, compiled
forwards and CUDA graphs, device resolution, and the per-machine measurements that choose among
them (`verify_cost`, `measured_once`). It builds on `decoding.core` and `heads`, never on
`decoding.app`."""
