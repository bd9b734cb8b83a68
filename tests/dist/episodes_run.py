"""Multi-turn episodes on the real vLLM engine (tiny Qwen3, random weights), every generate call
recorded; writes what tests/test_envs.py checks as JSON.

    .venv/bin/python tests/dist/episodes_run.py /tmp/episodes.json

A random model rarely samples <|im_end|>, so its turns end on stop strings (any digit), as a
user's may end on "</tool_call>"; the environment (tests/helpers/user_envs.py:Chatter) answers
each turn with a tool message until the third.
"""

import json
import sys
from pathlib import Path

import torch

from helpers.launch import REPO
from helpers.user_envs import Chatter

from torchtitan_rl import platform
from torchtitan_rl.types import rollout_batch
from torchtitan_rl.config import GeneratorSection, ModelSection, TaskSection
from torchtitan_rl.episodes import Episodes, Source
from torchtitan_rl.generator.engine import LocalGenerator
from torchtitan_rl.types import Prompt
from torchtitan_rl.tasks.render import build_renderer
from torchtitan_rl.models import checkpoint_stop_ids
from torchtitan_rl.tasks.rewards import Scorer

TINY = str(REPO / "assets" / "tiny_qwen3")


class Recording:
    """The generator, with every call's prompts and samples kept."""

    def __init__(self, generator: LocalGenerator):
        self.generator, self.calls = generator, []

    def generate(self, prompts, **kwargs):
        completions = self.generator.generate(prompts, **kwargs)
        samples = [
            [s.token_ids, s.logprobs, s.finish_reason] for g in completions.samples for s in g
        ]
        self.calls.append({"prompts": [list(p) for p in prompts], "samples": samples})
        return completions


def episodes_json(scored) -> list[dict]:
    return [
        {
            "first_ids": scored.completions.prompts[p],
            "token_ids": s.token_ids,
            "sampled_mask": s.sampled_mask,
            "logprobs": s.logprobs,
            "messages": s.messages,
            "finish_reason": s.finish_reason,
            "turns": s.turns,
            "reward": float(scored.rewards_PN[p, j]),
        }
        for p, group in enumerate(scored.completions.samples)
        for j, s in enumerate(group)
    ]


def main() -> None:
    out = Path(sys.argv[1])
    platform.init_distributed()
    generator_section = GeneratorSection(max_model_len=128, kv_cache_space_gib=1)
    generator_section.sampling.stop = list("0123456789")
    generator = LocalGenerator(
        generator=generator_section, model=ModelSection(hf_checkpoint=TINY), seed=0
    )
    task = TaskSection(name="env", env="user_envs:Chatter", dataset_path=str(REPO / "data"))
    renderer = build_renderer(task, TINY, max_prompt_len=32)
    prompts = [Prompt("max(3,7)=", "7"), Prompt("min(1,2)=", "1"), Prompt("max(5,0)=", "5")]
    result = {}
    for name, max_model_len in (("episodes", 128), ("short", 72)):
        recording = Recording(generator)
        episodes = Episodes(
            {"": Source(renderer, lambda: Chatter(turns=3), max_turns=4)},
            Scorer(None, {}, "zero"),
            stop_ids=checkpoint_stop_ids(TINY),
            max_model_len=max_model_len,
            timeout_s=5.0,
        )
        scored = episodes.run(recording, prompts, seed=11, n=3, max_tokens=8)
        batch = rollout_batch(
            scored.completions.prompts, scored.completions.samples, torch.zeros(3, 3), 0
        )
        result[name] = {
            "calls": recording.calls,
            "episodes": episodes_json(scored),
            "tokens_BT": batch.tokens_BT.tolist(),
            "loss_mask_BT": batch.loss_mask_BT.tolist(),
        }
    out.write_text(json.dumps(result))
    platform.shutdown_distributed()


if __name__ == "__main__":
    main()
    platform.exit_process(0)  # also skips vLLM's slow teardown
