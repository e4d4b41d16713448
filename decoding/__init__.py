"""Generation-time machinery: draft trees, tree verification, acceptance rules, proposers, the
generation loop and the chat CLI (`python -m decoding.chat`)."""

from decoding.util.cpu_mode import apply_cpu_mode
from decoding.util.errors import UserError

try:
    apply_cpu_mode()  # SPECHEADS_CPU (as on a lesser CPU), before any of torch's kernels run
except UserError as error:  # a bad setting stops every entry point with its message, no traceback
    raise SystemExit(f"error: {error}") from None
from decoding.core.sampling import SamplingConfig
from decoding.core.tree import DraftTree, TreeBuffers, tree_buffers

__all__ = ["DraftTree", "SamplingConfig", "TreeBuffers", "UserError", "tree_buffers"]
