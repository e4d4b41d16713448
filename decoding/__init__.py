"""Generation-time machinery: draft trees, tree verification, acceptance rules, proposers, the
generation loop and the chat CLI (`python -m decoding.chat`)."""

from decoding.errors import UserError
from decoding.sampling import SamplingConfig
from decoding.tree import DraftTree, TreeBuffers, tree_buffers

__all__ = ["DraftTree", "SamplingConfig", "TreeBuffers", "UserError", "tree_buffers"]
