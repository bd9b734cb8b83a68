"""A generator's requests: vLLM's request for a prompt (sampling params, the policy version's
cache salt), stepping the engine until a batch is done, and its outputs as Samples and Deltas
with their logprobs and MoE routing.

    .venv/bin/python -m pytest tests/integration/test_{generator,continuous}.py

The ranks of a tensor-parallel engine must add the same requests: `_check_same_requests`.
"""

import hashlib
from collections.abc import Callable, Sequence

import torch

from torchtitan_rl import platform
from torchtitan_rl.config import GeneratorSection, SamplingSection
from torchtitan_rl.errors import EngineError
from torchtitan_rl.generator.routing import RoutingLog
from torchtitan_rl.types import Delta, Images, Sample


def vllm_request(
    request_id: str,
    prompt: Sequence[int],
    *,
    sampling: SamplingSection,
    stop_token_ids: list[int],
    policy_version: int,
    n,
    temperature,
    max_tokens,
    seed,
    output_kind,
    top_p: float | None = None,
    stop: Sequence[str] | None = None,
    images: Images | None = None,
) -> tuple:
    """vLLM's (id, prompt, params) of one request, `sampling` filling what the caller leaves
    unset. The prompt carries the policy version as its cache salt: the prefix cache serves it
    no KV that other weights computed, even while requests of an older version are in flight
    (stream.py). `images`: the prompt's (a vision-language generator's: generator/vision.py),
    whose runs the prompt holds, each keyed on its content and the policy version
    (`image_keys`)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.inputs.engine import tokens_input

    stop = list(sampling.stop) + list(stop or [])
    params = SamplingParams(
        n=n,
        temperature=sampling.temperature if temperature is None else temperature,
        top_p=sampling.top_p if top_p is None else top_p,
        max_tokens=max_tokens,
        logprobs=0,  # the sampled token's logprob only
        stop_token_ids=stop_token_ids,
        stop=stop or None,
        # Measured: vLLM's per-token Python work was a fifth of generation at 2 tokens
        # per sample. Completions are decoded by the scorer, so vLLM decodes nothing
        # (no text, no logprob token strings) unless stop strings need the text; logprobs
        # come as flat lists.
        detokenize=bool(stop),
        flat_logprobs=True,
        seed=seed,
        output_kind=output_kind,
    )
    salt = f"policy-{policy_version}"
    if images is None:
        return request_id, tokens_input(list(prompt), cache_salt=salt), params
    data = {"image": {"pixel_values": images.pixel_values_PX, "image_grid_thw": images.grid_thw_N3}}
    request = TokensPrompt(
        prompt_token_ids=list(prompt),
        multi_modal_data=data,
        multi_modal_uuids={"image": image_keys(images, policy_version)},
        cache_salt=salt,
    )
    return request_id, request, params


def image_keys(images: Images, policy_version: int) -> list[str]:
    """Each image's key in vLLM's caches (its inputs, its encoder features, the prefix blocks
    over it): a digest of its rows and grid, and the policy version. vLLM's own key is the
    image alone, so that after a weight update a request would read the features the older
    tower computed; with the version in it, no request reads another version's, and a weight
    update needs no reset of the encoder cache while requests are in flight (continuous
    placement)."""
    keys = []
    rows_I = images.pixel_values_PX.split(images.grid_thw_N3.prod(-1).tolist())
    for rows, grid in zip(rows_I, images.grid_thw_N3, strict=True):
        digest = hashlib.blake2b(str(rows.dtype).encode(), digest_size=16)
        digest.update(grid.numpy().tobytes())
        digest.update(rows.contiguous().view(torch.uint8).numpy().tobytes())
        keys.append(f"{digest.hexdigest()}@policy-{policy_version}")
    return keys


def add_request(engine, request: tuple) -> None:
    """Add vLLM's `request` (id, prompt, params) to `engine`; a prompt with images through
    vLLM's renderer first, which locates and keys them (generator/vision.py)."""
    request_id, prompt, params = request
    if "multi_modal_data" in prompt:
        (prompt,) = engine.renderer.render_cmpl([prompt])
    engine.add_request(request_id, prompt, params)


def check_prompt(prompt: Sequence[int], what: str, generator: GeneratorSection) -> None:
    """Refuse a prompt without tokens, or one that leaves no room to generate."""
    if not prompt:
        raise ValueError(f"{what} has no tokens")
    if len(prompt) >= generator.max_model_len:
        raise ValueError(
            f"{what} has {len(prompt)} tokens, generator.max_model_len = "
            f"{generator.max_model_len} leaves no room to generate: raise max_model_len "
            "or shorten the prompt"
        )


def check_images(prompt: Sequence[int], images: Images, what: str) -> None:
    """Refuse images whose placeholder runs the prompt does not hold where `images` says."""
    for start, length in zip(images.starts, images.lengths, strict=True):
        run = prompt[start : start + length]
        if len(run) != length or len(set(run)) != 1:
            raise ValueError(f"{what}: its image at {start} has no run of {length} placeholders")


def run_until_finished(
    engine, requests: list, first: int, progress: bool, keep: Callable[[object], None]
) -> dict:
    """Add `requests` (id, prompt, params) and step `engine` until all are finished; their
    outputs by index (request id - `first`). A stream's requests in flight go on meanwhile;
    `keep` holds their outputs for its next step."""
    for request in requests:
        add_request(engine, request)
    finished = {}
    bar = _progress_bar(len(requests)) if progress else None
    mine = {request_id for request_id, *_ in requests}
    while len(finished) < len(requests):
        for output in engine.step():
            if output.request_id not in mine:  # a stream's: kept for its next step
                keep(output)
            elif output.finished:
                finished[int(output.request_id) - first] = output
                if bar is not None:
                    bar.update(1)
    if bar is not None:
        bar.close()
    return finished


def _check_same_requests(requests: list) -> None:
    """The ranks of a tensor-parallel engine each add their requests and step together, so they
    must add the same ones: raise EngineError naming the first rank whose differ (its ranks would
    otherwise run different batches, and hang or sample garbage)."""
    from vllm.distributed.parallel_state import get_tp_group

    sha = hashlib.sha256()
    for request_id, prompt, params in requests:
        sha.update(repr((request_id, prompt["prompt_token_ids"], params.seed)).encode())
        sha.update(repr((params.n, params.temperature, params.max_tokens)).encode())
    group = get_tp_group()
    digests = platform.all_gather_objects(sha.hexdigest(), group=group.cpu_group)
    differ = [rank for rank, digest in enumerate(digests) if digest != digests[0]]
    if differ:
        raise EngineError(
            f"the ranks of a tensor-parallel generator were given different requests (rank "
            f"{differ[0]} of its group differs from rank 0): its prompts, seeds and environment "
            "replies must not depend on the rank or on timing"
        )


def _bind_runner(worker) -> None:
    """Give the wrapper's routing log the model runner, whose batch names each row's request."""
    model = worker.model_runner.model
    if getattr(model, "routing", None) is not None:
        model.routing.runner = worker.model_runner


def _each(value, count: int) -> list:
    """`value` for each of `count` requests: a sequence as it is, anything else repeated."""
    if isinstance(value, Sequence):
        if len(value) != count:
            raise ValueError(f"{len(value)} values for {count} requests")
        return list(value)
    return [value] * count


def _sampled_logprobs(completion) -> list[float]:
    """The logprob of each token of a completion (vLLM's FlatLogprobs with logprobs=0: one
    entry per position, the sampled token's)."""
    flat = completion.logprobs
    if [flat.token_ids[s] for s in flat.start_indices] != list(completion.token_ids):
        raise RuntimeError("vLLM's logprobs are not those of the sampled tokens")
    return [flat.logprobs[s] for s in flat.start_indices]


def _delta(output, version: int) -> Delta:
    """A DELTA output of a one-sample request, compact (a remote engine pickles it)."""
    completion = output.outputs[0]
    finish = (completion.finish_reason or "length") if output.finished else None
    return Delta(
        output.request_id,
        list(completion.token_ids),
        _sampled_logprobs(completion),
        version,
        finish,
    )


def _samples(output, routing: RoutingLog | None) -> list[Sample]:
    """The request's samples; with `routing` (an MoE generator), each with the experts its
    tokens went to (vLLM runs sample i of a request as the child request "i_{request id}")."""
    samples = []
    length = len(output.prompt_token_ids)
    for completion in output.outputs:
        logprobs = _sampled_logprobs(completion)
        routed = None
        if routing is not None:
            child = output.request_id if len(output.outputs) == 1 else None
            child = child or f"{completion.index}_{output.request_id}"
            routed = routing.take(child, length + len(completion.token_ids))
        samples.append(
            Sample(
                token_ids=list(completion.token_ids),
                logprobs=logprobs,
                finish_reason=completion.finish_reason or "length",
                routed_experts=routed,
            )
        )
    if routing is not None:
        _share_prompt_routing([s.routed_experts for s in samples], length)
    return samples


def _share_prompt_routing(routed: list[torch.Tensor], prompt_length: int) -> None:
    """The samples of one prompt share its tokens: a prompt position one of them ran (the
    others read its KV from the prefix cache) gets, where a sample did not run it, the
    routing of the first sample that did, in place. Shapes: S samples, P prompt positions, M
    MoE layers, K experts per token. One indexing for all (pair by pair, it was a fifth of a
    tiny MoE engine's host time)."""
    prompts_SPMK = torch.stack([r[:prompt_length] for r in routed])
    ran_SP = prompts_SPMK[:, :, 0, 0] >= 0
    first_P = ran_SP.to(torch.int8).argmax(0)  # the first sample that ran each position
    shared_PMK = prompts_SPMK[first_P, torch.arange(prompt_length)]
    filled_SPMK = torch.where(ran_SP[:, :, None, None], prompts_SPMK, shared_PMK)
    for r, filled_PMK in zip(routed, filled_SPMK, strict=True):
        r[:prompt_length] = filled_PMK


def _progress_bar(total: int):
    from tqdm import tqdm

    return tqdm(total=total, desc="generate", unit="prompt", leave=False)
