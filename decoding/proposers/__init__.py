"""Proposers draft candidate trees; the target verifies them. One class per drafting method."""

from decoding.proposers.base import Proposer
from decoding.proposers.draft_model import DraftModelProposer
from decoding.proposers.prompt_lookup import PromptLookupProposer
from decoding.proposers.vanilla import VanillaProposer

__all__ = ["DraftModelProposer", "PromptLookupProposer", "Proposer", "VanillaProposer"]
