#!/usr/bin/env bash
# Set up, then run the CPU demo on 2 processes: the arithmetic demo, SFT warm start then RL
# (run_configs/sft_arith_cpu.toml, ~25 s, then run_configs/arith_rl_from_sft_cpu.toml, ~2
# minutes; extra flags go to the RL stage), or one RL config alone with CONFIG=..., e.g.
#   CONFIG=run_configs/arith_cpu.toml ./scripts/demo.sh     # RL from random weights, ~6 minutes
#   CONFIG=run_configs/debug_cpu.toml ./scripts/demo.sh     # the 25-second echo demo
#   TOOLS=1 ./scripts/demo.sh     # the calculator-tool demo: SFT on traces, then RL with the tool
#   AGENT=1 ./scripts/demo.sh     # the same, the tool run by an OpenAI-client agent via the gateway
#   MIXTURE=1 ./scripts/demo.sh   # both tasks in one run, 1:1 (task.sources), each with its figures
#   MOE=1 ./scripts/demo.sh       # the arithmetic demo on a mixture-of-experts model, EP = 2
#   DISTILL=1 ./scripts/demo.sh   # the arithmetic demo's RL export teaches the SFT export
#   VLM=1 ./scripts/demo.sh       # vision-language: questions about images (docs/vision.md)
#   REAL=1 ./scripts/demo.sh      # a real pretrained model (SmolLM2-135M-Instruct), RL alone, on
#                                 # reasoning-gym's chain_sum (docs/real_models.md)
# The console shows the steps, the evaluations and a summary; library output goes to
# {job.dump_folder}/run.log (add --job.verbose to see it here too).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
# torchrun sets 1 itself when this is unset, with a 5-line warning; the same value, said here.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
torchrun=(.venv/bin/torchrun --standalone --nproc_per_node 2)
if [[ -n "${CONFIG:-}" ]]; then
    exec "${torchrun[@]}" -m torchtitan_rl.train --job.config_file "$CONFIG" "$@"
fi
if [[ -n "${REAL:-}" ]]; then
    exec "${torchrun[@]}" -m torchtitan_rl.train --job.config_file run_configs/real_cpu.toml "$@"
fi
if [[ -n "${MIXTURE:-}" ]]; then
    "${torchrun[@]}" -m torchtitan_rl.sft --job.config_file run_configs/sft_mixture_cpu.toml
    exec "${torchrun[@]}" -m torchtitan_rl.train \
        --job.config_file run_configs/mixture_cpu.toml "$@"
fi
if [[ -n "${MOE:-}" ]]; then
    "${torchrun[@]}" -m torchtitan_rl.sft --job.config_file run_configs/sft_moe_cpu.toml
    exec "${torchrun[@]}" -m torchtitan_rl.train --job.config_file run_configs/moe_cpu.toml "$@"
fi
if [[ -n "${DISTILL:-}" ]]; then
    # The teacher: the arithmetic demo's RL export (SFT, then RL); then on-policy distillation
    # from the SFT export.
    "${torchrun[@]}" -m torchtitan_rl.sft --job.config_file run_configs/sft_arith_cpu.toml
    "${torchrun[@]}" -m torchtitan_rl.train --job.config_file run_configs/arith_rl_from_sft_cpu.toml
    exec "${torchrun[@]}" -m torchtitan_rl.train \
        --job.config_file run_configs/distill_cpu.toml "$@"
fi
if [[ -n "${VLM:-}" ]]; then
    "${torchrun[@]}" -m torchtitan_rl.sft --job.config_file run_configs/sft_visual_cpu.toml
    exec "${torchrun[@]}" -m torchtitan_rl.train \
        --job.config_file run_configs/visual_rl_from_sft_cpu.toml "$@"
fi
if [[ -n "${AGENT:-}" ]]; then
    "${torchrun[@]}" -m torchtitan_rl.sft --job.config_file run_configs/sft_tools_cpu.toml
    exec "${torchrun[@]}" -m torchtitan_rl.train \
        --job.config_file run_configs/tools_agent_rl_cpu.toml "$@"
fi
if [[ -n "${TOOLS:-}" ]]; then
    "${torchrun[@]}" -m torchtitan_rl.sft --job.config_file run_configs/sft_tools_cpu.toml
    exec "${torchrun[@]}" -m torchtitan_rl.train \
        --job.config_file run_configs/tools_rl_cpu.toml "$@"
fi
"${torchrun[@]}" -m torchtitan_rl.sft --job.config_file run_configs/sft_arith_cpu.toml
exec "${torchrun[@]}" -m torchtitan_rl.train \
    --job.config_file run_configs/arith_rl_from_sft_cpu.toml "$@"
