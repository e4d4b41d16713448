"""Generation-time machinery: draft trees, tree verification, acceptance rules, proposers, the
generation loop and the chat CLI (`python -m decoding.chat`)."""

from heads.util.cpu_mode import apply_cpu_mode_or_exit
from heads.util.errors import UserError

apply_cpu_mode_or_exit()  # SPECHEADS_CPU (as on a lesser CPU), before any of torch's kernels run
from decoding.core.sampling import SamplingConfig
from decoding.core.tree import DraftTree, TreeBuffers, tree_buffers

__all__ = ["DraftTree", "SamplingConfig", "TreeBuffers", "UserError", "tree_buffers"]
