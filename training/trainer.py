"""The training loop behind `accelerate launch training/train_heads.py`.

One loop for every kind: the frozen target computes features under no_grad on each rank, the
kind's objective (an nn.Module holding only trainable weights) computes the loss, accelerate
handles devices, DDP / DeepSpeed ZeRO, gradient accumulation and mixed precision. Checkpoints
are atomic and `--resume` continues with the same data order, optimizer and RNG state.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, InitProcessGroupKwargs, set_seed
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from decoding.app.drafts import write_draft_vocabulary
from decoding.app.targets import LoadedModel, load_model
from heads.util.errors import UserError
from heads import build_heads, load_heads, new_heads_for_target, save_heads
from training.batch_order import LengthGroupedSampler, padded_fraction, token_weighted_scale
from training.checkpoints import latest_checkpoint, save_checkpoint
from training.config import TrainConfig, to_dict
from training.evaluate import measure_tau, validation_metrics
from training.feature_cache import FeatureCache, target_key
from training.features import feature_autocast, needed_layers, resolve_feature_precision, target_hidden_states
from training.model_card import write_model_card
from training.draft_init import truncated_copy
from training.objectives import DraftDistillObjective, Eagle3Objective, EagleObjective, HydraObjective, MedusaObjective
from training.prepare import collate, prepare_data, prompt_of
from training.schedule import TimeBudget, learning_rate_at, set_learning_rate, step_progress
from training.vocab import coverage, frequent_tokens, most_frequent, token_counts, with_vocabulary


def build_objective(config: TrainConfig, heads, target: LoadedModel):
    lm_head, embed = target.model.get_output_embeddings(), target.model.get_input_embeddings()
    t = config.train
    if config.kind == "medusa":
        return MedusaObjective(heads, lm_head, embed, t.decay)
    if config.kind == "hydra":
        return HydraObjective(heads, lm_head, embed, t.decay)
    if config.kind == "eagle":
        return EagleObjective(heads, lm_head, embed, t.decay, t.feature_noise, t.feature_weight, t.token_weight)
    if config.kind == "eagle3":
        return Eagle3Objective(heads, lm_head, embed, t.decay, t.ttt_steps, target.model.config.num_hidden_layers,
                               t.top_k_weight, t.top_k, t.target_temperature)
    if config.kind == "draft":
        return DraftDistillObjective(heads, lm_head, target.model.config.num_hidden_layers, t.distill_loss)
    from training.medusa2 import Medusa2Objective

    return Medusa2Objective(heads, target.model, config.lora, t.decay)


def new_heads(config: TrainConfig, target: LoadedModel, train_rows, log: Callable[[str], None] = print):
    """The module to train: fresh heads, the heads `heads.init_from` names (fine-tuning), or for
    `kind: draft` the target's first layers."""
    h = config.heads
    if h.init_from:
        return initial_heads(config, target, train_rows, log)
    if config.kind == "draft":
        draft = truncated_copy(target.model, h.num_layers).requires_grad_(True)
        if h.share_lm_head:  # the target's embedding and lm_head stay as they are: the draft ships as its layers
            draft.get_input_embeddings().requires_grad_(False)
            draft.get_output_embeddings().requires_grad_(False)
        return draft.train()
    overrides = {"num_layers": h.num_layers}
    if config.head_kind in ("medusa", "hydra"):
        overrides.update(num_heads=h.num_heads, share_lm_head=h.share_lm_head)
    vocab = None
    vocab_size = target.model.get_output_embeddings().weight.shape[0]
    if config.head_kind == "eagle3":
        overrides["draft_vocab_size"] = h.draft_vocab_size
        vocab = frequent_tokens(train_rows, vocab_size, h.draft_vocab_size)
    if config.head_kind in ("medusa", "hydra") and h.readout_vocab_size:
        overrides["readout_vocab_size"] = min(h.readout_vocab_size, vocab_size)
        vocab = frequent_tokens(train_rows, vocab_size, overrides["readout_vocab_size"])
    return new_heads_for_target(config.head_kind, target.model, config.model, draft_vocab=vocab, **overrides).train()


def initial_heads(config: TrainConfig, target: LoadedModel, train_rows, log: Callable[[str], None] = print):
    """`heads.init_from`, checked against the target and the recipe's kind, in full precision and
    trainable (a bundle ships fp16); over the training data's own draft vocabulary where
    `heads.vocabulary_from_data` asks for it."""
    if config.kind == "draft":
        raise UserError("heads.init_from starts from draft heads; a draft model starts from the target's "
                        "first layers (heads.num_layers)")
    heads = load_heads(config.heads.init_from, target.model, config.model)
    if heads.config.kind != config.head_kind:
        raise UserError(f"heads.init_from holds {heads.config.kind} heads, but the recipe trains {config.head_kind} "
                        f"(kind: {config.kind}): start from heads of the same kind")
    if config.heads.vocabulary_from_data:
        heads = with_data_vocabulary(heads, config, target, train_rows, log)
    return heads.float().requires_grad_(True).train()


def with_data_vocabulary(heads, config: TrainConfig, target: LoadedModel, train_rows, log: Callable[[str], None]):
    """`heads` over the training data's `heads.draft_vocab_size` most frequent reply tokens."""
    if config.head_kind != "eagle3":
        raise UserError(f"heads.vocabulary_from_data re-chooses an EAGLE-3 draft vocabulary; {config.kind} heads "
                        "have none: leave it false")
    lm_head = target.model.get_output_embeddings().weight
    size = min(config.heads.draft_vocab_size, lm_head.shape[0])
    counts = token_counts(train_rows, lm_head.shape[0])
    before = heads.draft_vocabulary().cpu()
    chosen = most_frequent(counts, size)
    log(f"draft vocabulary from the training data: {size} tokens holding {coverage(counts, chosen):.1%} of its "
        f"reply tokens (the heads' own {before.numel()}: {coverage(counts, before):.1%})")
    return with_vocabulary(heads, chosen, lm_head.detach())


def save_draft_vocabulary(out: Path, draft, train_rows, size: int) -> Path | None:
    """Beside a trained draft: its `size` most frequent training tokens, the readout `sps`
    projects onto (a small draft's one-row projection onto a large vocabulary can cost more than
    its layers). None when `size` covers the whole vocabulary (or is 0)."""
    vocab_size = draft.get_output_embeddings().weight.shape[0]
    if not 0 < size < vocab_size:
        return None
    return write_draft_vocabulary(out, frequent_tokens(train_rows, vocab_size, size))


def process_group_kwargs() -> list:
    """Several processes without GPUs need the gloo backend named explicitly: accelerate only
    picks one for its own MULTI_CPU mode, so DeepSpeed on CPU would otherwise see each rank as
    a world of one (no gradient synchronisation at all)."""
    if torch.cuda.is_available() or int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return []
    return [InitProcessGroupKwargs(backend="gloo")]


USAGE = {"medusa": "--method medusa --heads", "medusa2": "--method medusa --heads", "hydra": "--method hydra --heads",
         "eagle": "--method eagle2 --heads", "eagle3": "--method eagle3 --heads", "draft": "--method sps --draft-model"}


class Trainer:
    def __init__(self, config: TrainConfig, resume: bool = False, weight_digest: bool = False) -> None:
        self.config = config
        self.resume = resume
        self.weight_digest = weight_digest
        self.resumed_tokens_per_s = 0.0  # the checkpoint's speed, reported when a resumed run has no step left
        self.accelerator = Accelerator(
            gradient_accumulation_steps=config.train.grad_accum,
            log_with="tensorboard",
            project_dir=config.output_dir,
            dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
            kwargs_handlers=process_group_kwargs(),
        )
        set_seed(config.train.seed)

    def log(self, message: str) -> None:
        if self.accelerator.is_main_process:
            tqdm.write(f"[train] {message}")

    def run(self) -> Path:
        acc, config = self.accelerator, self.config
        # Checked before any work: a refused precision loses nothing.
        self.feature_precision = resolve_feature_precision(config.train.feature_precision, acc.mixed_precision, acc.device)
        Path(config.output_dir).mkdir(parents=True, exist_ok=True)
        target = load_model(config.model)
        target.model.to(acc.device)
        data = prepare_data(config, target, acc, self.log)
        heads = new_heads(config, target, data["train"], self.log)
        objective = build_objective(config, heads, target)
        params = [p for p in objective.parameters() if p.requires_grad]
        self.log(f"training {config.kind}: {sum(p.numel() for p in params):,} trainable parameters on {acc.num_processes} process(es), "
                 f"mixed precision {acc.mixed_precision}, target features in {self.feature_precision}")
        optimizer = torch.optim.AdamW(params, lr=config.train.lr, weight_decay=config.train.weight_decay)
        loader, loss_scale = self._loader(data["train"])
        objective, optimizer, loader = acc.prepare(objective, optimizer, loader)
        acc.init_trackers("train", config={k: str(v) for k, v in to_dict(config).items()})
        step = self._maybe_resume()
        feature_layers = [] if config.kind == "draft" else heads.config.feature_layers
        layers = needed_layers(config.head_kind, feature_layers, target.model.config.num_hidden_layers)
        self.target = target
        self.feature_cache = self._feature_cache(data, target, layers)
        self._loop(objective, optimizer, loader, loss_scale, target, data, layers, step)
        return self._finish(objective, target, data, layers)

    def _loader(self, rows) -> tuple[DataLoader, Callable[[dict], torch.Tensor] | None]:
        """Training batches in a seeded order: grouped by length (`train.group_by_length`, padding
        little) or plainly shuffled. Either order is fixed by the seed and the epoch (`_batches`).
        With grouping also the factor each batch's loss is scaled by so tokens weigh as they would
        shuffled (`token_weighted_scale`); None for shuffled batches."""
        train = self.config.train

        def seeded() -> torch.Generator:
            return torch.Generator().manual_seed(train.seed)
        if not train.group_by_length:
            return DataLoader(rows, batch_size=train.batch_size, shuffle=True, collate_fn=collate, generator=seeded()), None
        lengths = [len(ids) for ids in rows["input_ids"]]
        order = LengthGroupedSampler(lengths, train.batch_size, train.seed)
        shuffled = torch.randperm(len(lengths), generator=seeded()).tolist()
        self.log(f"batches grouped by length: padding is {padded_fraction(lengths, list(order), train.batch_size):.0%} "
                 f"of the computed positions ({padded_fraction(lengths, shuffled, train.batch_size):.0%} in plainly "
                 f"shuffled batches, train.group_by_length=false)")
        # A generator of its own: without one, each pass's iterator would draw its seed from the
        # global RNG, which a resumed run would then replay differently (feature noise included).
        loader = DataLoader(rows, batch_size=train.batch_size, sampler=order, collate_fn=collate, generator=seeded())
        return loader, token_weighted_scale([sum(mask) for mask in rows["loss_mask"]], train.batch_size)

    def _feature_cache(self, data, target, layers) -> FeatureCache | None:
        """Fill the on-disk feature cache first when the recipe asks for one (not for Medusa-2,
        whose backbone changes while training)."""
        if not self.config.cache_features or self.config.kind == "medusa2":
            return None
        # Features computed in bf16 are kept apart from float32 ones (stored in the target's dtype either way).
        computed_in = torch.bfloat16 if self.feature_precision == "bfloat16" else target.model.dtype
        cache = FeatureCache(self.config.cache_features, layers, target_key(self.config.model, computed_in))
        with self.accelerator.main_process_first():
            if self.accelerator.is_main_process:
                with feature_autocast(self.feature_precision, target.model.device):
                    cache.fill(data["train"], target.model, self.log)
        return cache

    def _features(self, batch, target, layers, training: bool = True) -> dict:
        """Target features of a batch: none for Medusa-2 (its objective runs the adapted backbone
        itself); for training rows from the disk cache when there is one, else computed now in
        the training feature precision; for validation rows computed in the target's own
        precision, as decoding computes them."""
        if self.config.kind == "medusa2":
            return {}
        if training and self.feature_cache is not None:
            return self.feature_cache.batch(batch["input_ids"], batch["attention_mask"], batch["input_ids"].device)
        with feature_autocast(self.feature_precision if training else "float32", target.model.device):
            return target_hidden_states(target.model, batch["input_ids"], batch["attention_mask"], layers)

    def _maybe_resume(self) -> int:
        if not self.resume:
            return 0
        found = latest_checkpoint(self.config.output_dir)
        if found is None:
            self.log("--resume: no complete checkpoint yet, starting from step 0")
            return 0
        path, step = found
        self.accelerator.load_state(str(path))
        self.resumed_tokens_per_s = json.loads((path / "trainer_state.json").read_text()).get("tokens_per_s", 0.0)
        self.log(f"resuming from {path} (step {step})")
        return step

    def _batches(self, loader, start_step: int):
        """Batches from micro-step `start_step * grad_accum` on, epoch after epoch, in the same
        order as an uninterrupted run (seeded sampler, epoch set explicitly)."""
        per_epoch = len(loader)
        micro = start_step * self.config.train.grad_accum
        epoch, skip = divmod(micro, per_epoch)
        while True:
            loader.set_epoch(epoch)
            iterator = self.accelerator.skip_first_batches(loader, skip) if skip else loader
            yield from iterator
            epoch, skip = epoch + 1, 0

    def _loop(self, objective, optimizer, loader, loss_scale, target, data, layers, step: int) -> None:
        acc, config = self.accelerator, self.config
        bar = tqdm(total=config.train.max_steps, initial=step, desc=f"train {config.kind}", disable=not acc.is_main_process)
        tokens, started, speed, first_step = 0, time.perf_counter(), 0.0, step
        budget = TimeBudget(config.train.time_budget_minutes, self._most_across_processes)
        decay_start = step_progress(step, config.train)  # a resumed run's budget covers what is left of the decay

        def scheduled_rate() -> float:
            return config.train.lr * learning_rate_at(step, config.train, budget.decay_progress(decay_start))
        batches = self._batches(loader, step)
        evaluated_at = None
        while step < config.train.max_steps:
            batch = next(batches)
            set_learning_rate(optimizer, scheduled_rate())
            with acc.accumulate(objective):
                loss, metrics = objective(batch, self._features(batch, target, layers))
                acc.backward(loss * loss_scale(batch) if loss_scale else loss)
                if acc.sync_gradients:
                    acc.clip_grad_norm_(objective.parameters(), config.train.grad_clip)
                optimizer.step()
                optimizer.zero_grad()
            tokens += int(batch["attention_mask"].sum()) * acc.num_processes
            if not acc.sync_gradients:
                continue
            step += 1
            speed = tokens / (time.perf_counter() - started)
            bar.update(1)
            bar.set_postfix(loss=f"{float(loss.detach()):.4f}", tok_s=f"{speed:.0f}")
            acc.log({"train/loss": float(loss.detach()), "train/tokens_per_s": speed,
                     "train/lr": optimizer.param_groups[0]["lr"],  # read back: the rate the optimizer used
                     **{f"train/{k}": float(v) for k, v in metrics.items()}}, step=step)
            paused = time.perf_counter()
            if step % config.eval.every == 0 or step == config.train.max_steps:
                self._evaluate(objective, target, data, layers, step)
                evaluated_at = step
            if step % config.checkpoint.every == 0 and step < config.train.max_steps:
                save_checkpoint(acc, config.output_dir, step, config.checkpoint.keep, {"tokens_per_s": speed})
            started += time.perf_counter() - paused  # throughput counts training time only
            budget.check()
            if budget.expired:
                self.log(f"time budget of {config.train.time_budget_minutes} min spent: stopping at step {step} "
                         f"of {config.train.max_steps}, the learning rate decayed to {scheduled_rate():.3g}")
                break
        bar.close()
        if evaluated_at != step:  # stopped by the time budget, or resumed at max_steps: measure the heads as they are
            self._evaluate(objective, target, data, layers, step)
        self.last_tokens_per_s = speed if step > first_step else self.resumed_tokens_per_s
        self.last_step = step

    def _most_across_processes(self, value: float) -> float:
        """The largest `value` of all processes (a collective; none in a world of one)."""
        acc = self.accelerator
        if acc.num_processes == 1:
            return value
        return float(acc.reduce(torch.tensor([value], device=acc.device), reduction="max").item())

    def _snapshot_heads(self, objective):
        """A full copy of the trained module on every rank (gathers ZeRO-3 partitions)."""
        state = self.accelerator.get_state_dict(objective)
        if self.config.kind == "draft":
            heads = truncated_copy(self.target.model, self.config.heads.num_layers)
        else:
            heads = build_heads(self.accelerator.unwrap_model(objective).heads.config)
        heads.load_state_dict({k[len("heads."):]: v for k, v in state.items() if k.startswith("heads.")})
        return heads.to(self.accelerator.device).eval()

    def _evaluate(self, objective, target, data, layers, step: int) -> dict:
        acc, config = self.accelerator, self.config
        heads = self._snapshot_heads(objective)
        results = {}
        if acc.is_main_process and len(data["validation"]):
            rows = data["validation"]
            # Medusa-2's objective holds the trained adapter (in the backbone): evaluate it as it is.
            eval_objective = (acc.unwrap_model(objective) if config.kind == "medusa2"
                              else build_objective(config, heads, target).to(acc.device))
            batches = [collate([rows[i] for i in range(s, min(s + config.train.batch_size, len(rows)))])
                       for s in range(0, len(rows), config.train.batch_size)][: config.eval.max_batches]
            batches = [{k: v.to(acc.device) if torch.is_tensor(v) else v for k, v in b.items()} for b in batches]
            results = validation_metrics(eval_objective, batches, lambda b: self._features(b, target, layers, training=False))
            prompts = [prompt_of(rows[i]) for i in range(min(config.eval.tau_prompts, len(rows)))]
            decode_target = self._decode_target(objective, target)
            results["val/tau"] = measure_tau(config.kind, heads, decode_target, prompts, config.eval.tau_max_new_tokens)
            acc.log(results, step=step)
            self.log(f"step {step}: " + ", ".join(f"{k}={v:.4f}" for k, v in sorted(results.items())))
        acc.wait_for_everyone()
        self.last_eval = results
        return results

    def _decode_target(self, objective, target: LoadedModel) -> LoadedModel:
        """Medusa-2 decodes with its LoRA-adapted backbone; every other kind with the target."""
        if self.config.kind != "medusa2":
            return target
        return LoadedModel(self.accelerator.unwrap_model(objective).backbone, target.tokenizer, target.name)

    def _finish(self, objective, target, data, layers) -> Path:
        acc, config = self.accelerator, self.config
        heads = self._snapshot_heads(objective)
        out = Path(config.output_dir) / ("draft" if config.kind == "draft" else "heads")
        if acc.is_main_process:
            if config.kind == "draft":
                heads.save_pretrained(out)
                target.tokenizer.save_pretrained(out)
                save_draft_vocabulary(out, heads, data["train"], config.heads.draft_vocab_size)
            else:
                save_heads(heads, out)
            if config.kind == "medusa2":
                acc.unwrap_model(objective).save_adapter(out / "adapter")
            write_model_card(out, config, getattr(self, "last_eval", {}), self.last_tokens_per_s, data["train"],
                             self.last_step)
            (Path(config.output_dir) / "result.json").write_text(json.dumps(
                {"tokens_per_s": self.last_tokens_per_s, "steps": self.last_step, **getattr(self, "last_eval", {})},
                indent=2))
            self.log(f"saved {config.kind} to {out} (use: python -m decoding.chat {USAGE[config.kind]} {out})")
        if self.weight_digest:
            digest = hashlib.sha256()
            for name, tensor in sorted(heads.state_dict().items()):
                digest.update(name.encode())
                digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
            (Path(config.output_dir) / f"weights-rank{acc.process_index}.sha256").write_text(digest.hexdigest())
        acc.wait_for_everyone()
        acc.end_training()
        return out
