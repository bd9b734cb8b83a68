"""The generator under pressure: a KV cache too small for the batch, and a step whose prompts
exceed vLLM's per-step token budget.

    python tests/dist/generator_faults_run.py OUT.json --job.config_file ... --generator.num_kv_blocks 4

Builds the RLTrainer of the flags (no training). (1) Counts the scheduler's preemptions while 8
prompts of ~100 tokens x 4 samples x 50 tokens run in 4 blocks of 128 tokens, and measures the
max |generator - trainer| logprob. (2) Samples 12 seeded prompts of ~200 tokens (2400 prompt
tokens, more than vLLM's default 2048-token step budget) together, then the first one alone
with the same seed. Writes the figures to OUT.json.
"""

import json
import sys

from batch_invariant_run import max_diff
from vllm.v1.core.sched.scheduler import Scheduler

from torchtitan_rl import platform
from torchtitan_rl.config import parse_args
from torchtitan_rl.placements.colocated import RLTrainer

preemptions = 0
_preempt = Scheduler._preempt_request


def counting_preempt(self, *args, **kwargs):
    global preemptions
    preemptions += 1
    return _preempt(self, *args, **kwargs)


def main() -> None:
    out, flags = sys.argv[1], sys.argv[2:]
    Scheduler._preempt_request = counting_preempt
    platform.patch_torchtitan()
    _, world_size = platform.init_distributed()
    run = RLTrainer(parse_args(flags, world_size))
    prompts = [f"echo {str(7 ** (200 + i))[:95]}:" for i in range(8)]
    diff, _ = max_diff(run, prompts, seed=3, n=4, max_tokens=50)
    long_prompts = [
        run.producer.renderer.tokenizer.encode(
            f"echo {str(3 ** (400 + i))[:195]}:", add_special_tokens=False
        )
        for i in range(12)
    ]
    together = run.generator.generate(long_prompts, n=1, max_tokens=4, seed=5)
    alone = run.generator.generate(long_prompts[:1], n=1, max_tokens=4, seed=5)
    result = {
        "preemptions": preemptions,
        "max_diff": diff,
        "budget_prompt_tokens": sum(map(len, long_prompts)),
        "seeded_alone_equals_together": alone.samples[0][0].token_ids
        == together.samples[0][0].token_ids,
    }
    with open(out, "w") as f:
        json.dump(result, f)
    platform.shutdown_distributed()


if __name__ == "__main__":
    main()
    platform.exit_process(0)
