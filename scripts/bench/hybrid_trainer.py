"""Benchmark a training step of Qwen3.5's text model, ours against a plain PyTorch reference of
the same layers: HF transformers' `Qwen3_5ForCausalLM` with its PyTorch fallbacks for the Gated
DeltaNet recurrence and convolution (torchtitan's own model needs `fla`'s GPU kernels).

    .venv/bin/python scripts/bench/hybrid_trainer.py --checkpoint assets/debug_qwen3_5

Both sides load the same checkpoint (written on first use by scripts/make_tiny_checkpoint.py:
torchtitan's `debugmodel` of qwen3_5, 8 layers, 6 of them Gated DeltaNet) and take the same
steps on the same tokens, in one process, alternating: forward, cross-entropy over every
token, backward, AdamW. Ours is the torchtitan model with this project's layers
(models/qwen3_5.py: the chunked recurrence of models/gated_delta.py, per row); HF's runs its
`torch_chunk_gated_delta_rule` and `causal_conv1d_fn` fallbacks, eager attention. fp32.
Prints one JSON line: median tokens/s of each, `ratio` = ours / HF, and the largest difference
of the first step's losses (the same model: a wrong layer would show).
"""

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F
from children import ensure_checkpoint


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", default="assets/debug_qwen3_5")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    ensure_checkpoint(args.checkpoint)

    from transformers import AutoModelForCausalLM

    from torchtitan_rl import platform
    from torchtitan_rl.config import ModelSection
    from torchtitan_rl.trainer.model import build_spec, load_hf_weights

    recipe = json.loads(open(f"{args.checkpoint}/torchtitan.json").read())
    spec = build_spec(ModelSection(name="qwen3_5", flavor=recipe["flavor"]))
    ours = spec.model.build()
    load_hf_weights(ours, spec, args.checkpoint)
    theirs = AutoModelForCausalLM.from_pretrained(args.checkpoint, attn_implementation="eager")
    vocab = spec.model.vocab_size
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (args.batch, args.seq + 1), generator=g)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    positions = torch.arange(args.seq).expand(args.batch, -1)

    sides = {
        "ours": (
            lambda: ours(inputs, positions=positions),
            torch.optim.AdamW(ours.parameters(), lr=1e-5),
        ),
        "hf": (
            lambda: theirs(input_ids=inputs).logits,
            torch.optim.AdamW(theirs.parameters(), lr=1e-5),
        ),
    }
    rates = {name: [] for name in sides}
    first_loss = {}
    for step in range(args.steps + 1):  # step 0 warms up
        for name, (forward, optimizer) in sides.items():
            start = time.perf_counter()
            logits = forward()
            loss = F.cross_entropy(logits.reshape(-1, vocab).float(), targets.reshape(-1))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            seconds = time.perf_counter() - start
            if step == 0:
                first_loss[name] = float(loss.detach())
            else:
                rates[name].append(args.batch * args.seq / seconds)
    medians = {name: statistics.median(values) for name, values in rates.items()}
    print(
        json.dumps(
            {
                "bench": "hybrid_trainer",
                "checkpoint": args.checkpoint,
                "batch": args.batch,
                "seq": args.seq,
                "threads": torch.get_num_threads(),
                "device": platform.device_type(),
                "ours_tokens_per_s": round(medians["ours"], 1),
                "hf_tokens_per_s": round(medians["hf"], 1),
                "ratio": round(medians["ours"] / medians["hf"], 3),
                "first_loss_diff": abs(first_loss["ours"] - first_loss["hf"]),
            }
        )
    )


if __name__ == "__main__":
    main()
