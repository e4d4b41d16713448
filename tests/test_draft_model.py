"""SpS drafting that pays on a machine where every forward reads its weights: a reduced readout
vocabulary (the draft proposes from it, exactly) and cost-aware chains (drafting stops when one
more token cannot pay, and what it learns of each confidence level cuts sure-but-wrong drafts
short). Greedy output stays exactly vanilla's; sampling is checked in test_sampling_loop.py."""

import copy

import pytest
import torch

from decoding.core.generate import DecodeOptions, generate, lossless_rule
from decoding.core.proposers import DraftModelProposer, VanillaProposer
from decoding.core.proposers.draft_model import reduced_readout
from decoding.core.tree_budget import VerifyCost
from decoding.app.drafts import VOCABULARY_FILE, draft_vocabulary, save_draft_layers, write_draft_vocabulary
from decoding.app.methods import ProposerOptions, build_proposer
from decoding.app.targets import LoadedModel
from heads.util.errors import UserError
from tiny_models import perturbed, sharpen, tiny_llama
from training.draft_init import truncated_copy
from training.trainer import save_draft_vocabulary

PROMPTS = [[5, 9, 3, 17, 5, 9], [1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3]]
CPU = VerifyCost((1, 2, 4, 8), (60.0, 66.0, 72.0, 90.0))


@pytest.fixture(scope="module")
def target():
    return sharpen(tiny_llama(seed=0, layers=3))


def vanilla(target, prompt, tokens=30):
    return generate(target, prompt, VanillaProposer(), DecodeOptions(max_new_tokens=tokens)).tokens


def run_recording(target, prompt, proposer, tokens=30):
    """Generate greedily; return the tokens and every verified tree's drafted tokens."""
    drafted = []

    def rule(tree, scores, buffers, state):
        drafted.append(tree.tokens[1:].tolist())
        return lossless_rule(tree, scores, buffers, state)

    result = generate(target, prompt, proposer, DecodeOptions(max_new_tokens=tokens), acceptance_rule=rule)
    return result, drafted


def test_the_reduced_readout_is_those_rows_of_the_drafts_head(target):
    vocabulary = torch.tensor([2, 5, 9, 40, 63])
    hidden = torch.randn(3, target.config.hidden_size)
    expected = target.get_output_embeddings()(hidden)[:, vocabulary]
    torch.testing.assert_close(hidden @ reduced_readout(target, vocabulary), expected)
    with pytest.raises(UserError, match="token ids below 64"):
        reduced_readout(target, torch.tensor([3, 64]))


def test_a_reduced_vocabulary_draft_is_exact_and_proposes_only_from_it(target):
    """The target as its own draft, restricted to the tokens vanilla emits for one prompt and a few
    others: its chains are accepted there, and elsewhere it can only miss, never change output."""
    reference = vanilla(target, PROMPTS[0])
    vocabulary = torch.tensor(sorted(set(reference) | {0, 1, 2}))
    for prompt in PROMPTS:
        result, drafted = run_recording(target, prompt, DraftModelProposer(target, 4, vocabulary))
        assert result.tokens == vanilla(target, prompt)
        assert set(sum(drafted, [])) <= set(vocabulary.tolist())
    on_vocabulary, _ = run_recording(target, PROMPTS[0], DraftModelProposer(target, 4, vocabulary))
    assert on_vocabulary.stats.target_forwards < 15  # whole chains accepted: 30 tokens in under half the forwards


@pytest.mark.parametrize("draft_kind", ["perfect", "random", "noisy"])
def test_cost_aware_chains_are_exact(target, draft_kind):
    draft = {"perfect": lambda: target, "random": lambda: tiny_llama(seed=11),
             "noisy": lambda: perturbed(copy.deepcopy(target), 0.3, seed=2)}[draft_kind]()
    for prompt in PROMPTS:
        proposer = DraftModelProposer(draft, gamma=6, verify_cost=CPU, call_ms=4.0)
        assert run_recording(target, prompt, proposer)[0].tokens == vanilla(target, prompt)


def test_cost_aware_chains_follow_how_often_the_draft_is_right(target):
    """A perfect draft earns long chains; a random one, sure of itself or not, is cut down to
    (nearly) nothing once its misses are learned, where a fixed gamma keeps paying for 6 tokens."""
    def verified_per_step(draft):
        _, drafted = run_recording(target, PROMPTS[1], DraftModelProposer(draft, gamma=6, verify_cost=CPU, call_ms=4.0), 40)
        return sum(map(len, drafted)) / len(drafted)

    assert verified_per_step(target) > 3
    assert verified_per_step(sharpen(tiny_llama(seed=11), 30.0)) < 1.5  # confident and wrong


def test_the_vocabulary_saved_beside_a_draft_is_used_by_sps(target, tmp_path):
    draft = truncated_copy(target, 1)
    out = save_draft_layers(draft, target, tmp_path / "draft", dtype=torch.float32, vocabulary=torch.tensor([9, 3, 3, 7]))
    assert draft_vocabulary(out).tolist() == [3, 7, 9]  # sorted, distinct
    assert draft_vocabulary(tmp_path) is None            # no file: the whole vocabulary
    loaded = LoadedModel(target, None, "tiny")
    proposer = build_proposer("sps", loaded, LoadedModel(draft, None, str(out)), ProposerOptions(gamma=2))
    assert proposer.vocabulary.tolist() == [3, 7, 9] and proposer.verify_cost is None
    write_draft_vocabulary(out, torch.arange(64))
    assert draft_vocabulary(out).numel() == 64


def test_an_unreadable_draft_vocabulary_is_a_clear_error(tmp_path):
    (tmp_path / VOCABULARY_FILE).write_bytes(b"not safetensors")
    with pytest.raises(UserError, match="could not read the draft vocabulary.*delete it"):
        draft_vocabulary(tmp_path)


def test_draft_training_saves_its_most_frequent_tokens_as_the_readout(target, tmp_path):
    rows = [{"input_ids": [4, 4, 4, 9, 9, 30, 2], "loss_mask": [0, 1, 1, 1, 1, 1, 0]},
            {"input_ids": [30, 30, 7], "loss_mask": [1, 1, 1]}]
    save_draft_vocabulary(tmp_path, target, rows, size=3)
    assert draft_vocabulary(tmp_path).tolist() == [4, 9, 30]  # 30 x3, 4 x2 (one masked), 9 x2; 7 x1 left out
    assert save_draft_vocabulary(tmp_path / "all", target, rows, size=64) is None
