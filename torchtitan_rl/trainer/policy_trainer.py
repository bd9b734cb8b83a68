"""PolicyTrainer: a torchtitan model, parallelized on the trainer mesh, that scores and trains.

    .venv/bin/python -m pytest tests/integration/test_policy_trainer.py tests/unit/test_model.py

Built from torchtitan parts: the model spec's config and `parallelize_fn` (FSDP2 / HSDP / TP /
EP: trainer/parallel.py),
its state-dict adapter with DCP's HF reader, and torchtitan's optimizer and LR-scheduler
containers. Shapes: B sequences, T tokens, V vocabulary, L tokens of a packed row, N scored
tokens, D model width.

Two ways to run a batch: with `micro_batch_tokens` > 0 (packed), each micro-batch's sequences
run back to back in one row (trainer/packing.py, document-causal attention) and the output
projection runs only at the scored tokens, in chunks (`head_logprobs`); with 0 (padded), the
rows run right-padded in `training.micro_batches` pieces with full logits.
"""

import contextlib
import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer
from torchtitan.components.optimizer.optimizer import ParamGroupConfig
from torchtitan.distributed import utils as dist_utils

from torchtitan_rl import batch_invariant, platform
from torchtitan_rl.config import (
    LoRASection,
    ModelSection,
    ParallelismSection,
    TrainingSection,
)
from torchtitan_rl.errors import StopRun
from torchtitan_rl.models import moe, weights
from torchtitan_rl.models.vision import encoder_inputs, vision_parameters
from torchtitan_rl.trainer import lora as lora_adapters
from torchtitan_rl.trainer import packing, parallel
from torchtitan_rl.trainer.logprobs import fused_head, token_logprobs
from torchtitan_rl.trainer.model import STUDENT, build_spec, load_hf_weights
from torchtitan_rl.types import LossScale, RolloutBatch


class NonFiniteError(StopRun):
    """A loss or gradient became NaN/inf; the message names the step and the tensor."""


# loss_fn(logprobs_BT, micro_batch, scale) -> (this micro-batch's share of the step loss,
# metrics that add up over micro-batches and ranks, e.g. counts or already-normalized sums:
# 0-dim device tensors, read once per step, or host floats)
LossFn = Callable[
    [torch.Tensor, RolloutBatch, LossScale],
    tuple[torch.Tensor, dict[str, "torch.Tensor | float"]],
]


@dataclass(frozen=True, slots=True)
class StepResult:
    """What one optimizer step reports."""

    metrics: dict[str, float]
    """Global figures: loss, grad_norm, lr, entropy, tokens and the loss function's sums."""
    logprobs_BT: torch.Tensor
    """This rank's trainer logprobs [B, T] of the batch before the update, from the step's own
    forward (no extra pass): what the generator's logprobs are compared with. Packed, only
    the scored tokens' (loss mask > 0) are computed; the rest are 0."""


def check_finite(step: int, side: str, logprobs_BT: torch.Tensor, mask_BT: torch.Tensor) -> None:
    """Stop on a NaN/inf logprob of a sampled token, naming the step and the first one."""
    bad_BT = ~torch.isfinite(logprobs_BT) & mask_BT
    if bool(bad_BT.any()):
        b, t = (int(i) for i in bad_BT.nonzero()[0])
        raise NonFiniteError(
            f"step {step}: the {side} logprob of sequence {b}, token {t} is "
            f"{float(logprobs_BT[b, t])}"
        )


def optimizer_steps_per_step(training: TrainingSection) -> int:
    """Optimizer steps in one RL step: training.mini_batches per pass, training.epochs passes."""
    return training.mini_batches * training.epochs


def _lr_scheduler_config(training: TrainingSection) -> LRSchedulersContainer.Config:
    # The schedule steps once per optimizer step; the config counts RL steps.
    warmup = training.warmup_steps * optimizer_steps_per_step(training)
    if training.lr_decay == "constant":
        # decay_ratio 0: warm up, then stay at the peak LR.
        return LRSchedulersContainer.Config(warmup_steps=warmup, decay_ratio=0.0)
    return LRSchedulersContainer.Config(warmup_steps=warmup, decay_type=training.lr_decay)


# torch's checkpoint wrapper (activation checkpointing) inserts this into parameter names;
# state dicts drop it, and so do the names weight sync pairs by.
_AC_PREFIX = "_checkpoint_wrapped_module."


class PolicyTrainer:
    """The policy: a torchtitan model sharded on this rank, its optimizer and LR schedule."""

    def __init__(
        self,
        *,
        model: ModelSection,
        training: TrainingSection,
        parallelism: ParallelismSection,
        temperature: float = 1.0,
        seed: int = 0,
        dump_folder: str = "outputs",
        group: dist.ProcessGroup | None = None,
        lora: LoRASection | None = None,
        micro_batch_tokens: int | None = None,
        router_replay: bool = False,
        checkpoint_fields: tuple[str, str] = STUDENT,
    ):
        """`group`: the trainer's ranks, the first ones of the world (default: all of it).
        `lora` (when enabled): train LoRA adapters on a frozen model (trainer/lora.py).
        `micro_batch_tokens`: the packed micro-batches' token budget, 0 for padded ones
        (default: training.micro_batch_tokens). `router_replay`: MoE layers use the
        generator's routing where a batch carries it (algorithm.router_replay).
        `checkpoint_fields`: the config fields that name `model`'s checkpoint and flavor, for
        errors (a distill teacher's differ)."""
        self.training = training
        self.micro_batch_tokens = (
            training.micro_batch_tokens if micro_batch_tokens is None else micro_batch_tokens
        )
        self.temperature = temperature
        self.head_chunk_mib = training.head_chunk_mib or platform.head_chunk_mib()
        """The fused head's chunk budget (training.head_chunk_mib)."""
        self.device = platform.device()
        self.step = 0
        self.group = group
        world_size = dist.get_world_size(group)
        self.tp_degree = parallelism.tp
        self.parallel_dims, parallelism_config = parallel.layout(parallelism, world_size)
        self.spec = build_spec(model)
        self.lora = lora if lora is not None and lora.enable else None
        if self.lora is not None:
            self.spec.model = lora_adapters.convert(self.spec.model, self.lora)
        parallel.fill_sharding_plan(self.spec, parallelism_config)
        with torch.device("meta"):
            module = self.spec.model.build()
        if batch_invariant.uses_own_kernels():
            batch_invariant.check_kernels(self.spec.model, model.dtype)
            batch_invariant.make_linears_invariant(module)
        if batch_invariant.is_enabled() and self.lora is not None:
            lora_adapters.use_merged_forward(module)
        # Losses are normalized by global token counts (LossScale): FSDP sums gradients.
        module = parallel.parallelize(
            self.spec,
            module,
            self.parallel_dims,
            parallelism_config,
            dtype=model.dtype,
            activation_checkpoint=training.activation_checkpoint,
            dump_folder=dump_folder,
            compile=training.compile,
        )
        module.to_empty(device=self.device)
        torch.manual_seed(seed)
        with torch.no_grad():
            module.init_weights(buffer_device=self.device)
        if model.hf_checkpoint is not None:
            load_hf_weights(module, self.spec, model.hf_checkpoint, group, checkpoint_fields)
        module.train()
        if model.freeze_vision:
            for param in vision_parameters(module):
                param.requires_grad_(False)
        self.model: nn.Module = module
        # The sharded parameters the optimizer updates. FSDP swaps unsharded tensors into the
        # modules between a forward and its reshard, so they are captured here, once.
        self._params = {
            name.replace(_AC_PREFIX, ""): param for name, param in module.named_parameters()
        }
        # The persistent buffers the forward reads (MoE routers' expert_bias_E): weight sync
        # sends them with the parameters. Only training.expert_bias_update_rate updates them.
        self._buffers = {
            name: tensor
            for name, tensor in weights(module, _AC_PREFIX).items()
            if name not in self._params
        }
        self._adapted = lora_adapters.adapted_modules(module, _AC_PREFIX)
        self._routers = moe.routers(module)
        self.router_replay = router_replay
        self.tp_group = (
            self.parallel_dims.get_mesh("tp").get_group() if parallelism.tp > 1 else None
        )
        """The ranks that hold this rank's batch too (tensor parallel), or None."""
        batch_mesh = self.parallel_dims.get_optional_mesh("batch")
        data_parallel = batch_mesh is not None and batch_mesh.size() > 1
        self.dp_group = batch_mesh.get_group() if data_parallel else None
        """The data-parallel ranks, which hold different batches (packed, they trade rows so
        that their token loads balance: `_deal`), or None."""

        self.optimizers = OptimizersContainer.Config(
            param_groups=[
                ParamGroupConfig(
                    pattern=r".*",
                    optimizer_name="AdamW",
                    optimizer_kwargs={
                        "lr": training.lr,
                        "betas": (0.9, 0.999),
                        "eps": 1e-8,
                        "weight_decay": training.weight_decay,
                    },
                )
            ],
            implementation=platform.optimizer_implementation(),
        ).build(model_parts=[self.model])
        self.trained_buffers: set[str] = set()
        """The buffers a step changes, which weight sync sends with every sync (frozen ones go
        with the first): the routers' correction bias under training.expert_bias_update_rate."""
        if training.expert_bias_update_rate:
            self._update_expert_bias(training.expert_bias_update_rate)
            self.trained_buffers = {n for n in self._buffers if n.endswith("moe.expert_bias_E")}
        self.lr_schedulers = _lr_scheduler_config(training).build(
            optimizers=self.optimizers,
            training_steps=training.steps * optimizer_steps_per_step(training),
        )

    def _update_expert_bias(self, rate: float) -> None:
        """Before each optimizer step, move every MoE router's correction bias by `rate` toward
        equal expert loads: torchtitan's hook (the one its specs install through
        `post_optimizer_build_fn`), over the tokens each MoE layer counted in the training
        forwards since (`tokens_per_expert_E`, summed over the data-parallel ranks), with each
        layer's `load_balance_coeff` set to `rate`. Only the sign of each expert's deviation
        counts, so the logprob passes counted besides the training one change nothing."""
        from torchtitan.components.optimizer import register_moe_load_balancing_hook

        for layer in self.model.layers.values():
            if getattr(layer, "moe_enabled", False):
                layer.moe.load_balance_coeff = rate
        register_moe_load_balancing_hook(self.optimizers, [self.model], self.parallel_dims)

    def named_parameters(self) -> dict[str, nn.Parameter]:
        """The model's parameters by torchtitan FQN: this rank's DTensors, not copies.

        Tied weights appear once (under the first name); LoRA adapters included. Weight sync
        streams `sync_sources()`.
        """
        return dict(self._params)

    def sync_sources(self) -> dict[str, "torch.Tensor | lora_adapters.Merged"]:
        """What the generator's plain model gets, by FQN: the parameters and persistent
        buffers (`models.weights`), except that with LoRA each adapted linear's weight is its
        `Merged` weight (adapters are not sent)."""
        if self.lora is None:
            return {**self._params, **self._buffers}
        return {**lora_adapters.sync_sources(self._params, self._adapted), **self._buffers}

    def merged(self):
        """Context in which the model's state dict is the plain model's (merged LoRA weights;
        a no-op without LoRA). Every rank enters."""
        if self.lora is None:
            return contextlib.nullcontext()
        return lora_adapters.merged_in_place(self.sync_sources())

    def state_dict(self) -> dict[str, torch.Tensor]:
        """torchtitan's state dict (fused QKV split into wq/wk/wv, as the HF adapter expects).

        A collective: the split redistributes, so every rank must call it.
        """
        return self.model.state_dict()

    @property
    def is_mixture_of_experts(self) -> bool:
        return bool(self._routers)

    def routing_counts(self) -> tuple[int, int]:
        """(Mismatched, compared) (token, MoE layer) pairs of this rank's forwards since the
        last call, against the generator's routing the batches carried (`moe.take_counts`)."""
        return moe.take_counts(self._routers)

    def drop_routing_counts(self) -> None:
        """Forget the routing counts of the forwards since the last `routing_counts`."""
        moe.drop_counts(self._routers)

    def _expect(self, routed_BLMK: torch.Tensor | None) -> None:
        """Give the routers the generator's routing of the next forward's tokens (None: no
        routing; kept through the backward, whose activation-checkpointing recompute must
        route as the forward did)."""
        if self._routers:
            moe.expect(self._routers, routed_BLMK, self.router_replay)

    def _forward_logprobs(self, tokens_BT: torch.Tensor, routed_BTMK=None, vision=None):
        """Padded path: full logits of right-padded rows, then logprobs and entropies [B, T]."""
        self._expect(routed_BTMK)
        positions_BT = torch.arange(tokens_BT.shape[1], device=self.device).expand_as(tokens_BT)
        logits_BTV = self.model(tokens_BT, positions=positions_BT, **_images(vision))
        if isinstance(logits_BTV, DTensor):
            # Under TP the lm_head output is sharded over the vocabulary: gather it (its
            # backward slices this rank's share of the gradient back out).
            logits_BTV = logits_BTV.full_tensor()
        return token_logprobs(logits_BTV, tokens_BT, self.temperature, with_entropy=True)

    def _forward_packed(
        self, micro: RolloutBatch, row: packing.PackedRow, vision=None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Packed path: logprobs and entropies [B, T] of `micro`'s scored tokens (loss mask > 0),
        0 elsewhere, from one packed row of its sequences, each cut after its last scored token
        (`row`, planned on the host and already on the device).

        The row holds the sequences back to back, positions restarting at 0 and attention
        within each (`Documents`), so each gets what it would alone; the head runs only at
        the N positions that predict a scored token, as a call of the lm_head module
        (`fused_head`: FSDP's hooks gather and reshard it).
        """
        self._expect(row.routed(micro.routed_experts_BTMK))
        self.model._skip_lm_head = True  # the decoder returns normed hidden states
        try:
            hidden_1LD = self.model(
                row.tokens(micro.tokens_BT),
                positions=row.positions_1L,
                attention_masks=row.docs,
                **_images(vision),
            )
        finally:
            self.model._skip_lm_head = False
        if isinstance(hidden_1LD, DTensor):
            hidden_1LD = hidden_1LD.full_tensor()  # TP: sequence-parallel shards
        hidden_ND = hidden_1LD[0].index_select(0, row.predictors_N)
        scored = (row.rows_N, row.cols_N)
        logprobs_N, entropy_N = fused_head(
            self.model.lm_head,
            hidden_ND,
            micro.tokens_BT[scored],
            self.temperature,
            budget_mib=self.head_chunk_mib,
        )
        shape = micro.tokens_BT.shape
        logprobs_BT = torch.zeros(shape, device=self.device).index_put(scored, logprobs_N)
        entropy_BT = torch.zeros(shape, device=self.device).index_put(scored, entropy_N)
        return logprobs_BT, entropy_BT

    def plan(self, batch: RolloutBatch, count: int | None = None) -> list[packing.MicroBatch]:
        """`batch`'s micro-batches, planned on the host from its loss mask (`packing.plan`).

        Packed: first-fit decreasing by the tokens each row must run, into at most
        `micro_batch_tokens` each, then `count` of them: as many as the rank that needs most
        (FSDP's gathers are collective; None: found with an all-reduce). Padded:
        `training.micro_batches` pieces of consecutive rows.
        """
        mask_BT = batch.loss_mask_BT.cpu()
        if self.micro_batch_tokens and count is None:
            groups = packing.first_fit_decreasing(packing.needed(mask_BT), self.micro_batch_tokens)
            most = torch.tensor([len(groups)])
            platform.all_reduce_host(most, op=dist.ReduceOp.MAX, group=self.group)
            count = int(most[0])
        return packing.plan(
            mask_BT, self.micro_batch_tokens, count, pieces=self.training.micro_batches
        )

    def micro_batches(
        self, batch: RolloutBatch, count: int | None = None
    ) -> list[tuple[torch.Tensor, RolloutBatch]]:
        """`batch` cut into micro-batches (`plan`), each with its rows' indices in `batch`."""
        return [(m.rows_R, batch.rows(m.rows_R)) for m in self.plan(batch, count)]

    def _deal(self, batch: RolloutBatch) -> packing.Dealt:
        """Packed: the rows redealt over the data-parallel ranks (`packing.deal`), on the host;
        padded: the batch as it is."""
        if not self.micro_batch_tokens:
            return packing.Dealt(batch, None, None, lambda *tensors_BT: tensors_BT)
        return packing.deal(batch, self.micro_batch_tokens, self.dp_group, self.device)

    def _forward(
        self, micro: RolloutBatch, row: packing.PackedRow | None, vision=None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Logprobs and entropies [B, T] of `micro` (packed along `row`, or padded), whose
        images are `vision` (`_vision`); its MoE routing is compared with the generator's
        (`routing_counts`) and, with router replay, used."""
        with moe.counting(self._routers):
            if row is not None:
                return self._forward_packed(micro, row, vision)
            return self._forward_logprobs(micro.tokens_BT, micro.routed_experts_BTMK, vision)

    def _vision(self, images_B, planned: packing.MicroBatch, width: int):
        """The encoder's inputs for micro-batch `planned` (on the host) of a batch whose rows'
        images are `images_B` (rows of `width` tokens), on the device; None without images."""
        if images_B is None:
            return None
        rows = planned.rows_R.tolist()
        if planned.row is None:  # padded: row r of the micro-batch starts at r * width
            offsets = [r * width for r in range(len(rows))]
        else:
            offsets = planned.row.offsets
        picked = [(images_B[b], at) for b, at in zip(rows, offsets, strict=True) if at is not None]
        return self._encoder_inputs([i for i, _ in picked], [at for _, at in picked])

    def _encoder_inputs(self, images: list, offsets: list[int]):
        """`encoder_inputs` of `images` at `offsets` with the model's patch sizes, on the
        device; None where none of them has images (a text-only model has no encoder)."""
        if all(i is None for i in images):
            return None
        encoder = self.model.vision_encoder
        inputs = encoder_inputs(images, offsets, encoder.patch_size, encoder.patch_temporal)
        return inputs.to(self.device)

    @staticmethod
    def _uploaded(batch: RolloutBatch) -> tuple[RolloutBatch, tuple | None]:
        """`batch`'s tensors on the device, and its rows' images (host objects) apart."""
        images_B = batch.images_B
        return dataclasses.replace(batch, images_B=None).map(platform.upload), images_B

    @torch.no_grad()
    def logprobs(
        self,
        tokens_BT: torch.Tensor,
        mask_BT: torch.Tensor | None = None,
        routed_BTMK: torch.Tensor | None = None,
        images_B: tuple | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Logprobs and entropies [B, T] of right-padded `tokens_BT` under logits / temperature,
        on `platform.device()`, in the micro-batches a train step would use (the memory of
        one micro-batch).

        Column t scores token t given tokens < t; column 0 is 0. Packed, only the columns where
        `mask_BT` > 0 are computed (every column when None), the others are 0.
        `routed_BTMK`: the generator's MoE routing of the tokens, `images_B`: each row's
        prompt's images (`RolloutBatch`).
        """
        if mask_BT is None:
            mask_BT = torch.ones(tokens_BT.shape)
        batch = RolloutBatch(
            tokens_BT=tokens_BT,
            loss_mask_BT=mask_BT,
            routed_experts_BTMK=routed_BTMK,
            images_B=images_B,
        )
        dealt = self._deal(batch)
        micro_batches = self.plan(dealt.batch, dealt.count)
        batch, images_B = self._uploaded(dealt.batch)
        logprobs_BT = torch.zeros(batch.tokens_BT.shape, device=self.device)
        entropy_BT = torch.zeros(batch.tokens_BT.shape, device=self.device)
        for planned in micro_batches:
            vision = self._vision(images_B, planned, batch.tokens_BT.shape[1])
            planned = planned.to(self.device)
            micro_logprobs_BT, micro_entropy_BT = self._forward(
                batch.rows(planned.rows_R), planned.row, vision
            )
            logprobs_BT[planned.rows_R] = micro_logprobs_BT
            entropy_BT[planned.rows_R] = micro_entropy_BT
        self._expect(None)
        # No backward follows to reshard the root: free its gathered parameters now.
        self._reshard()
        return dealt.back(logprobs_BT, entropy_BT)

    @torch.no_grad()
    def greedy(
        self,
        prompts: list[list[int]],
        max_tokens: int,
        stop_ids: set[int],
        images: list | None = None,
    ) -> list[list[int]]:
        """Greedy completions of `prompts` (token ids; `images`: each one's, or None), each
        ending after its first stop id or at `max_tokens`. Recomputes every sequence for each
        token (no KV cache): for the few samples an SFT evaluation shows. Every trainer rank
        calls it with the same prompts and runs `max_tokens` forwards, as FSDP's gathers are
        collective."""
        completions: list[list[int]] = [[] for _ in prompts]
        images = images or [None] * len(prompts)
        for _ in range(max_tokens):
            rows = [p + c for p, c in zip(prompts, completions, strict=True)]
            width = max(len(r) for r in rows)
            tokens_BT = torch.tensor([r + [0] * (width - len(r)) for r in rows], device=self.device)
            positions_BT = torch.arange(width, device=self.device).expand_as(tokens_BT)
            vision = self._encoder_inputs(images, [b * width for b in range(len(rows))])
            logits_BTV = self.model(tokens_BT, positions=positions_BT, **_images(vision))
            if isinstance(logits_BTV, DTensor):
                logits_BTV = logits_BTV.full_tensor()
            last_B = torch.tensor([len(r) - 1 for r in rows], device=self.device)
            next_B = logits_BTV[torch.arange(len(rows), device=self.device), last_B].argmax(-1)
            for completion, token in zip(completions, next_B.tolist(), strict=True):
                if not (completion and completion[-1] in stop_ids):
                    completion.append(token)
        self._reshard()
        return completions

    def _reshard(self) -> None:
        from torch.distributed.fsdp import FSDPModule

        for module in (self.model, self.model.lm_head):
            if isinstance(module, FSDPModule):
                module.reshard()

    def optimizer_step(
        self, batch: RolloutBatch, loss_fn: LossFn, *, step: int | None = None
    ) -> StepResult:
        """One optimizer step over this rank's `batch`, in its micro-batches
        (`plan`: packed under the token budget, or `training.micro_batches` pieces).

        A host-side plan, then a device loop over it: which rows each rank trains, how they
        pack, every index and offset, and the step's global counts are made once from the
        host loss mask before the batch goes to the device; the loop reads nothing back, and
        the step's figures (loss, entropy, the loss function's metrics, the finiteness check,
        the gradient norm) accumulate as device tensors, read together once, before the
        optimizer steps (host syncs: docs/performance.md).

        The gradient equals the full-batch gradient: each micro-batch's loss is normalized by
        the step's global token and sequence counts (LossScale) and FSDP sums over ranks.
        Raises NonFiniteError, before touching the weights, on a NaN/inf sampled-token
        logprob, loss or gradient. Metrics are global: loss, entropy (mean over loss-masked
        tokens) and loss_fn's metrics summed over micro-batches and data-parallel ranks. `step`:
        the RL step that errors name (default: this optimizer step's count).
        """
        self.step += 1
        label = self.step if step is None else step
        dealt = self._deal(batch)
        micro_batches = self.plan(dealt.batch, dealt.count)
        scale = dealt.scale or packing.padded_scale(
            dealt.batch.loss_mask_BT, self.group, self.tp_degree
        )
        batch, images_B = self._uploaded(dealt.batch)
        sums = torch.zeros(3, device=self.device)  # loss, entropy, non-finite logprobs
        metric_sums: dict[str, torch.Tensor | float] = {}
        pre_update_BT = torch.zeros(batch.tokens_BT.shape, device=self.device)
        for planned in micro_batches:
            vision = self._vision(images_B, planned, batch.tokens_BT.shape[1])
            planned = planned.to(self.device)
            micro = batch.rows(planned.rows_R)
            logprobs_BT, entropy_BT = self._forward(micro, planned.row, vision)
            detached_BT = logprobs_BT.detach()
            pre_update_BT[planned.rows_R] = detached_BT
            loss, metrics = loss_fn(logprobs_BT, micro, scale)
            loss.backward()
            self._expect(None)
            mask_BT = micro.loss_mask_BT
            non_finite = (~torch.isfinite(detached_BT) & (mask_BT > 0)).sum()
            sums += torch.stack([loss.detach(), (entropy_BT * mask_BT).sum(), non_finite])
            for name, value in metrics.items():
                value = value.detach() if isinstance(value, torch.Tensor) else value
                metric_sums[name] = metric_sums.get(name, 0.0) + value

        grad_norm = dist_utils.clip_grad_norm_(
            [p for p in self.model.parameters() if p.grad is not None],
            max_norm=self.training.max_grad_norm or math.inf,
            ep_enabled=self.parallel_dims.ep_enabled,  # experts on their own mesh
        )
        if isinstance(grad_norm, DTensor):
            grad_norm = grad_norm.full_tensor()
        names = sorted(metric_sums)
        on_device = [n for n in names if isinstance(metric_sums[n], torch.Tensor)]
        # The step's one read of the device.
        figures = [grad_norm.float()[None], sums, *(metric_sums[n][None] for n in on_device)]
        read = torch.cat(figures)
        grad_norm, local_loss, entropy_sum, non_finite, *device_values = read.cpu().tolist()
        metric_sums |= dict(zip(on_device, device_values, strict=True))
        if non_finite:
            self.optimizers.zero_grad()
            check_finite(label, "trainer", pre_update_BT, batch.loss_mask_BT > 0)
        # A NaN/inf loss on any rank makes the summed gradients non-finite on every rank, so
        # all ranks stop here together, before the weights change.
        if not math.isfinite(grad_norm):
            self.optimizers.zero_grad()
            if math.isfinite(local_loss):
                culprit = f"the gradient of {self._first_nonfinite_grad()} is not finite"
            else:
                culprit = f"the loss is {local_loss}"
            raise NonFiniteError(f"step {label}: {culprit}")

        # Rows lent to another rank come back now, while the queue is empty (the figures'
        # read drained it), not after the optimizer's kernels.
        (own_BT,) = dealt.back(pre_update_BT)
        # The metric totals travel while the optimizer steps.
        totals = torch.tensor(
            [local_loss, entropy_sum, *(metric_sums[n] for n in names)], dtype=torch.float64
        )
        reducing = platform.all_reduce_host(totals, group=self.group, async_op=True)
        lr = self.lr_schedulers.schedulers[0].get_last_lr()[0]
        self.optimizers.step()
        self.lr_schedulers.step()
        self.optimizers.zero_grad()
        reducing.wait()
        loss_total, entropy_total, *metric_totals = (totals / self.tp_degree).tolist()
        if not math.isfinite(loss_total):
            # Only a NaN with no gradient path gets here; the finite update was applied.
            raise NonFiniteError(f"step {label}: the loss is {loss_total}")
        metrics = {
            "loss": loss_total,
            "grad_norm": grad_norm,
            "lr": lr,
            "entropy": entropy_total / max(scale.tokens, 1),
            "tokens": float(scale.tokens),
            **dict(zip(names, metric_totals, strict=True)),
        }
        return StepResult(metrics=metrics, logprobs_BT=own_BT)

    def _first_nonfinite_grad(self) -> str:
        for name, param in self._params.items():
            grad = param.grad
            if grad is not None:
                local = grad.to_local() if hasattr(grad, "to_local") else grad
                if not bool(torch.isfinite(local).all()):
                    return name
        return "a parameter on another rank"


def _images(vision) -> dict:
    """The model's keyword for a forward's images (`VisionLanguageModel`), none without."""
    return {} if vision is None else {"vision": vision}
