"""Export a training checkpoint's policy as an HF safetensors folder for vLLM and transformers.

    .venv/bin/python scripts/export_hf.py outputs/debug_cpu/checkpoints/step-100 --out outputs/hf

The checkpoint's manifest names the model and the HF checkpoint the run started from (its
config.json and tokenizer files are copied); a LoRA run's export is the merged weights. One
process, CPU, no torchrun: DCP reads the shards of any number of ranks into one unsharded
model.
"""

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torchtitan.components.checkpoint import ModelWrapper

from torchtitan_rl.checkpoint import invalid_reason, read_manifest
from torchtitan_rl.config import LoRASection
from torchtitan_rl.hf_export import export_hf
from torchtitan_rl.models import model_spec
from torchtitan_rl.trainer import lora as lora_adapters
from torchtitan_rl.trainer.model import load_hf_weights


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", type=Path, help="a step-N folder of a run's checkpoints")
    parser.add_argument("--out", type=Path, required=True, help="the HF folder to write")
    args = parser.parse_args()

    reason = invalid_reason(args.checkpoint) if args.checkpoint.is_dir() else "no such folder"
    if reason is not None:
        print(f"error: {args.checkpoint} is not a complete checkpoint: {reason}", file=sys.stderr)
        return 2
    facts = read_manifest(args.checkpoint)["facts"]
    spec = model_spec(facts["model"]["name"], facts["model"]["flavor"])
    lora = LoRASection(**facts["lora"]) if facts.get("lora") else None
    if lora is not None:
        spec.model = lora_adapters.convert(spec.model, lora)
    with torch.device("meta"):
        model = spec.model.build()
    model.to_empty(device="cpu")
    state = ModelWrapper(model).state_dict()
    if lora is not None:
        # A LoRA checkpoint holds the adapters; the frozen weights are the run's HF checkpoint.
        load_hf_weights(model, spec, facts["hf_checkpoint"])
        state = {k: v for k, v in state.items() if lora_adapters.is_lora_key(k)}
    dcp.load(state, checkpoint_id=str(args.checkpoint))
    if lora is None:
        export_hf(state, spec, facts["hf_checkpoint"], facts["tokenizer_dir"], args.out)
    else:
        params = dict(model.named_parameters())
        sources = lora_adapters.sync_sources(params, lora_adapters.adapted_modules(model))
        with lora_adapters.merged_in_place(sources):
            state = {
                k: v for k, v in model.state_dict().items() if not lora_adapters.is_lora_key(k)
            }
            export_hf(state, spec, facts["hf_checkpoint"], facts["tokenizer_dir"], args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
