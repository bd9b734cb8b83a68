"""The mixture-of-experts modules this project builds in place of torchtitan's own: the same
parameters, names and routing, computed in the model's dtype, batch-invariant when the mode is
on, and with a seam for recording and replaying the experts each token went to.

    .venv/bin/python -m pytest tests/unit/test_models.py

- `Experts` replaces `GroupedExperts`, whose forward casts every expert GEMM to bf16 (a GPU
  training choice): an fp32 model's experts then differ from an HF or vLLM forward of the same
  checkpoint by ~1e-2. Ours runs `torch._grouped_mm` in the input's dtype (bf16 under FSDP's
  bf16 mixed precision, so GPU training is unchanged). Under batch-invariant mode
  (`batch_invariant.make_linears_invariant` sets each module's `batch_invariant`) it loops
  over the experts with `batch_invariant.ops.linear`, whose rows do not depend on how many
  tokens an expert got (grouped_mm's do: each group is a GEMM of that many rows); where the
  run has a TP side, each expert's down projection reduces in the canonical slices and the
  TP generator's ranks finish every routed row's sum before the dispatcher's (`_canonical`).
  Compiled (vLLM's generator, `training.compile`), its GEMMs in any dtype but bf16 run as one
  opaque op, `torchtitan_rl::grouped_mm`: torch's own is traced only in bf16 (its shape
  function refuses fp32, which eager runs).
- `OssExperts` replaces gpt-oss's `GptOssGroupedExperts` (biased, clamped SwiGLU over
  interleaved gate/up rows), likewise: its own dtype, or looped under batch-invariant mode.
- `Router` replaces `TokenChoiceTopKRouter`: the gate runs in fp32 as torchtitan intends (its
  `torch.autocast(float32)` is a no-op on CPU, which has no fp32 autocast, and warns each
  call), through `ops.linear` under batch-invariant mode. `Router.capture_TK` writes routing out
  in place (the generator's capture); `expect` gives the trainer's routers the generator's, to count
  mismatches (`moe/routing_mismatch`) and to replay it (`algorithm.router_replay`).

Shapes: T tokens, D model dim, F expert hidden dim, E experts, K experts per token, R routed
rows (T * K, grouped by expert).
"""

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torchtitan.models.common.moe import GroupedExperts, TokenChoiceTopKRouter
from torchtitan.models.gpt_oss.moe import GptOssGroupedExperts, ScaleBiasForward, swiglu

from torchtitan_rl.batch_invariant import ops

# State-dict entries an HF checkpoint has no tensor for: torchtitan's auxiliary-loss-free
# load-balancing bias (HF's Qwen3-MoE routes by the plain top-k, i.e. with this bias at 0).
NOT_IN_HF = ("moe.expert_bias_E",)


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """The rank's shard of a DTensor (a plain tensor as is): under EP/FSDP the expert weights
    are DTensors and the routed rows plain local tensors; under TP a Gated DeltaNet layer's
    weights and projections are the rank's heads."""
    return t.to_local() if isinstance(t, DTensor) else t


class Experts(GroupedExperts):
    """SwiGLU experts over routed rows grouped by expert: w2(silu(w1 x) * w3 x), in x's dtype."""

    @dataclass(kw_only=True, slots=True)
    class Config(GroupedExperts.Config):
        pass

    batch_invariant = False
    """Loop over the experts with batch-invariant GEMMs (`make_linears_invariant` sets it)."""
    reduction_width: int | None = None
    """Under the mode with a TP side: the width of the canonical slices of the experts' down
    projection (`_canonical`); None: one GEMM."""
    tp_combine = None
    """Where a TP generator splits every expert's hidden units: the combine of the ranks'
    partial sums (generator/tensor_parallel.py)."""

    def __init__(self, config: Config):
        super().__init__(config)
        self.hidden_dim = config.hidden_dim  # whole, however the weights are split later

    def forward(self, x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor):
        w1_EFD, w2_EDF, w3_EFD = (
            local_shard(w).to(x_RD.dtype) for w in (self.w1_EFD, self.w2_EDF, self.w3_EFD)
        )
        if self.batch_invariant and self.reduction_width is not None:
            weights = [w1_EFD, w2_EDF, w3_EFD]
            return _canonical(self, x_RD, num_tokens_per_expert_E, weights)
        if self.batch_invariant:
            return _looped(x_RD, num_tokens_per_expert_E, [w1_EFD, w2_EDF, w3_EFD])
        offsets_E = torch.cumsum(num_tokens_per_expert_E, dim=0, dtype=torch.int32)
        h_RF = F.silu(grouped_mm(x_RD, w1_EFD.transpose(-2, -1), offsets_E))
        h_RF = h_RF * grouped_mm(x_RD, w3_EFD.transpose(-2, -1), offsets_E)
        return grouped_mm(h_RF, w2_EDF.transpose(-2, -1), offsets_E)


class OssExperts(GptOssGroupedExperts):
    """gpt-oss's experts: mlp2(swiglu(mlp1 x + b1)) + b2, swiglu clamped at `swiglu_limit`
    over interleaved (glu, linear) rows of mlp1 (torchtitan's `swiglu`), in x's dtype."""

    @dataclass(kw_only=True, slots=True)
    class Config(GptOssGroupedExperts.Config):
        pass

    batch_invariant = False
    """Loop over the experts with batch-invariant GEMMs (`make_linears_invariant` sets it)."""
    reduction_width: int | None = None
    """As `Experts.reduction_width`."""
    tp_combine = None
    """As `Experts.tp_combine`."""

    tp_degree = 1
    """The ranks whose partial outputs are summed, each adding 1 / tp_degree of the output
    bias: under the trainer's TP read from the weights' mesh; on a tensor-parallel
    generator's plain local shards set by `generator.tensor_parallel.localize`."""

    def __init__(self, config: Config):
        super().__init__(config)
        self.hidden_dim = config.hidden_dim  # whole, however the weights are split later

    def forward(self, x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor):
        weights = (self.mlp1_weight_EGD, self.mlp1_bias_EG, self.mlp2_weight_EDF, self.mlp2_bias_ED)
        w1_EGD, b1_EG, w2_EDF, b2_ED = (local_shard(w).to(x_RD.dtype) for w in weights)
        limit = self.swiglu_limit
        if self.batch_invariant and self.reduction_width is not None:
            weights = [w1_EGD, b1_EG, w2_EDF, b2_ED]
            return _canonical(self, x_RD, num_tokens_per_expert_E, weights, limit)
        # Under TP every rank adds its share of the output bias before the partial sums are
        # reduced (torchtitan divides it by the TP degree in the forward only).
        tp = max(self.tp_degree, _tp_degree(self.mlp1_weight_EGD))
        if self.batch_invariant:
            b2_ED = b2_ED if tp == 1 else ScaleBiasForward.apply(b2_ED, tp, x_RD.dtype)
            weights = [w1_EGD, b1_EG, w2_EDF, b2_ED]
            return _looped(x_RD, num_tokens_per_expert_E, weights, limit)
        offsets_E = torch.cumsum(num_tokens_per_expert_E, dim=0, dtype=torch.int32)
        h_RG = grouped_mm(x_RD, w1_EGD.transpose(-2, -1), offsets_E)
        h_RF = swiglu(h_RG + _per_row(b1_EG, num_tokens_per_expert_E, x_RD.shape[0]), limit=limit)
        out_RD = grouped_mm(h_RF, w2_EDF.transpose(-2, -1), offsets_E)
        b2_RD = _per_row(b2_ED, num_tokens_per_expert_E, x_RD.shape[0])
        return out_RD + ScaleBiasForward.apply(b2_RD, tp, x_RD.dtype)


def _per_row(bias_EX, num_tokens_per_expert_E, rows: int) -> torch.Tensor:
    """Each routed row's expert bias; rows past the experts' counts (a dispatcher's padding)
    get 0."""
    counts_E = num_tokens_per_expert_E.long()
    slack = (rows - counts_E.sum()).reshape(1)
    padded_EX = torch.cat([bias_EX, bias_EX.new_zeros(1, bias_EX.shape[-1])])
    return padded_EX.repeat_interleave(torch.cat([counts_E, slack]), dim=0, output_size=rows)


def _tp_degree(weight: torch.Tensor) -> int:
    if isinstance(weight, DTensor) and "tp" in (weight.device_mesh.mesh_dim_names or ()):
        return weight.device_mesh.size(weight.device_mesh.mesh_dim_names.index("tp"))
    return 1


def grouped_mm(x_RD: torch.Tensor, w_EXY: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
    """torch._grouped_mm(x_RD, w_EXY, offs=offsets_E): rows offsets[e-1]:offsets[e] times
    w[e]; rows past the last offset are left unwritten (whatever the allocator held). Compiled,
    in a dtype other than bf16, one opaque op (see the module docstring)."""
    if torch.compiler.is_compiling() and x_RD.dtype != torch.bfloat16:
        return torch.ops.torchtitan_rl.grouped_mm(x_RD, w_EXY, offsets_E)
    return torch._grouped_mm(x_RD, w_EXY, offs=offsets_E)


@torch.library.custom_op("torchtitan_rl::grouped_mm", mutates_args=())
def _grouped_mm_op(
    x_RD: torch.Tensor, w_EXY: torch.Tensor, offsets_E: torch.Tensor
) -> torch.Tensor:
    return torch._grouped_mm(x_RD, w_EXY, offs=offsets_E)


@_grouped_mm_op.register_fake
def _(x_RD, w_EXY, offsets_E):
    return x_RD.new_empty(x_RD.shape[0], w_EXY.shape[-1])


def _grouped_mm_backward(ctx, grad_RY):
    """Eager grouped_mm's own gradients, recomputed (a compiled trainer's experts)."""
    x_RD, w_EXY, offsets_E = ctx.saved_tensors
    with torch.enable_grad():
        x_RD, w_EXY = x_RD.detach().requires_grad_(), w_EXY.detach().requires_grad_()
        out_RY = torch._grouped_mm(x_RD, w_EXY, offs=offsets_E)
        dx_RD, dw_EXY = torch.autograd.grad(out_RY, (x_RD, w_EXY), grad_RY)
    return dx_RD, dw_EXY, None


def _grouped_mm_save(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


_grouped_mm_op.register_autograd(_grouped_mm_backward, setup_context=_grouped_mm_save)


def _looped(x_RD, num_tokens_per_expert_E, weights, limit: float = 0.0, width: int = 0):
    """Each expert's routed rows through its batch-invariant GEMMs (`ops.linear`), in expert
    order: SwiGLU with `weights` = [w1, w2, w3], or with [w1, b1, w2, b2] gpt-oss's swiglu
    clamped at `limit`. With `width`, the down projection is `ops.partial_products` over
    slices of that width, in fp32, without b2 (`_canonical` finishes it). The rows per expert
    are read on the host (`.tolist()`), so in a compiled decoder (vLLM's generator) it is one
    opaque op, `torchtitan_rl::looped_experts`: no host read in the graph, and no Python loop
    frozen at the traced routing. Eager (the trainer) it runs as it is, under autograd."""
    if torch.compiler.is_compiling():
        return torch.ops.torchtitan_rl.looped_experts(
            x_RD, num_tokens_per_expert_E, weights, limit, width
        )
    return _experts_in_order(x_RD, num_tokens_per_expert_E, weights, limit, width)


def _experts_in_order(x_RD, num_tokens_per_expert_E, weights, limit, width=0) -> torch.Tensor:
    # Unbound once: unbind's backward stacks the experts' gradients once; indexing w[e] per
    # expert would allocate a whole [E, ...] gradient per expert (measured 12x slower at
    # debugmodel_moe).
    per_expert = [w.unbind(0) for w in weights]
    outputs, start = [], 0
    for e, count in enumerate(num_tokens_per_expert_E.tolist()):
        rows_RD = x_RD[start : start + int(count)]
        start += int(count)
        if len(weights) == 3:
            w1, w2, w3 = (w[e] for w in per_expert)
            h_RF = F.silu(ops.linear(rows_RD, w1)) * ops.linear(rows_RD, w3)
            b2 = None
        else:
            w1, b1, w2, b2 = (w[e] for w in per_expert)
            h_RF = swiglu(ops.linear(rows_RD, w1, b1), limit=limit)
        if width:
            outputs.append(ops.partial_products(h_RF, w2, width))
        else:
            outputs.append(ops.linear(h_RF, w2, b2))
    # Rows past the experts' counts (another rank's experts', expert parallel) give 0.
    dtype = torch.float32 if width else x_RD.dtype
    outputs.append(x_RD.new_zeros(x_RD.shape[0] - start, x_RD.shape[-1], dtype=dtype))
    return torch.cat(outputs)


def _canonical(experts, x_RD, num_tokens_per_expert_E, weights, limit: float = 0.0):
    """The experts' output under the mode where a TP side may split their hidden units: each
    expert's down projection reduced over `experts.reduction_width` slices in the canonical
    order (`ops.partial_products`, as `batch_invariant.canonical_linear`), the ranks' partial
    sums finished by `experts.tp_combine` (a TP generator's, on the rank's hidden units), then
    gpt-oss's whole output bias once, then one rounding. Every routed row is finished before
    the dispatcher weighs and adds a token's experts, so a token's sum over its experts runs
    as on one device."""
    y_RD = _looped(x_RD, num_tokens_per_expert_E, weights, limit, experts.reduction_width)
    if experts.tp_combine is not None:
        y_RD = experts.tp_combine(y_RD)
    if len(weights) == 4:
        y_RD = y_RD + _per_row(weights[3].float(), num_tokens_per_expert_E, y_RD.shape[0])
    return y_RD.to(x_RD.dtype)


@torch.library.custom_op("torchtitan_rl::looped_experts", mutates_args=())
def _looped_experts(
    x_RD: torch.Tensor,
    num_tokens_per_expert_E: torch.Tensor,
    weights: list[torch.Tensor],
    limit: float,
    width: int,
) -> torch.Tensor:
    """`_experts_in_order` as one op of a compiled graph; forward only (the generator's; the
    trainer's eager forward differentiates `_experts_in_order`)."""
    return _experts_in_order(x_RD, num_tokens_per_expert_E, weights, limit, width)


@_looped_experts.register_fake
def _(x_RD, num_tokens_per_expert_E, weights, limit, width):
    w2_EDF = weights[1] if len(weights) == 3 else weights[2]
    dtype = torch.float32 if width else x_RD.dtype
    return x_RD.new_empty(x_RD.shape[0], w2_EDF.shape[1], dtype=dtype)


class Router(TokenChoiceTopKRouter):
    """Token-choice top-k routing (torchtitan's), gate in fp32, with seams for the generator's
    routing (docs/moe.md):

    - `capture_TK`: a buffer [rows, K] each forward writes its expert ids into, in place, one
      row per token (the generator's capture; generator/routing.py); None by default.
    - `expected`: the generator's expert ids [B, L, K] for this forward's tokens (-1 where it
      has none), or None. With `replay`, those tokens use them instead of this forward's top-k
      (router replay); the gate weights are still this forward's scores, so gradients reach
      the gate. With `counting`, each forward adds to `compared` and `mismatched` the tokens
      with expected ids and those whose top-k set differs from the ids used.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(TokenChoiceTopKRouter.Config):
        pass

    batch_invariant = False
    """Gate logits through `ops.linear` (`make_linears_invariant` sets it)."""

    def __init__(self, config: Config):
        super().__init__(config)
        # The generator's capture buffer [rows, K] (generator/routing.py), None elsewhere.
        self.register_buffer("capture_TK", None, persistent=False)
        self.expected: torch.Tensor | None = None
        self.replay = False
        self.counting = False
        self.compared = self.mismatched = 0

    def forward(self, x_BLD: torch.Tensor, expert_bias_E: torch.Tensor | None = None):
        if self._debug_force_load_balance:
            raise NotImplementedError("forced (round-robin) routing is not supported")
        weight, bias = self.gate.weight.float(), self.gate.bias  # gpt-oss's gate has a bias
        bias = None if bias is None else bias.float()
        if self.batch_invariant:
            logits_BLE = ops.linear(x_BLD.float(), weight, bias)
        else:
            logits_BLE = F.linear(x_BLD.float(), weight, bias)
        if self.score_func == "sigmoid":
            scores_BLE = torch.sigmoid(logits_BLE)
        else:
            scores_BLE = F.softmax(logits_BLE, dim=-1)
        choice_BLE = scores_BLE if expert_bias_E is None else scores_BLE + expert_bias_E
        if self.num_expert_groups is not None:
            # DeepSeek's group-limited routing (torchtitan's): experts outside each token's
            # `num_limited_groups` best groups (by their two best choice scores) are not chosen.
            choice_BLE = self._get_node_limited_routing_scores(choice_BLE)
        expert_ids_BLK = torch.topk(choice_BLE, k=self.top_k, dim=-1, sorted=True)[1]
        if self.expected is not None:
            expert_ids_BLK = self._against_expected(expert_ids_BLK)
        if self.capture_TK is not None:  # in place: the forward may be a compiled graph
            ids_BLK = expert_ids_BLK
            if isinstance(ids_BLK, DTensor):  # a TP generator's: every rank routes every token
                ids_BLK = ids_BLK.full_tensor()
            ids_TK = ids_BLK.reshape(-1, self.top_k)
            self.capture_TK[: ids_TK.shape[0]].copy_(ids_TK)
        topk_scores_BLK = scores_BLE.gather(dim=-1, index=expert_ids_BLK)
        if self.route_norm:
            topk_scores_BLK = topk_scores_BLK / (topk_scores_BLK.sum(-1, keepdim=True) + 1e-20)
        return topk_scores_BLK * self.route_scale, expert_ids_BLK, scores_BLE

    def _against_expected(self, own_BLK: torch.Tensor) -> torch.Tensor:
        """The ids this forward uses (replayed where expected, with `replay`), counted against
        the expected ones (with `counting`)."""
        expected_BLK = self.expected.to(device=own_BLK.device, dtype=torch.int64)
        known_BL = expected_BLK[..., 0] >= 0
        used_BLK = (
            torch.where(known_BL[..., None], expected_BLK, own_BLK) if self.replay else own_BLK
        )
        if self.counting:
            same_BL = (used_BLK.sort(-1)[0] == expected_BLK.sort(-1)[0]).all(-1)
            # Device counts, read once per step (`take_counts`): no host sync in a forward.
            self.compared = self.compared + known_BL.sum()
            self.mismatched = self.mismatched + (known_BL & ~same_BL).sum()
        return used_BLK


def routers(model: torch.nn.Module) -> list[Router]:
    """The model's routers, in layer order."""
    return [m for m in model.modules() if isinstance(m, Router)]


def expect(routers_: list[Router], routed_BLMK: torch.Tensor | None, replay: bool) -> None:
    """Give each router its MoE layer's expected ids [B, L, K] from `routed_BLMK` (M: the MoE
    layers, in order; -1 where unknown), or none (None)."""
    for m, router in enumerate(routers_):
        router.expected = None if routed_BLMK is None else routed_BLMK[..., m, :]
        router.replay = replay


@contextlib.contextmanager
def counting(routers_: list[Router]):
    """Count mismatches against the expected ids in the forwards run inside (not in an
    activation-checkpointing recompute, which runs in the backward, outside)."""
    for router in routers_:
        router.counting = True
    try:
        yield
    finally:
        for router in routers_:
            router.counting = False


def take_counts(routers_: list[Router]) -> tuple[int, int]:
    """(mismatched, compared) (token, layer) pairs counted since the last call, read from the
    device at once; resets them."""
    counted = [
        torch.stack([r.mismatched, r.compared])
        for r in routers_
        if isinstance(r.compared, torch.Tensor)
    ]
    drop_counts(routers_)
    if not counted:
        return 0, 0
    mismatched, compared = torch.stack(counted).sum(0).tolist()
    return int(mismatched), int(compared)


def drop_counts(routers_: list[Router]) -> None:
    """Forget the counts since the last call, reading nothing."""
    for router in routers_:
        router.compared = router.mismatched = 0


def use_project_moe(model_config) -> None:
    """Make every MoE layer of a torchtitan model config build `Experts` (`OssExperts` for
    gpt-oss's) and `Router`, in place (before build); parameter names and shapes stay
    torchtitan's."""
    for layer in model_config.layers:
        moe = getattr(layer, "moe", None)
        if moe is None:
            continue
        inner = moe.routed_experts.inner_experts
        sizes = dict(
            dim=inner.dim,
            hidden_dim=inner.hidden_dim,
            num_experts=inner.num_experts,
            param_init=inner.param_init,
            sharding_config=inner.sharding_config,
        )
        if isinstance(inner, GptOssGroupedExperts.Config):
            moe.routed_experts.inner_experts = OssExperts.Config(
                swiglu_limit=inner.swiglu_limit, **sizes
            )
        else:
            moe.routed_experts.inner_experts = Experts.Config(**sizes)
        router = moe.router
        moe.router = Router.Config(
            num_experts=router.num_experts,
            gate=router.gate,
            num_expert_groups=router.num_expert_groups,
            num_limited_groups=router.num_limited_groups,
            top_k=router.top_k,
            score_func=router.score_func,
            route_norm=router.route_norm,
            route_scale=router.route_scale,
            param_init=router.param_init,
            sharding_config=router.sharding_config,
        )
