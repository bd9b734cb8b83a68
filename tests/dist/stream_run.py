"""The engine as a request stream with weights updated in flight (generator/stream.py), checked
against the trainer in batch-invariant mode: one engine and two trainers (the starting policy,
kept, and one that takes steps) in a plain process, every check on them.

    python tests/dist/stream_run.py OUT_FILE

Recompute (generator.inflight_kv, the default): requests sample 6 tokens, the trainer steps,
the weights go in while they are in flight, they finish; each token's logprob is compared with
the trainer's at the version that sampled it, over the whole prefix. Keep: the same with the
KV kept. The prefix cache: a 150-token prompt (more than a 128-token block) finished under one
version, its blocks still cached (a request in flight stops the reset), is sampled again after
an update. Also: an evaluation's batched generate while stream requests are in flight, an
abort, and a stream's samples at one version against a batched generate's with the same seeds.
Then the agents' gateway's checks on the same engine (helpers/gateway_checks.py). Saves a dict
of figures to OUT_FILE for tests/integration/test_continuous.py and test_gateway.py.
"""

import asyncio
import sys

import torch
from helpers.gateway_checks import gateway_checks
from helpers.launch import REPO

from torchtitan_rl import batch_invariant, platform
from torchtitan_rl.config import GeneratorSection, ModelSection, ParallelismSection
from torchtitan_rl.config import TrainingSection
from torchtitan_rl.generator.engine import LocalGenerator
from torchtitan_rl.generator.stream import RequestStream
from torchtitan_rl.trainer.policy_trainer import PolicyTrainer
from torchtitan_rl.types import RolloutBatch
from torchtitan_rl.weight_sync import LocalTransport

MODEL = ModelSection(name="qwen3", hf_checkpoint=str(REPO / "assets" / "tiny_qwen3"))
TEMPERATURE = 1.0


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(3, 64, (n,), generator=g).tolist() for n in (9, 150, 17, 30)]


def trainer() -> PolicyTrainer:
    return PolicyTrainer(
        model=MODEL,
        training=TrainingSection(lr=3e-2, max_grad_norm=0.0),
        parallelism=ParallelismSection(),
        temperature=TEMPERATURE,
    )


def step(policy: PolicyTrainer, seed: int) -> None:
    """One optimizer step that moves the weights visibly (random tokens, signed advantages)."""
    g = torch.Generator().manual_seed(seed)
    tokens_BT = torch.randint(3, 64, (4, 24), generator=g)

    def loss_fn(logprobs_BT, batch, scale):
        weighted_BT = batch.advantages_B[:, None] * logprobs_BT * batch.loss_mask_BT
        return -weighted_BT.sum() / scale.tokens, {}

    batch = RolloutBatch(
        tokens_BT=tokens_BT,
        loss_mask_BT=torch.ones(tokens_BT.shape),
        advantages_B=torch.tensor([1.0, -1.0, 0.5, -0.5]),
        generator_logprobs_BT=torch.zeros(tokens_BT.shape),
    )
    policy.optimizer_step(batch, loss_fn)


def run_until_done(stream: RequestStream) -> list:
    done = []
    while len(stream):
        done += stream.step()
    return done


def diffs_by_version(done, prompt_of, policies: dict[int, PolicyTrainer]) -> dict[int, float]:
    """The largest |generator - trainer| logprob of the tokens of each version, each scored by
    that version's policy over the whole sequence."""
    worst: dict[int, float] = {}
    for key, sample in done:
        prompt = prompt_of[key]
        tokens_BT = torch.tensor([prompt + sample.token_ids])
        for version in set(sample.versions):
            logprobs_BT, _ = policies[version].logprobs(tokens_BT)
            mine = torch.tensor([v == version for v in sample.versions])
            trained = logprobs_BT[0, len(prompt) :][mine]
            diff = float((trained - torch.tensor(sample.logprobs)[mine]).abs().max())
            worst[version] = max(worst.get(version, 0.0), diff)
    return worst


def main() -> None:
    out = sys.argv[1]
    platform.patch_torchtitan()
    platform.init_distributed()
    batch_invariant.enable()
    start, policy = trainer(), trainer()
    generator = LocalGenerator(generator=GeneratorSection(max_model_len=256), model=MODEL, seed=0)
    sync = LocalTransport(policy, generator, bucket_mb=64, verify=True)
    sync.send(0)
    stream = RequestStream(generator)
    ids = prompts()
    results = {}

    # The same seeds as a batched generate: the same samples, at one version.
    batched = generator.generate([ids[0]], n=4, temperature=TEMPERATURE, max_tokens=12, seed=40)
    for j in range(4):
        stream.submit(j, ids[0], seed=40 + j, max_tokens=12, temperature=TEMPERATURE)
    streamed = dict(run_until_done(stream))
    results["same_as_batched"] = [
        streamed[j].token_ids == batched.samples[0][j].token_ids
        and streamed[j].logprobs == batched.samples[0][j].logprobs
        for j in range(4)
    ]

    # Recompute: updated after 6 engine steps, in flight.
    prompt_of = {}
    for key in range(8):
        prompt_of[key] = ids[key % 4]
        stream.submit(key, ids[key % 4], seed=100 + key, max_tokens=40, temperature=TEMPERATURE)
    done = []
    for _ in range(6):
        done += stream.step()
    results["recompute_straddling"] = stream.straddling()
    step(policy, seed=1)
    sync.send(1)
    done += run_until_done(stream)
    # Version 1 again, for the keep checks after `policy` moves on: the same step, bit for bit.
    policies = {0: start, 1: trainer()}
    step(policies[1], seed=1)
    results["replayed_step_equal"] = all(
        torch.equal(a.full_tensor(), b.full_tensor())
        for a, b in zip(
            policy.model.state_dict().values(), policies[1].model.state_dict().values(), strict=True
        )
    )
    results["recompute_versions"] = sorted({v for _, s in done for v in s.versions})
    results["recompute_straddled"] = sum(len(set(s.versions)) > 1 for _, s in done)
    results["recompute_diffs"] = diffs_by_version(done, prompt_of, policies)

    # Keep: the same, the KV of the requests in flight kept. The long prompt's first sample
    # finishes under version 1 (its blocks cached), another request stays in flight.
    generator.config.inflight_kv = "keep"
    stream.submit("long-v1", ids[1], seed=7, max_tokens=4, temperature=TEMPERATURE)
    for key in range(8, 16):
        prompt_of[key] = ids[key % 4]
        stream.submit(key, ids[key % 4], seed=100 + key, max_tokens=40, temperature=TEMPERATURE)
    done = []
    for _ in range(6):
        done += stream.step()
    results["keep_long_first_done"] = any(k == "long-v1" for k, _ in done)
    results["keep_in_flight_at_update"] = len(stream)
    step(policy, seed=2)
    sync.send(2)
    policies[2] = policy
    # Sampled again under version 2: the prefix cache must not serve version 1's KV.
    prompt_of["long-v1"] = prompt_of["long-v2"] = ids[1]
    stream.submit("long-v2", ids[1], seed=7, max_tokens=4, temperature=TEMPERATURE)
    done += run_until_done(stream)
    long_v2 = [(k, s) for k, s in done if k == "long-v2"]
    results["prefix_cache_diff"] = diffs_by_version(long_v2, prompt_of, policies)
    kept = [(k, s) for k, s in done if k not in ("long-v1", "long-v2")]
    results["keep_straddled"] = sum(len(set(s.versions)) > 1 for _, s in kept)
    results["keep_diffs"] = diffs_by_version(kept, prompt_of, policies)

    # An evaluation's generate while stream requests are in flight; then an abort.
    prompt_of["during-eval"] = ids[2]
    stream.submit("during-eval", ids[2], seed=9, max_tokens=20, temperature=TEMPERATURE)
    stream.step()
    evaluated = generator.generate([ids[3]], n=2, temperature=TEMPERATURE, max_tokens=8, seed=3)
    results["eval_lengths"] = [len(s.token_ids) for s in evaluated.samples[0]]
    after_eval = run_until_done(stream)
    results["after_eval"] = [k for k, _ in after_eval]
    results["after_eval_diffs"] = diffs_by_version(after_eval, prompt_of, policies)
    stream.submit("aborted", ids[0], seed=11, max_tokens=40, temperature=TEMPERATURE)
    stream.step()
    stream.abort({"aborted"})
    results["after_abort"] = (len(stream), generator.engine.has_unfinished_requests())
    # The agents' gateway on this engine, over HTTP (tests/integration/test_gateway.py).
    results["gateway"] = asyncio.run(gateway_checks(generator, max_model_len=256))
    torch.save(results, out)
    platform.shutdown_distributed()


if __name__ == "__main__":
    main()
    platform.exit_process(0)  # also skips vLLM's slow teardown
