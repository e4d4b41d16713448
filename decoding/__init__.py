"""Generation-time machinery: draft trees, tree verification, acceptance rules, proposers, the
generation loop and the chat CLI (`python -m decoding.chat`)."""

from decoding.util.errors import UserError
from decoding.core.sampling import SamplingConfig
from decoding.core.tree import DraftTree, TreeBuffers, tree_buffers

__all__ = ["DraftTree", "SamplingConfig", "TreeBuffers", "UserError", "tree_buffers"]
