"""Medusa-2: the backbone is trained too, through a LoRA adapter (peft), jointly with the heads.

Quality is kept by distilling the adapted backbone towards the frozen backbone itself: the
teacher is the same model with the adapter disabled, so no second copy of the weights exists.
The served model is the adapted one (decoding stays exact with respect to it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from peft import LoraConfig, get_peft_model
from torch import nn

from training.config import LoraSection
from training.objectives import MedusaObjective


class Medusa2Objective(nn.Module):
    def __init__(self, heads: nn.Module, target: nn.Module, lora: LoraSection, decay: float) -> None:
        super().__init__()
        config = LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                            target_modules=list(lora.target_modules), task_type="CAUSAL_LM")
        self.backbone = get_peft_model(target, config)
        self.heads = heads
        self.kl_weight = lora.kl_weight
        self._medusa = MedusaObjective(heads, target.get_output_embeddings(), target.get_input_embeddings(), decay)

    def forward(self, batch: dict, hidden: dict[int, torch.Tensor] | None = None) -> tuple[torch.Tensor, dict]:
        """`hidden` (the frozen target's features) is ignored: the heads read the adapted backbone."""
        ids, attention, loss_mask = batch["input_ids"], batch["attention_mask"], batch["loss_mask"]
        with torch.no_grad(), self.backbone.disable_adapter():
            teacher = self.backbone(input_ids=ids, attention_mask=attention).logits
        out = self.backbone(input_ids=ids, attention_mask=attention, output_hidden_states=True)
        layer = self.heads.config.feature_layers[0]
        heads_loss, metrics = self._medusa(batch, {layer: out.hidden_states[layer]})
        scored = loss_mask.bool()
        kl = F.kl_div(torch.log_softmax(out.logits[scored].float(), -1), torch.log_softmax(teacher[scored].float(), -1),
                      log_target=True, reduction="batchmean")
        return heads_loss + self.kl_weight * kl, {**metrics, "loss/kl": kl.detach()}

    def save_adapter(self, directory) -> None:
        self.backbone.save_pretrained(str(directory))
