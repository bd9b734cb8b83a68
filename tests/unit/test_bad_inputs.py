"""Bad input, in process: every way a user can get the config, the data or the model wrong
ends in exit code 2 (`train.main`) and one line naming the field or file and the fix, never a
traceback.

    .venv/bin/python -m pytest tests/unit/test_bad_inputs.py

Damaged input files (cut short, emptied, not what their name says), each through the function
that opens it: test_a_damaged_input_file_is_one_line_naming_it.

As processes (an unwritable dump folder, a checkpoint of another model, a prompt too long):
tests/integration/test_bad_inputs.py; a checkpoint of the wrong flavor: test_model.py and
tests/integration/test_launcher.py; degrees inconsistent with the torchrun world:
tests/integration/test_launcher.py.
"""

import json
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers.launch import DEBUG_TOML, TINY, write_toml
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

from torchtitan_rl import platform
from torchtitan_rl.checkpoint import MANIFEST, Checkpointer
from torchtitan_rl.config import (
    CheckpointSection,
    ConfigError,
    GeneratorParallelismSection,
    GeneratorSection,
    ModelSection,
    TaskSection,
    parse_args,
)
from torchtitan_rl.episodes import open_task
from torchtitan_rl.generator.engine import LocalGenerator
from torchtitan_rl.generator.engine_build import check_tokenizer_fits
from torchtitan_rl.launch import check_dump_folder
from torchtitan_rl.models import checkpoint_stop_ids
from torchtitan_rl.tasks.dataset import DatasetKeys, read_rows
from torchtitan_rl.tasks.render import build_renderer, load_tokenizer
from torchtitan_rl.train import main
from torchtitan_rl.trainer.model import read_hf_shapes
from torchtitan_rl.types import Prompt

# run_configs name assets/ relative to the repo root, as the README's commands do.
pytestmark = pytest.mark.usefixtures("repo_cwd")


# Two sources of the shipped arithmetic rows.
MIXTURE = (
    '[task.sources.a]\nname = "dataset"\ndataset_path = "data/arith/train.jsonl"\n'
    '[task.sources.b]\nname = "dataset"\ndataset_path = "data/arith/train.jsonl"\n'
)

# Each bad input: the TOML text and/or CLI flags, and words the one-line error must contain.
BAD_INPUTS = {
    "unknown section": ("[trainng]\nsteps = 3\n", [], ["'trainng'", "did you mean training"]),
    "unknown key": ("[training]\nstep = 3\n", [], ["'training.step'", "did you mean steps"]),
    "collective timeout before the watchdog": (
        "[job]\nphase_timeout_s = 600\ncollective_timeout_s = 300\n",
        [],
        ["job.collective_timeout_s = 300", "job.phase_timeout_s = 600", "at least 660"],
    ),
    "negative phase timeout": (
        "",
        ["--job.phase_timeout_s", "-1"],
        ["job.phase_timeout_s = -1", "0: no watchdog"],
    ),
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
    "expert parallel on a dense model": (
        "[parallelism]\nep = 2\n",
        ["--world_size_for_test", "2"],
        ["parallelism.ep = 2", "has no experts (a dense model)", "parallelism.ep = 1"],
    ),
    "expert parallel not dividing the experts": (
        '[model]\nflavor = "tiny_moe"\n[parallelism]\nep = 3\n',
        ["--world_size_for_test", "3"],
        ["parallelism.ep = 3 does not divide the 8 experts of qwen3/tiny_moe"],
    ),
    "expert parallel not dividing the ranks": (
        '[model]\nflavor = "tiny_moe"\n[parallelism]\nep = 4\n',
        ["--world_size_for_test", "2"],
        ["parallelism.ep = 4 does not divide the 2 ranks"],
    ),
    "router replay on a dense model": (
        "[algorithm]\nrouter_replay = true\n",
        [],
        ["algorithm.router_replay = true", "qwen3/auto:", "has no experts"],
    ),
    "lora on experts": (
        '[model]\nflavor = "tiny_moe"\n[lora]\nenable = true\ntarget = "mlp"\n',
        [],
        ["lora.target = 'mlp' adapts no layer of qwen3/tiny_moe", "lora.target = 'attention'"],
    ),
    "generator tp vs world": (
        "[generator.parallelism]\ntensor_parallel_degree = 3\n",
        [],
        ["generator.parallelism.tensor_parallel_degree = 3"],
    ),
    "generator tp not dividing the heads": (
        "[generator.parallelism]\ntensor_parallel_degree = 4\n",
        ["--world_size_for_test", "4"],
        ["generator.parallelism.tensor_parallel_degree = 4 does not divide", "2 KV heads"],
    ),
    "generator tp not dividing the generator ranks": (
        '[generator]\nplacement = "disaggregated"\nnum_ranks = 3\n'
        "[generator.parallelism]\ntensor_parallel_degree = 2\n",
        ["--world_size_for_test", "4"],
        ["tensor_parallel_degree = 2 does not divide the 3 generating ranks"],
    ),
    "trainer tp under batch invariance on Gated DeltaNet layers": (
        'batch_invariant = true\n[model]\nname = "qwen3_5"\nflavor = "tiny"\n'
        'hf_checkpoint = "assets/tiny_qwen3_5"\n[parallelism]\ntp = 2\n',
        ["--world_size_for_test", "2"],
        [
            "batch_invariant = true with parallelism.tp = 2",
            "qwen3_5/tiny has Gated DeltaNet layers, which torchtitan's plan shards by sequence",
            "use parallelism.tp = 1 (FSDP)",
        ],
    ),
    # A TP generator's vision tower is exact under the mode (test_batch_invariant.py's TP
    # layouts); a TP trainer's is not proven yet.
    "trainer tp under batch invariance with a vision tower": (
        'batch_invariant = true\n[model]\nname = "muse_glimmer"\nflavor = "tiny_vl"\n'
        'hf_checkpoint = "assets/tiny_vl_muse_glimmer"\n[parallelism]\ntp = 2\n',
        ["--world_size_for_test", "2"],
        [
            "batch_invariant = true with parallelism.tp = 2",
            "muse_glimmer/tiny_vl has a vision tower, not yet bitwise across TP layouts",
            "use parallelism.tp = 1 (FSDP)",
        ],
    ),
    "generator tp ranks without prompts to share": (
        "[training]\nprompts_per_step = 2\nmini_batches = 1\n"
        "[generator.parallelism]\ntensor_parallel_degree = 2\n",
        ["--world_size_for_test", "4"],
        ["training.prompts_per_step = 2", "2 tensor-parallel ranks", "multiple of 4"],
    ),
    "generator expert parallel on a dense model": (
        "[generator.parallelism]\ntensor_parallel_degree = 2\nexpert_parallel = true\n",
        ["--world_size_for_test", "2"],
        ["generator.parallelism.expert_parallel = true", "qwen3/auto:", "has no experts"],
    ),
    "generator expert parallel without tp": (
        '[model]\nflavor = "tiny_moe"\n[generator.parallelism]\nexpert_parallel = true\n',
        [],
        ["generator.parallelism.expert_parallel = true", "tensor_parallel_degree = 1"],
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
    # A dense decoder's TP trainer is exact under the mode (test_batch_invariant.py's
    # tp_world); an MoE model's is not yet.
    "trainer tp under batch invariance on an MoE model": (
        'batch_invariant = true\n[model]\nflavor = "tiny_moe"\n[parallelism]\ntp = 2\n',
        ["--world_size_for_test", "2"],
        [
            "batch_invariant = true with parallelism.tp = 2",
            "qwen3/tiny_moe has mixture-of-experts layers",
            "use parallelism.tp = 1 (FSDP)",
        ],
    ),
    "trainer tp under batch invariance with LoRA": (
        "batch_invariant = true\n[parallelism]\ntp = 2\n[lora]\nenable = true\n",
        ["--world_size_for_test", "2"],
        ["parallelism.tp = 2 and lora.enable = true", "use parallelism.tp = 1 (FSDP) with LoRA"],
    ),
    "tp not dividing the heads": (
        "[parallelism]\ntp = 3\ndp_shard = 1\n",
        ["--world_size_for_test", "3"],
        ["parallelism.tp = 3 does not divide the 4 attention heads", "of qwen3/auto:"],
    ),
    "disaggregated placement without a trainer rank": (
        '[generator]\nplacement = "disaggregated"\n',
        [],
        ["generator.num_ranks = 1 in a world of 1", "at least one trainer and one generator"],
    ),
    "continuous placement with dynamic sampling": (
        '[generator]\nplacement = "continuous"\n[algorithm]\ndynamic_sampling = true\n',
        ["--world_size_for_test", "2"],
        [
            "algorithm.dynamic_sampling = true is not supported in generator.placement = "
            "'continuous'",
            "use placement 'disaggregated'",
        ],
    ),
    "continuous placement holding less than a step": (
        '[generator]\nplacement = "continuous"\nmax_inflight_groups = 4\n',
        ["--world_size_for_test", "2"],
        ["generator.max_inflight_groups = 4 is below a generator's share of a step (16 groups)"],
    ),
    "in-flight knobs outside the continuous placement": (
        '[generator]\ninflight_kv = "keep"\n',
        [],
        ["generator.max_inflight_groups, generator.inflight_kv, generator.batch_order and "],
    ),
    "a single weight buffer outside the continuous placement": (
        '[generator]\nplacement = "disaggregated"\ndouble_buffer_weights = false\n',
        ["--world_size_for_test", "2"],
        ["generator.double_buffer_weights act only in continuous placement"],
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
    "Parquet file cut short": (
        '[task]\nname = "dataset"\ndataset_path = "{tmp}/cut.parquet"\n',
        [],
        ["task.dataset_path: cannot read {tmp}/cut.parquet", "write or download it again"],
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
    "tensor parallel over more ranks than Gated DeltaNet heads": (
        '[model]\nname = "qwen3_5"\nflavor = "tiny"\n[parallelism]\ntp = 4\n',
        [],
        ["parallelism.tp = 4 does not divide the 2 key heads and 4 value heads", "divides both"],
    ),
    "a flavor with a vision tower": (
        '[model]\nname = "kimi_k2_7"\nflavor = "Kimi-K2.5"\n',
        [],
        ["model.flavor = 'Kimi-K2.5' builds a vision tower", "moonlight-16B-A3B"],
    ),
    "a trained vision tower on a text-only flavor": (
        "[model]\nfreeze_vision = false\n",
        [],
        ["model.freeze_vision = false, but qwen3 'auto:", "has no vision tower", "tiny_vl"],
    ),
    "a trained vision tower under LoRA": (
        '[model]\nname = "muse_glimmer"\nflavor = "tiny_vl"\n'
        'hf_checkpoint = "assets/tiny_vl_muse_glimmer"\nfreeze_vision = false\n'
        "[lora]\nenable = true\n",
        [],
        ["model.freeze_vision = false, but lora.enable = true freezes", "remove one"],
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
    # A mixture (task.sources): each error names the source and its field.
    "unknown source field": (
        MIXTURE + "[task.sources.c]\nwieght = 2\n",
        [],
        ["'task.sources.c.wieght'", "did you mean weight", "eval_dataset_path"],
    ),
    "source weight 0": (
        MIXTURE,
        ["--task.sources.b.weight", "0"],
        ["task.sources.b.weight = 0.0: must be > 0"],
    ),
    "source with no rows": (
        '[task.sources.a]\nname = "dataset"\ndataset_path = "{tmp}/empty.jsonl"\n',
        [],
        ["task.sources.a.dataset_path = '{tmp}/empty.jsonl' has no rows"],
    ),
    "two sources with one name": (
        MIXTURE + "[task.sources.a]\nweight = 2\n",
        [],
        ["malformed TOML", "('task', 'sources', 'a') twice"],
    ),
    "source reward that does not import": (
        MIXTURE + '[task.sources.b.rewards]\n"nope:f" = 1.0\n',
        [],
        ["task.sources.b.rewards['nope:f'] = 'nope:f': cannot import 'nope'"],
    ),
    "source row without its answer key": (
        MIXTURE.replace('dataset_path = "data', 'answer_key = "sol"\ndataset_path = "data', 1),
        [],
        ['needs an "sol" (task.sources.a.answer_key)'],
    ),
    "task field beside sources": (
        MIXTURE,
        ["--task.system_prompt", "be brief"],
        ["task.system_prompt = 'be brief' is set beside task.sources", "[task.sources.NAME]"],
    ),
    "eval set beside sources": (
        MIXTURE,
        ["--eval.dataset_path", "data/arith/test.parquet"],
        ["eval.dataset_path is set beside task.sources", "task.sources.NAME.eval_dataset_path"],
    ),
    "source name unfit for a metric": (
        MIXTURE.replace("[task.sources.b]", '[task.sources."b/c"]'),
        [],
        ["task.sources.b/c:", "letters, digits"],
    ),
}


ROWS = [{"prompt": f"{a}+{a + 1}=", "answer": str(2 * a + 1)} for a in range(6)]


def datasets(folder: Path) -> None:
    (folder / "empty.jsonl").write_text("\n")
    (folder / "broken.jsonl").write_text('{"prompt": "1+1?", "answer": "2"}\n{"prompt": 3\n')
    (folder / "latin1.jsonl").write_bytes(
        '{"prompt": "caf\u00e9?", "answer": "1"}\n'.encode("latin-1")
    )
    (folder / "blank.jsonl").write_text('{"prompt": "  ", "answer": "1"}\n')
    pq.write_table(pa.Table.from_pylist(ROWS), folder / "cut.parquet")
    (folder / "cut.parquet").write_bytes((folder / "cut.parquet").read_bytes()[:-20])


@pytest.mark.parametrize("name", sorted(BAD_INPUTS))
def test_bad_input_is_one_line_exit_2(name, tmp_path, capsys, monkeypatch):
    text, flags, words = BAD_INPUTS[name]
    datasets(tmp_path)
    text, words = (
        text.replace("{tmp}", str(tmp_path)),
        [w.replace("{tmp}", str(tmp_path)) for w in words],
    )
    path = write_toml(tmp_path, text)
    world_size = 1
    if flags[:1] == ["--world_size_for_test"]:
        world_size, flags = int(flags[1]), flags[2:]
        monkeypatch.setenv("WORLD_SIZE", str(world_size))
    if name != "missing checkpoint dir":
        flags = ["--model.hf_checkpoint", TINY, *flags]
    with pytest.raises(ConfigError):  # while parsing, or when the task is opened
        open_task(parse_args(["--job.config_file", path, *flags], world_size))
    assert main(["--job.config_file", path, *flags]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: "), err
    for word in words:
        assert word in err, f"{word!r} not in {err!r}"
    if name == "malformed TOML":
        assert path in err


def test_missing_config_file(capsys):
    assert main(["--job.config_file", "/no/such.toml"]) == 2
    assert capsys.readouterr().err == "error: job.config_file = '/no/such.toml': no such file\n"


def test_a_full_disk_refuses_to_start(tmp_path, monkeypatch):
    config = parse_args(
        ["--job.config_file", DEBUG_TOML, "--job.dump_folder", str(tmp_path), "--checkpoint.enable"]
    )
    free = shutil.disk_usage(tmp_path)._replace(free=10 * 2**20)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: free)
    with pytest.raises(ConfigError, match=r"has 10 MiB free, the run needs about \d+ MiB"):
        check_dump_folder(config)


def test_prompt_with_no_tokens_is_named():
    from transformers import PreTrainedTokenizerFast

    from torchtitan_rl.tasks.render import Renderer
    from torchtitan_rl.types import Prompt

    # A tokenizer that drops 'x': the prompt "xxx" encodes to nothing.
    tokenizer = Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.Replace("x", "")
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    renderer = Renderer(
        PreTrainedTokenizerFast(tokenizer_object=tokenizer),
        "dir",
        chat_template=False,
        max_prompt_len=32,
    )
    with pytest.raises(ConfigError, match=r"prompt 'xxx' encodes to no tokens with .*tokenizer"):
        renderer.encode([Prompt(text="a", answer=""), Prompt(text="xxx", answer="")])


def test_tokenizer_larger_than_the_vocabulary_is_refused(tmp_path):
    shutil.copytree(TINY, tmp_path / "ckpt")
    config = json.loads((Path(TINY) / "config.json").read_text())
    config["vocab_size"] = 32
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="tokenizer has 68 tokens but the checkpoint's vocab"):
        check_tokenizer_fits(ModelSection(hf_checkpoint=str(tmp_path / "ckpt")))
    check_tokenizer_fits(ModelSection(hf_checkpoint=str(TINY)))  # the shipped pair fits


def test_cpu_sleep_mode_with_a_tensor_parallel_generator_is_refused_before_the_engine():
    """CPU sleep mode frees weight tensors by name, which sharded parameters do not support:
    refused before vLLM starts (no torchrun world is needed to see it)."""
    generator = GeneratorSection(
        enable_sleep_mode=True,
        parallelism=GeneratorParallelismSection(tensor_parallel_degree=2),
    )
    with pytest.raises(ConfigError, match="enable_sleep_mode = true frees the weight tensors"):
        LocalGenerator(generator=generator, model=ModelSection(hf_checkpoint=TINY))


# ---- Damaged input files, each opened by the function of the run that reads it ----

FACTS = {"model": {"name": "qwen3", "flavor": "tiny"}, "lora": None, "seed": 0}
STEP = "dump/checkpoints/step-1"


def template_cut_short(data: bytes) -> bytes:
    config = json.loads(data)
    return json.dumps({**config, "chat_template": config["chat_template"][:200]}).encode()


DAMAGES = {
    "cut in half": lambda data: data[: len(data) // 2],
    "cut mid-row": lambda data: data[: len(data) // 2 + 7],
    "cut to 5 bytes": lambda data: data[:5],
    "emptied": lambda data: b"",
    "an HTML page": lambda data: b"<html><body>404 Not Found</body></html>\n",
    "{}": lambda data: b"{}",
    "[]": lambda data: b"[]",
    "template cut": template_cut_short,
    "bad tokens": lambda data: b'{"added_tokens_decoder": 3}',  # JSON, not a tokenizer's
    "deleted": None,
    # A sharded checkpoint whose second shard did not download.
    "a shard less": lambda data: b'{"weight_map": {"x": "model-00002-of-00002.safetensors"}}',
}


def resume(tmp: Path) -> None:
    platform.init_distributed()  # a world of one
    section = CheckpointSection(enable=True, resume_from=1)
    Checkpointer(section, str(tmp / "dump"), {**FACTS, "prompts_per_step": 8}).find()


def render(tmp: Path) -> None:
    renderer = build_renderer(TaskSection(name="dataset"), str(tmp / "ckpt"), 64)
    renderer.encode([Prompt(text="1+2=", answer="3")])


OPENERS = {
    "trainer": lambda tmp: read_hf_shapes(str(tmp / "ckpt")),
    # Checked before vLLM's own loader reads the weights.
    "generator": lambda tmp: LocalGenerator(
        generator=GeneratorSection(), model=ModelSection(hf_checkpoint=str(tmp / "ckpt"))
    ),
    "tokenizer": lambda tmp: load_tokenizer(str(tmp / "ckpt")),
    "renderer": render,
    "vocab check": lambda tmp: check_tokenizer_fits(ModelSection(hf_checkpoint=str(tmp / "ckpt"))),
    "stop ids": lambda tmp: checkpoint_stop_ids(str(tmp / "ckpt")),
    "dataset": lambda tmp: read_rows(str(tmp / "data"), DatasetKeys()),
    "eval set": lambda tmp: read_rows(
        str(tmp / "eval.parquet"), DatasetKeys(), "eval.dataset_path"
    ),
    # A damaged step folder is skipped with a warning; checkpoint.resume_from naming it is an
    # error that says what is wrong with it.
    "resume": resume,
}

# (file under the test's folder, damage, what opens it, words the one-line error holds).
DAMAGED = [
    ("ckpt/model.safetensors", "cut in half", "trainer", "'{tmp}/ckpt': model.safetensors is"),
    ("ckpt/model.safetensors", "cut to 5 bytes", "trainer", "(header too small; 5 bytes)"),
    ("ckpt/model.safetensors", "emptied", "trainer", "is damaged (header too small; 0 bytes)"),
    ("ckpt/model.safetensors", "cut in half", "generator", "damaged (incomplete metadata"),
    ("ckpt/model.safetensors.index.json", "cut in half", "trainer", "index.json is not valid"),
    ("ckpt/model.safetensors.index.json", "a shard less", "trainer", "lacks model-00002-of-00002"),
    ("ckpt/config.json", "an HTML page", "vocab check", "'{tmp}/ckpt': config.json is not valid"),
    ("ckpt/config.json", "cut in half", "tokenizer", "model.tokenizer_path = '{tmp}/ckpt'"),
    ("ckpt/config.json", "{}", "vocab check", "config.json has no vocab_size"),
    ("ckpt/tokenizer.json", "cut in half", "tokenizer", "tokenizer.json is not valid JSON"),
    ("ckpt/tokenizer.json", "cut in half", "vocab check", "tokenizer.json is damaged"),
    ("ckpt/tokenizer.json", "{}", "tokenizer", "tokenizer.json is damaged (Model missing."),
    ("ckpt/tokenizer.json", "deleted", "tokenizer", "has no tokenizer.json"),
    ("ckpt/tokenizer_config.json", "bad tokens", "tokenizer", "cannot load the tokenizer from"),
    ("ckpt/tokenizer_config.json", "emptied", "tokenizer", "(Expecting value: line 1 column 1;"),
    ("ckpt/tokenizer_config.json", "template cut", "renderer", "chat template (tokenizer_config"),
    ("ckpt/generation_config.json", "cut in half", "stop ids", "download it again"),
    ("data/a.parquet", "an HTML page", "dataset", "cannot read {tmp}/data/a.parquet (Parquet"),
    ("data/a.parquet", "cut in half", "dataset", "is it a whole Parquet file? write or download"),
    ("data/a.parquet", "emptied", "dataset", "task.dataset_path: cannot read {tmp}/data/a.parquet"),
    ("data/b.json", "cut in half", "dataset", "task.dataset_path: {tmp}/data/b.json is not valid"),
    ("data/c.jsonl", "cut mid-row", "dataset", "{tmp}/data/c.jsonl:4: not a JSON object"),
    ("eval.parquet", "cut in half", "eval set", "eval.dataset_path: cannot read {tmp}/eval"),
    (f"{STEP}/.metadata", "deleted", "resume", "resume_from = 1: {tmp}/dump/checkpoints/step-1 is"),
    (f"{STEP}/__0_0.distcp", "cut in half", "resume", "has 50 bytes, the manifest says 100"),
    (f"{STEP}/{MANIFEST}", "cut in half", "resume", f"is incomplete: unreadable {MANIFEST}"),
    (f"{STEP}/{MANIFEST}", "[]", "resume", f"{MANIFEST} is not one this program writes"),
]


def inputs(tmp: Path) -> None:
    """Whole copies of every input a run reads: the HF checkpoint, datasets, a step folder."""
    shutil.copytree(TINY, tmp / "ckpt")
    index = {"weight_map": {"model.norm.weight": "model.safetensors"}}
    (tmp / "ckpt" / "model.safetensors.index.json").write_text(json.dumps(index))
    (tmp / "data").mkdir()
    pq.write_table(pa.Table.from_pylist(ROWS), tmp / "data" / "a.parquet")
    shutil.copyfile(tmp / "data" / "a.parquet", tmp / "eval.parquet")
    (tmp / "data" / "b.json").write_text(json.dumps(ROWS))
    (tmp / "data" / "c.jsonl").write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    (tmp / STEP).mkdir(parents=True)
    files = {".metadata": b"m" * 10, "__0_0.distcp": b"d" * 100}
    for name, data in files.items():
        (tmp / STEP / name).write_bytes(data)
    manifest = {"step": 1, "facts": FACTS, "files": {k: len(v) for k, v in files.items()}}
    (tmp / STEP / MANIFEST).write_text(json.dumps(manifest))


@pytest.mark.parametrize(
    "file, damage, opener, words", DAMAGED, ids=[" ".join(case[:3]) for case in DAMAGED]
)
def test_a_damaged_input_file_is_one_line_naming_it(file, damage, opener, words, tmp_path):
    inputs(tmp_path)
    path = tmp_path / file
    if DAMAGES[damage] is None:
        path.unlink()
    else:
        path.write_bytes(DAMAGES[damage](path.read_bytes()))
    with pytest.raises(ConfigError) as error:
        OPENERS[opener](tmp_path)
    message = str(error.value)
    assert "\n" not in message and path.name in message, message
    assert words.replace("{tmp}", str(tmp_path)) in message, message
