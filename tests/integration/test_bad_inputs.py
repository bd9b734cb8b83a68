"""Bad input: every way a user can get the config, the data or the model wrong ends in exit
code 2 and one line naming the field or file and the fix, never a traceback.

.venv/bin/python -m pytest tests/test_bad_inputs.py

Covered elsewhere, with the real run they need: a checkpoint of the wrong flavor
(test_model.py, test_launcher.py), degrees inconsistent with the torchrun world
(test_launcher.py).
"""

import json
from pathlib import Path

import pytest
from helpers.launch import DEBUG_TOML, run_train

# run_configs name assets/ relative to the repo root, as the README's commands do.
pytestmark = pytest.mark.usefixtures("repo_cwd")


# Each bad input: the TOML text and/or CLI flags, and words the one-line error must contain.
BAD_INPUTS = {
    "unknown section": ("[trainng]\nsteps = 3\n", [], ["'trainng'", "did you mean training"]),
    "unknown key": ("[training]\nstep = 3\n", [], ["'training.step'", "did you mean steps"]),
    "unknown nested key": (
        "[generator.sampling]\ntemprature = 0.7\n",
        [],
        ["'generator.sampling.temprature'", "temperature"],
    ),
    "wrong type in TOML": (
        '[training]\nsteps = "ten"\n',
        [],
        ["training.steps", "expected int", "'ten'"],
    ),
    "bool for int in TOML": ("[training]\nsteps = true\n", [], ["training.steps", "expected int"]),
    "wrong literal in TOML": (
        '[generator]\ndtype = "fp8"\n',
        [],
        ["generator.dtype", "'float32'", "'fp8'"],
    ),
    "value for a section": ("generator = 3\n", [], ["generator is a section"]),
    "wrong type on CLI": ("", ["--training.steps", "ten"], ["--training.steps", "'ten'"]),
    "wrong choice on CLI": ("", ["--generator.dtype", "fp8"], ["--generator.dtype", "fp8"]),
    "unknown CLI flag": ("", ["--training.stepz", "3"], ["--training.stepz"]),
    "negative steps": ("[training]\nsteps = -1\n", [], ["training.steps = -1", ">= 1"]),
    "negative steps on CLI": ("", ["--training.steps=-5"], ["training.steps = -5"]),
    "degrees vs world size": (
        "[parallelism]\ndp_shard = 4\n",
        [],
        ["parallelism.dp_replicate * dp_shard * tp = 4", "world size is 1"],
    ),
    "tp not dividing world": (
        "[parallelism]\ntp = 2\n",
        [],
        ["parallelism.dp_replicate * parallelism.tp = 2", "world size 1"],
    ),
    "generator tp vs world": (
        "[generator.parallelism]\ntensor_parallel_degree = 3\n",
        [],
        ["generator.parallelism.tensor_parallel_degree = 3"],
    ),
    "generator tp unsupported": (
        "[generator.parallelism]\ntensor_parallel_degree = 2\n",
        [],
        ["generator.parallelism.tensor_parallel_degree = 2", "not supported yet"],
    ),
    "group size < 2 for GRPO": (
        "[generator.sampling]\nn = 1\n",
        [],
        ["generator.sampling.n = 1", "'grpo'", "n >= 2"],
    ),
    "missing checkpoint dir": (
        '[model]\nhf_checkpoint = "/no/such/checkpoint"\n',
        [],
        ["model.hf_checkpoint = '/no/such/checkpoint'", "no such directory"],
    ),
    "unknown flavor": ('[model]\nflavor = "huge"\n', [], ["model.flavor = 'huge'", "tiny"]),
    "prompt + completion too long": (
        "[generator]\nmax_model_len = 16\n",
        [],
        ["exceeds generator.max_model_len = 16"],
    ),
    "zero temperature": (
        "[generator.sampling]\ntemperature = 0.0\n",
        [],
        ["generator.sampling.temperature = 0.0", "> 0"],
    ),
    "malformed TOML": ("[training]\nsteps = = 3\n", [], ["malformed TOML", "line 2"]),
    "resume without checkpointing": (
        "[checkpoint]\nresume_from = 3\n",
        [],
        ["checkpoint.resume_from = 3 needs checkpoint.enable = true"],
    ),
    "absolute checkpoint folder": (
        '[checkpoint]\nfolder = "/ckpt"\n',
        [],
        ["checkpoint.folder = '/ckpt'", "relative to job.dump_folder"],
    ),
    "batch invariance with mixed dtypes": (
        'batch_invariant = true\n[model]\ndtype = "bfloat16"\n',
        [],
        ["batch_invariant = true needs the same dtype", "generator.dtype = 'float32'"],
    ),
    "batch invariance with top_p": (
        "[generator.sampling]\ntop_p = 0.9\n",
        ["--batch_invariant", "true"],
        ["generator.sampling.top_p = 0.9", "set top_p = 1.0"],
    ),
    "batch invariance with tensor parallelism": (
        "batch_invariant = true\n[parallelism]\ntp = 2\n",
        ["--world_size_for_test", "2"],
        ["batch_invariant = true with parallelism.tp = 2", "use parallelism.tp = 1"],
    ),
    "tp not dividing the heads": (
        "[parallelism]\ntp = 3\ndp_shard = 1\n",
        ["--world_size_for_test", "3"],
        ["parallelism.tp = 3 does not divide the 4 attention heads", "qwen3/tiny"],
    ),
    "disaggregated placement without a trainer rank": (
        '[generator]\nplacement = "disaggregated"\n',
        [],
        ["generator.num_ranks = 1 in a world of 1", "at least one trainer and one generator"],
    ),
    "off-policy steps while colocated": (
        "[algorithm]\nmax_offpolicy_steps = 2\n",
        [],
        ["algorithm.max_offpolicy_steps = 2 needs generator.placement = 'disaggregated'"],
    ),
    "missing dataset file": (
        '[task]\nname = "dataset"\ndataset_path = "{tmp}/none.jsonl"\n',
        [],
        ["task.dataset_path = '{tmp}/none.jsonl': no such file or folder"],
    ),
    "empty dataset file": (
        '[task]\nname = "dataset"\ndataset_path = "{tmp}/empty.jsonl"\n',
        [],
        ["task.dataset_path = '{tmp}/empty.jsonl' has no rows"],
    ),
    "malformed JSONL line": (
        '[task]\nname = "dataset"\ndataset_path = "{tmp}/broken.jsonl"\n',
        [],
        ["{tmp}/broken.jsonl:2: not a JSON object", "one object per line"],
    ),
    "non-UTF-8 dataset": (
        '[task]\nname = "dataset"\ndataset_path = "{tmp}/latin1.jsonl"\n',
        [],
        ["task.dataset_path: {tmp}/latin1.jsonl is not UTF-8 text"],
    ),
    "empty prompt in the dataset": (
        '[task]\nname = "dataset"\ndataset_path = "{tmp}/blank.jsonl"\n',
        [],
        ["{tmp}/blank.jsonl:1: the prompt is empty"],
    ),
    "reward function that does not import": (
        '[task]\nreward_fn = "no_such_module:score"\n',
        [],
        ["task.reward_fn = 'no_such_module:score': cannot import 'no_such_module'"],
    ),
    "model the generator cannot run": (
        '[model]\nname = "deepseek_v3"\n',
        [],
        ["model.name = 'deepseek_v3' is not supported", "qwen3"],
    ),
    "unknown task": ('[task]\nname = "chess"\n', [], ["task.name", "'chess'", "'echo_digits'"]),
    "off-policy band without a correction": (
        "[algorithm]\noffpolicy_ratio_max = 5.0\n",
        [],
        ["algorithm.offpolicy_ratio_max = 5.0 has no effect", "offpolicy_correction"],
    ),
    "off-policy band without 1": (
        '[algorithm]\noffpolicy_correction = "mis"\noffpolicy_ratio_min = 1.5\n',
        [],
        ["algorithm.offpolicy_ratio_min = 1.5", "must contain 1"],
    ),
    "generation rounds without dynamic sampling": (
        "[algorithm]\nmax_generation_rounds = 3\n",
        [],
        ["algorithm.max_generation_rounds = 3 has no effect", "dynamic_sampling = true"],
    ),
    "KL in reward without a KL": (
        "[algorithm]\nkl_in_reward = true\n",
        [],
        ["algorithm.kl_in_reward = true with kl_beta = 0", "kl_beta > 0"],
    ),
    "dual clip inside the clip range": (
        "[algorithm]\nclip_ratio_c = 1.1\n",
        [],
        ["algorithm.clip_ratio_c = 1.1", "above the upper clip 1 + clip_eps_high = 1.2"],
    ),
    "more mini-batches than samples": (
        "[training]\nprompts_per_step = 2\nmini_batches = 40\n",
        [],
        ["training.mini_batches = 40", "trains on 16 samples per step"],
    ),
    "the removed tis_cap": ("[algorithm]\ntis_cap = 2.0\n", [], ["'algorithm.tis_cap'"]),
    "overlong buffer without the soft penalty": (
        "[algorithm]\noverlong_buffer = 4\n",
        [],
        ["algorithm.overlong_buffer = 4 has no effect", "overlong = 'soft_penalty'"],
    ),
    "empty stop string": (
        '[generator.sampling]\nstop = ["a", ""]\n',
        [],
        ["generator.sampling.stop = ['a', '']", "an empty string would stop at once"],
    ),
    "system prompt with raw text prompts": (
        '[task]\nsystem_prompt = "be brief"\n',
        [],
        ["task.system_prompt = 'be brief' needs a chat template", "task.chat_template = true"],
    ),
    "row without the answer key": (
        '[task]\nname = "dataset"\ndataset_path = "{tmp}/broken.jsonl"\nanswer_key = "solution"\n',
        [],
        ['{tmp}/broken.jsonl:1: needs an "solution" (task.answer_key)'],
    ),
}


def datasets(folder: Path) -> None:
    (folder / "empty.jsonl").write_text("\n")
    (folder / "broken.jsonl").write_text('{"prompt": "1+1?", "answer": "2"}\n{"prompt": 3\n')
    (folder / "latin1.jsonl").write_bytes(
        '{"prompt": "caf\u00e9?", "answer": "1"}\n'.encode("latin-1")
    )
    (folder / "blank.jsonl").write_text('{"prompt": "  ", "answer": "1"}\n')


def test_unwritable_dump_folder_refuses_to_start(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    result = run_train("--job.config_file", DEBUG_TOML, "--job.dump_folder", str(blocker / "run"))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"error: job.dump_folder = '{blocker / 'run'}' is not writable (Not a directory): "
        "point it at a folder this user can write"
    ]


def test_dump_folder_with_a_checkpoint_of_another_model(tmp_path):
    step = tmp_path / "checkpoints" / "step-4"
    step.mkdir(parents=True)
    (step / "__0_0.distcp").write_bytes(b"x" * 10)
    facts = {"model": {"name": "llama3", "flavor": "tiny"}, "seed": 0, "prompts_per_step": 32,
             "world_size": 1, "hf_checkpoint": None, "tokenizer_dir": None}  # fmt: skip
    manifest = {"step": 4, "facts": facts, "files": {"__0_0.distcp": 10}}
    (step / "manifest.json").write_text(json.dumps(manifest))
    result = run_train(
        "--job.config_file", DEBUG_TOML, "--job.dump_folder", str(tmp_path), "--checkpoint.enable"
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (
        f"error: {step} holds a checkpoint of model llama3/tiny, but model.name/model.flavor "
        "are qwen3/tiny: use another job.dump_folder, or the model the checkpoint was saved from"
    )


def test_a_prompt_over_max_prompt_len_is_found_when_the_dataset_is_read(tmp_path):
    """Before any model or engine is built, naming file:line (not mid-run, at the step that
    draws the row)."""
    data = tmp_path / "data.jsonl"
    rows = [{"prompt": "1+1=", "answer": "2"}] * 40 + [{"prompt": "1+" * 30 + "1=", "answer": "31"}]
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    result = run_train(
        *("--job.config_file", DEBUG_TOML, "--job.dump_folder", str(tmp_path / "run")),
        *("--task.name", "dataset", "--task.dataset_path", str(data)),
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (
        f"error: {data}:41: prompt '1+1+1+1+1+1+1+1+1+1+1+1+1+1+1+1+1+1+1+1+' has 81 tokens "
        "after the chat template, more than training.max_prompt_len = 32: raise it or shorten "
        "the prompt"
    )
    assert "generator" not in result.stderr.lower()  # refused before the engine was built
