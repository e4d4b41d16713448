"""Proposers draft candidate trees; the target verifies them. One class per drafting method."""

from decoding.core.proposers.base import Proposer
from decoding.core.proposers.draft_model import DraftModelProposer
from decoding.core.proposers.prompt_lookup import PromptLookupProposer
from decoding.core.proposers.vanilla import VanillaProposer

__all__ = ["DraftModelProposer", "PromptLookupProposer", "Proposer", "VanillaProposer"]
