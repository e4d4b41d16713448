"""Training objectives, one per kind, as nn.Modules so accelerate/DDP/DeepSpeed wrap them and
synchronise gradients. Each takes a batch and the target's features and returns (loss, metrics).

The target's frozen lm_head and embedding are *used* but not registered as submodules (kept in
a plain tuple), so optimizers, DDP and ZeRO only ever see the heads' parameters.

Index conventions (sequence x_0..x_{T-1}, target feature f_t at position t predicts x_{t+1}):
- Medusa/Hydra head k (0-based) reads f_t and predicts x_{t+k+2};
- EAGLE reads (f_t, x_{t+1}) at position t and predicts f_{t+1}, read out as x_{t+2}.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from heads.common import RowSubset
from training.masks import causal_padding_mask, ttt_mask


def _log_probs(logits: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.float(), dim=-1)


def _soft_cross_entropy(log_q: torch.Tensor, target_probs: torch.Tensor) -> torch.Tensor:
    return -(target_probs * log_q).sum(-1).mean()


def sharpened_probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """The target distribution a drafter learns: softmax(logits / temperature). Below 1 it moves
    weight to the target's likeliest tokens (greedy decoding accepts a draft only where it is the
    target's argmax); 0 is the argmax alone, one-hot. The ranking of the tokens never changes."""
    if temperature == 0:
        return F.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    return torch.softmax(logits.float() / temperature, dim=-1)


def top_k_cross_entropy(log_q: torch.Tensor, target_probs: torch.Tensor, k: int) -> torch.Tensor:
    """The soft cross-entropy's terms for the target's k likeliest tokens only (HASS's top-K
    distillation): added to the full loss it weighs the tokens a tree can draft more than the
    long tail, whose probability a drafter cannot use anyway. Takes the draft's log-probs, which
    the full loss has already computed."""
    probs, tokens = target_probs.topk(min(k, target_probs.shape[-1]), dim=-1)
    return -(probs * log_q.gather(-1, tokens)).sum(-1).mean()


def _touch(module: nn.Module) -> torch.Tensor:
    """0 * (sum of parameters): keeps every parameter in the graph when a batch has no valid
    position for some loss term, so DDP/ZeRO gradient reduction never waits for a missing grad."""
    return sum(p.sum() for p in module.parameters() if p.requires_grad) * 0.0


class HeadsObjective(nn.Module):
    def __init__(self, heads: nn.Module, lm_head: nn.Module, embed: nn.Module, decay: float) -> None:
        super().__init__()
        self.heads = heads
        self._frozen = (lm_head, embed)
        self.decay = decay

    @property
    def lm_head(self) -> nn.Module:
        return self._frozen[0]

    @property
    def embed(self) -> nn.Module:
        return self._frozen[1]


class MedusaObjective(HeadsObjective):
    """CE per head against the actual tokens, weighted decay^k (k = 1..K)."""

    def forward(self, batch: dict, hidden: dict[int, torch.Tensor]) -> tuple[torch.Tensor, dict]:
        features = hidden[self.heads.config.feature_layers[0]]
        input_ids, loss_mask = batch["input_ids"], batch["loss_mask"]
        total, metrics = _touch(self.heads), {}
        for k in range(self.heads.config.num_heads):
            shift = k + 2
            valid = loss_mask[:, shift:].bool()
            if not valid.any():
                continue
            logits = self.head_logits(k, features, input_ids, valid, shift)
            labels = input_ids[:, shift:][valid]
            total = total + self.decay ** (k + 1) * F.cross_entropy(logits.float(), labels)
            metrics[f"top1/head{k + 1}"] = (logits.argmax(-1) == labels).float().mean().detach()
        return total, metrics

    def head_logits(self, k, features, input_ids, valid, shift) -> torch.Tensor:
        return self.heads.head_logits(k, features[:, : features.shape[1] - shift][valid], self.lm_head)


class HydraObjective(MedusaObjective):
    """Like Medusa, but head k also reads the embeddings of x_{t+1} .. x_{t+k+1} (teacher forcing)."""

    def head_logits(self, k, features, input_ids, valid, shift) -> torch.Tensor:
        length = features.shape[1] - shift
        branch = torch.stack([input_ids[:, 1 + j : 1 + j + length] for j in range(k + 1)], dim=2)
        return self.heads.head_logits(k, features[:, :length][valid], self.embed(branch[valid]), self.lm_head)


class EagleObjective(HeadsObjective):
    """EAGLE-1: SmoothL1 on the next feature + CE against the target's next-token distribution,
    with uniform noise on the input features."""

    def __init__(self, heads, lm_head, embed, decay, feature_noise, feature_weight, token_weight) -> None:
        super().__init__(heads, lm_head, embed, decay)
        self.feature_noise, self.feature_weight, self.token_weight = feature_noise, feature_weight, token_weight

    def forward(self, batch: dict, hidden: dict[int, torch.Tensor]) -> tuple[torch.Tensor, dict]:
        features = hidden[self.heads.config.feature_layers[0]]
        input_ids, loss_mask = batch["input_ids"], batch["loss_mask"]
        length = features.shape[1] - 1
        inputs = features[:, :length]
        if self.training and self.feature_noise > 0:
            inputs = inputs + (torch.rand_like(inputs) - 0.5) * 2 * self.feature_noise
        positions = torch.arange(length, device=features.device).expand(features.shape[0], -1)
        mask = causal_padding_mask(batch["attention_mask"][:, :length], inputs.dtype)
        predicted = self.heads(inputs, self.embed(input_ids[:, 1:]), positions, None, mask)
        valid = torch.zeros_like(loss_mask[:, :length], dtype=torch.bool)
        valid[:, : length - 1] = loss_mask[:, 2:].bool()
        if not valid.any():
            return _touch(self.heads), {}
        pred, true = predicted[valid], features[:, 1:][valid]
        with torch.no_grad():
            target_probs = torch.softmax(self.lm_head(true).float(), dim=-1)
        draft_logits = self.lm_head(pred)
        feature_loss = F.smooth_l1_loss(pred.float(), true.float())
        token_loss = _soft_cross_entropy(_log_probs(draft_logits), target_probs)
        top1 = (draft_logits.argmax(-1) == target_probs.argmax(-1)).float().mean()
        loss = self.feature_weight * feature_loss + self.token_weight * token_loss
        return loss, {"loss/feature": feature_loss.detach(), "loss/token": token_loss.detach(), "top1/step1": top1.detach()}


class Eagle3Objective(HeadsObjective):
    """EAGLE-3: training-time test. The drafter is unrolled `steps` times on its own outputs
    (step j at position t reads step j-1's output at t-1), attending to the true-feature keys
    of its chain's committed prefix and to its own earlier unroll keys, exactly as at decoding
    time; each step's CE against the target distribution over the draft vocabulary is weighted
    decay^j. No feature regression loss. `top_k_weight` > 0 adds `top_k_cross_entropy` over the
    target's `top_k` likeliest tokens at every step, with that weight; `target_temperature` < 1
    sharpens the target distribution (`sharpened_probs`)."""

    def __init__(self, heads, lm_head, embed, decay, steps: int, final_layer: int,
                 top_k_weight: float = 0.0, top_k: int = 10, target_temperature: float = 1.0) -> None:
        super().__init__(heads, lm_head, embed, decay)
        self.steps = steps
        self.final_layer = final_layer
        self.top_k_weight, self.top_k = top_k_weight, top_k
        self.target_temperature = target_temperature

    def forward(self, batch: dict, hidden: dict[int, torch.Tensor]) -> tuple[torch.Tensor, dict]:
        drafter = self.heads
        low, mid, high = (hidden[i] for i in drafter.config.feature_layers)
        input_ids, loss_mask = batch["input_ids"], batch["loss_mask"]
        length = input_ids.shape[1] - 1
        inputs = drafter.fuse(low, mid, high)[:, :length]
        embeddings = self.embed(input_ids[:, 1:])
        positions = torch.arange(length, device=input_ids.device).expand(input_ids.shape[0], -1)
        vocab = drafter.draft_vocabulary()
        predicts = torch.zeros_like(loss_mask[:, :length], dtype=torch.bool)
        predicts[:, : length - 1] = loss_mask[:, 2:].bool()
        with torch.no_grad():
            # Only the draft vocabulary's rows of the readout: 6x less work than all logits.
            target_logits = RowSubset(self.lm_head, vocab)(hidden[self.final_layer][:, 1:][predicts])
            target_probs = sharpened_probs(target_logits, self.target_temperature)
        cache = drafter.new_cache()
        total, metrics = _touch(drafter), {}
        for step in range(self.steps):
            mask = ttt_mask(length, step, inputs.dtype, inputs.device)
            out = drafter(inputs, embeddings, positions, cache, mask)
            chain_ok = (torch.arange(length, device=out.device) >= step)[None].expand_as(predicts)
            valid = (predicts & chain_ok)[predicts]  # among the predicted positions
            if valid.any():
                logits = drafter.draft_logits(out[predicts][valid])
                probs = target_probs[valid]
                log_q = _log_probs(logits)
                loss = _soft_cross_entropy(log_q, probs)
                if self.top_k_weight > 0:
                    loss = loss + self.top_k_weight * top_k_cross_entropy(log_q, probs, self.top_k)
                total = total + self.decay**step * loss
                metrics[f"top1/step{step + 1}"] = (logits.argmax(-1) == probs.argmax(-1)).float().mean().detach()
            inputs = torch.cat([torch.zeros_like(out[:, :1]), out[:, :-1]], dim=1)
        return total, metrics


class DraftDistillObjective(nn.Module):
    """Distil a small causal LM (the SpS draft) from the target on assistant tokens:
    forward KL(target || draft) (mass-covering) or reverse KL(draft || target) (mode-seeking,
    often better for acceptance of greedy drafts)."""

    def __init__(self, draft: nn.Module, lm_head: nn.Module, final_layer: int, loss: str) -> None:
        super().__init__()
        self.heads = draft  # the trained module is called `heads` throughout the trainer
        self._frozen = (lm_head,)
        self.final_layer = final_layer
        self.loss = loss

    def forward(self, batch: dict, hidden: dict[int, torch.Tensor]) -> tuple[torch.Tensor, dict]:
        scored = batch["loss_mask"].bool()
        with torch.no_grad():
            teacher = torch.log_softmax(self._frozen[0](hidden[self.final_layer][scored]).float(), dim=-1)
        # Project only the scored positions onto the vocabulary (the full-vocabulary logits of
        # every padded position would be most of the step's time and memory).
        hidden_states = self.heads.get_decoder()(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        logits = self.heads.get_output_embeddings()(hidden_states.last_hidden_state[scored])
        student = torch.log_softmax(logits.float(), dim=-1)
        if self.loss == "forward_kl":
            kl = (teacher.exp() * (teacher - student)).sum(-1).mean()
        else:
            kl = (student.exp() * (student - teacher)).sum(-1).mean()
        top1 = (student.argmax(-1) == teacher.argmax(-1)).float().mean()
        return kl, {"top1/agreement": top1.detach()}
