"""torchtitan_rl: GRPO-style RL post-training for torchtitan models with an in-process vLLM."""
