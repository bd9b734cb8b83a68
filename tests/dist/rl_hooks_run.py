"""Two RL steps with a recording Hooks and a KL penalty; rank 0 saves the calls, and
(colocated) how many forwards the policy and the reference ran in each step.

    python tests/dist/rl_hooks_run.py OUT_DIR [FLAGS...]

A world of one (colocated), or under torchrun with e.g. --generator.placement disaggregated.
"""

import json
import sys
from pathlib import Path

from torchtitan_rl import platform
from torchtitan_rl.config import parse_args
from torchtitan_rl.loop import Hooks
from torchtitan_rl.placements import disaggregated
from torchtitan_rl.placements.colocated import RLTrainer

REPO = Path(__file__).resolve().parents[2]


class Recorder(Hooks):
    def __init__(self):
        self.calls = []
        self.forwards, self.counts = [], {"policy": 0, "reference": 0}
        self.generator, self.generator_numel = None, []

    def before_step(self, step):
        self.calls.append(["before_step", step])

    def after_train(self, step, metrics):
        self.calls.append(["after_train", step, sorted(metrics)])
        if self.generator is not None:  # what the generator's weights hold while training
            self.generator_numel.append(
                sum(p.numel() for p in self.generator.weights().values())
            )

    def after_sync(self, step, stats):
        self.calls.append(["after_sync", step, stats.version])

    def after_step(self, step, metrics):
        self.calls.append(["after_step", step, metrics["policy_version"], metrics["kl"]])
        self.forwards.append(dict(self.counts))
        self.counts.update(policy=0, reference=0)

    def count_forwards(self, rl: RLTrainer) -> None:
        self.generator = rl.generator
        for name, side in (("policy", rl.learner.trainer), ("reference", rl.learner.reference)):
            side.model.register_forward_hook(
                lambda *_, name=name: self.counts.update({name: self.counts[name] + 1})
            )


def main() -> None:
    out = Path(sys.argv[1])
    platform.patch_torchtitan()
    rank, world_size = platform.init_distributed()
    config = parse_args(
        [
            "--job.config_file",
            str(REPO / "run_configs" / "debug_cpu.toml"),
            "--model.hf_checkpoint",
            str(REPO / "assets" / "tiny_qwen3"),
            "--training.steps",
            "2",
            "--training.prompts_per_step",
            "32",
            "--training.lr",
            "1e-2",
            "--algorithm.kl_beta",
            "0.1",
            "--job.dump_folder",
            str(out),
            *sys.argv[2:],
        ],
        world_size,
    )
    recorder = Recorder()
    if config.generator.placement == "disaggregated":
        disaggregated.run(config, hooks=recorder)
    else:
        rl = RLTrainer(config, hooks=recorder)
        recorder.count_forwards(rl)
        rl.train()
        if rank == 0:
            (out / "forwards.json").write_text(json.dumps(recorder.forwards))
            (out / "generator_numel.json").write_text(json.dumps(recorder.generator_numel))
    if rank == 0:
        (out / "hooks.json").write_text(json.dumps(recorder.calls))
    platform.shutdown_distributed()


if __name__ == "__main__":
    main()
    platform.exit_process(0)
