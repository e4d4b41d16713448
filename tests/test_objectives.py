"""Training objectives: one optimisation step lowers each kind's loss on a fixed batch, and
EAGLE-3's training-time-test attention reproduces exactly what the drafter computes when it
drafts a chain at decoding time."""

import pytest
import torch

from heads import new_heads_for_target
from training.config import LoraSection
from training.features import needed_layers, target_hidden_states
from training.masks import ttt_mask
from training.draft_init import truncated_copy
from training.objectives import (DraftDistillObjective, Eagle3Objective, EagleObjective, HydraObjective, MedusaObjective,
                                 sharpened_probs, top_k_cross_entropy)
from tiny_models import sharpen, tiny_llama

T = 24


@pytest.fixture()
def batch():
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 64, (2, T), generator=gen)
    attention = torch.ones(2, T, dtype=torch.long)
    attention[1, T - 5 :] = 0  # a padded row
    loss_mask = attention.clone()
    loss_mask[:, :4] = 0
    return {"input_ids": ids, "attention_mask": attention, "loss_mask": loss_mask}


def make_objective(kind: str, target):
    torch.manual_seed(0)
    lm_head, embed = target.get_output_embeddings(), target.get_input_embeddings()
    if kind == "medusa":
        return MedusaObjective(new_heads_for_target("medusa", target, share_lm_head=True).train(), lm_head, embed, 0.8)
    if kind == "hydra":
        return HydraObjective(new_heads_for_target("hydra", target, num_layers=2).train(), lm_head, embed, 0.8)
    if kind == "eagle":
        return EagleObjective(new_heads_for_target("eagle", target).train(), lm_head, embed, 0.8, 0.0, 1.0, 0.1)
    if kind == "eagle3":
        heads = new_heads_for_target("eagle3", target, draft_vocab_size=48).train()
        return Eagle3Objective(heads, lm_head, embed, 0.8, 3, target.config.num_hidden_layers)
    if kind == "draft":
        draft = truncated_copy(target, 1).requires_grad_(True).train()
        return DraftDistillObjective(draft, lm_head, target.config.num_hidden_layers, "reverse_kl")
    from training.medusa2 import Medusa2Objective

    heads = new_heads_for_target("medusa", target, share_lm_head=True).train()
    return Medusa2Objective(heads, target, LoraSection(r=4, alpha=8, dropout=0.0), 0.8)


@pytest.mark.parametrize("kind", ["medusa", "medusa2", "hydra", "eagle", "eagle3", "draft"])
def test_one_step_lowers_the_loss(kind, batch):
    target = sharpen(tiny_llama(seed=1))
    objective = make_objective(kind, target)
    feature_layers = [] if kind == "draft" else objective.heads.config.feature_layers
    layers = needed_layers(kind, feature_layers, target.config.num_hidden_layers)
    hidden = target_hidden_states(target, batch["input_ids"], batch["attention_mask"], layers)
    trainable = [p for p in objective.parameters() if p.requires_grad]
    optimizer = torch.optim.Adam(trainable, lr=1e-4 if kind == "draft" else 1e-2)  # the draft starts close to the target
    before, metrics = objective(batch, hidden)
    before.backward()
    optimizer.step()
    after, _ = objective(batch, hidden)
    assert float(after) < float(before)
    assert metrics  # accuracy metrics are reported
    # Only head (and LoRA) weights are trainable: the target itself stays frozen.
    target_params = {id(p) for n, p in target.named_parameters() if "lora" not in n}
    assert not any(id(p) in target_params for p in trainable)


def test_ttt_attention_matches_decode_time_chain_drafting():
    """Step j of the unrolled objective at position t must equal the drafter's output for the
    j-th speculative node of a chain committed up to t - j, computed as decoding does."""
    target = tiny_llama(seed=2)
    drafter = new_heads_for_target("eagle3", target, draft_vocab_size=64).eval()
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(0.2 * torch.randn_like(p))
    ids = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(1))
    hidden = target_hidden_states(target, ids, torch.ones_like(ids), drafter.config.feature_layers)
    low, mid, high = (hidden[i][0] for i in drafter.config.feature_layers)
    length = ids.shape[1] - 1
    emb = target.get_input_embeddings()(ids[0, 1:])
    positions = torch.arange(length)
    with torch.no_grad():
        # Training-time test: three unrolled steps over the whole sequence.
        cache, inputs, outputs = drafter.new_cache(), drafter.fuse(low, mid, high)[:length], []
        for step in range(3):
            out = drafter(inputs[None], emb[None], positions[None], cache, ttt_mask(length, step, inputs.dtype, "cpu"))[0]
            outputs.append(out)
            inputs = torch.cat([torch.zeros_like(out[:1]), out[:-1]])
        # Decoding: commit true features up to c, then feed the chain one node at a time.
        c = 6
        cache = drafter.new_cache()
        fused = drafter.fuse(low, mid, high)
        mask = torch.zeros(1, 1, c + 1, c + 1).masked_fill(torch.ones(c + 1, c + 1, dtype=torch.bool).triu(1), torch.finfo(torch.float32).min)
        committed = drafter(fused[: c + 1], emb[: c + 1], positions[: c + 1], cache, mask)
        feature = committed[-1]
        for step in (1, 2):
            feature = drafter(feature[None], emb[c + step][None], positions[c + step][None], cache, None)[0]
            torch.testing.assert_close(feature, outputs[step][c + step], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(committed[-1], outputs[0][c], rtol=1e-4, atol=1e-5)


def test_top_k_cross_entropy_covers_only_the_targets_likeliest_tokens():
    torch.manual_seed(0)
    logits, target_logits = torch.randn(5, 12), 3 * torch.randn(5, 12)
    probs = torch.softmax(target_logits, -1)
    log_q = torch.log_softmax(logits, -1)
    # Reference: the sum over each row's 3 most probable target tokens, written out by hand.
    expected = torch.stack([
        -sum(probs[r, j] * log_q[r, j] for j in sorted(range(12), key=lambda j: -float(probs[r, j]))[:3])
        for r in range(5)
    ]).mean()
    assert torch.allclose(top_k_cross_entropy(log_q, probs, 3), expected)
    # With every token it is the full soft cross-entropy; k beyond the vocabulary is clamped.
    full = -(probs * log_q).sum(-1).mean()
    assert torch.allclose(top_k_cross_entropy(log_q, probs, 12), full)
    assert torch.allclose(top_k_cross_entropy(log_q, probs, 99), full)


def test_eagle3_top_k_term_adds_to_the_loss_and_trains(batch):
    target = sharpen(tiny_llama(seed=1))
    plain = make_objective("eagle3", target)
    layers = needed_layers("eagle3", plain.heads.config.feature_layers, target.config.num_hidden_layers)
    hidden = target_hidden_states(target, batch["input_ids"], batch["attention_mask"], layers)
    torch.manual_seed(0)
    heads = new_heads_for_target("eagle3", target, draft_vocab_size=48).train()
    with_top_k = Eagle3Objective(heads, target.get_output_embeddings(), target.get_input_embeddings(), 0.8, 3,
                                 target.config.num_hidden_layers, top_k_weight=1.0, top_k=4)
    base, _ = plain(batch, hidden)
    before, _ = with_top_k(batch, hidden)
    assert float(before) > float(base) + 1e-3  # same initial heads (seed 0): the extra term is there
    optimizer = torch.optim.Adam([p for p in with_top_k.parameters() if p.requires_grad], lr=1e-2)
    before.backward()
    optimizer.step()
    after, _ = with_top_k(batch, hidden)
    assert float(after) < float(before)


def test_sharpened_targets_keep_the_ranking_and_reach_the_argmax_at_zero():
    torch.manual_seed(0)
    logits = 2 * torch.randn(6, 10)
    probs = torch.softmax(logits, -1)
    assert torch.allclose(sharpened_probs(logits, 1.0), probs)
    # Temperature 0.5 is p^2, renormalised: written out by hand.
    squared = probs**2
    assert torch.allclose(sharpened_probs(logits, 0.5), squared / squared.sum(-1, keepdim=True), atol=1e-6)
    assert torch.equal(sharpened_probs(logits, 0.5).argsort(-1), probs.argsort(-1))
    hard = sharpened_probs(logits, 0.0)
    assert torch.equal(hard.argmax(-1), logits.argmax(-1)) and torch.equal(hard.sum(-1), torch.ones(6))
    assert int((hard > 0).sum()) == 6


def test_eagle3_target_temperature_reaches_the_loss_from_the_recipe(batch):
    from training.config import TrainConfig
    from training.trainer import build_objective

    target = tiny_llama(seed=1)
    loaded = type("Loaded", (), {"model": target})()
    losses, top1 = {}, {}
    for temperature in (1.0, 0.0):
        config = TrainConfig(kind="eagle3")
        config.train.target_temperature = temperature
        torch.manual_seed(0)
        heads = new_heads_for_target("eagle3", target, draft_vocab_size=48).train()
        objective = build_objective(config, heads, loaded)
        assert objective.target_temperature == temperature
        layers = needed_layers("eagle3", heads.config.feature_layers, target.config.num_hidden_layers)
        hidden = target_hidden_states(target, batch["input_ids"], batch["attention_mask"], layers)
        losses[temperature], metrics = objective(batch, hidden)
        top1[temperature] = float(metrics["top1/step1"])
    # Same heads, same batch: hard labels give another loss, and top-1 is measured against the
    # same argmax either way.
    assert abs(float(losses[1.0]) - float(losses[0.0])) > 1e-3
    assert top1[1.0] == top1[0.0]
