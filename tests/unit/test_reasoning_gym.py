"""reasoning-gym as a task source (task.name = reasoning_gym): rows and rewards of two
generators, the answer extraction, the held-out set, the error lines, a mixture, and the
evaluation's raw and extracted figures.

    .venv/bin/python -m pytest tests/unit/test_reasoning_gym.py
"""

import asyncio
import math
import re
import typing

import pytest
from helpers.launch import TINY, write_toml

from torchtitan_rl.config import ConfigError, parse_args, to_toml
from torchtitan_rl.config.task import SourceSection
from torchtitan_rl.episodes import open_task
from torchtitan_rl.evaluation import build_evaluator
from torchtitan_rl.tasks.mixture import Mixture
from torchtitan_rl.tasks.reasoning_gym import (
    EXTRACTIONS,
    ReasoningGymTask,
    answer_tags,
    last_number,
    raw_reply,
)
from torchtitan_rl.types import Completions, Prompt, Sample

pytestmark = pytest.mark.usefixtures("repo_cwd")

# The settings of the SmolLM2 demo: sums of 2-3 terms of 1-2 digits; 2-term + and - of 1-2.
CHAIN_SUM = {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 2}
ARITHMETIC = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}
ARITHMETIC_TOML = (
    'min_terms = 2\nmax_terms = 2\nmin_digits = 1\nmax_digits = 2\noperators = ["+", "-"]'
)


def source(generator: str, config: dict, **fields) -> SourceSection:
    section = SourceSection(
        name="reasoning_gym", reasoning_gym=generator, reasoning_gym_config=config, **fields
    )
    section.validate()
    return section


@pytest.fixture(scope="module")
def chain_sum() -> ReasoningGymTask:
    return ReasoningGymTask(
        source("chain_sum", CHAIN_SUM, reasoning_gym_size=200, reasoning_gym_eval_size=100)
    )


def test_extraction_rules():
    explained = "Let me add them: 15 - 43 = -28, then -28 - 75 = -103.\nSo the answer is -103."
    assert last_number(explained) == "-103"
    assert last_number("1,250 - 3 = 1,247.") == "1247" and last_number("3-4") == "4"
    assert last_number("x2 is no number") is None and last_number("2.5 apples") == "2.5"
    assert answer_tags("I think <answer>7</answer>, no: <answer> 8 </answer>") == "8"
    assert answer_tags("8") is None and raw_reply("  8\n") == "8"
    # The config's choices are the rules.
    field = typing.get_type_hints(SourceSection)["answer_extraction"]
    assert set(typing.get_args(typing.get_args(field)[0])) == set(EXTRACTIONS)


def test_chain_sum_rows_read_in_seeded_epochs_and_scored_by_its_own_scorer(chain_sum):
    first = chain_sum.table[0]
    assert (
        first.text == "State the final answer to the following arithmetic problem: 15 - 43 - 75 ="
    )
    assert first.answer == "-103" and first.row == "chain_sum (seed 0) entry 0"
    epoch = chain_sum.rows(0, 200)
    assert sorted(p.row for p in epoch) == sorted(p.row for p in chain_sum.table)
    assert chain_sum.rows(0, 200) == epoch and chain_sum.prompts(2, 8) == chain_sum.rows(8, 8)
    assert chain_sum.rows(200, 200) != epoch  # the next epoch: another order
    # The reward: the scorer on the last number; the raw figure: the scorer on the whole reply.
    explained = "Adding up: 15 - 43 - 75 = -103. The answer is -103."
    assert chain_sum.reward(first, explained) == 1.0
    assert chain_sum.reward(first, "-103") == 1.0 and chain_sum.reward(first, "103") == 0.0
    assert chain_sum.reward(first, "no number here") == 0.0
    extracted, raw = chain_sum.rewards()
    assert (extracted.name, extracted.weight, raw.name, raw.weight) == ("extracted", 1, "raw", 0)
    assert extracted.fn(first.text, explained, first.answer) == 1.0
    # chain_sum's partial credit: the answer inside a longer reply.
    assert raw.fn(first.text, explained, first.answer) == pytest.approx(4 / len(explained))
    assert raw.fn(first.text, " -103\n", first.answer) == 1.0


def test_basic_arithmetic_rows_and_rewards_and_the_answer_tags_rule():
    config = ARITHMETIC | {"operators": ["+", "-"]}
    tags = ReasoningGymTask(source("basic_arithmetic", config, answer_extraction="answer_tags"))
    first = tags.table[0]
    assert first.text == "Calculate -33 - -22." and first.answer == "-11"
    assert all(re.fullmatch(r"-?\d+", p.answer) for p in tags.table)
    assert tags.reward(first, "-33 + 22 = -11, so <answer>-11</answer>") == 1.0
    assert tags.reward(first, "-33 + 22 = -11") == 0.0  # no tags: nothing extracted
    assert tags.reward(first, "<answer>-12</answer>") == 0.0
    last = ReasoningGymTask(source("basic_arithmetic", config))
    assert last.extraction == "last_number" and last.table == tags.table
    assert last.reward(first, "-33 + 22 = -11") == 1.0


def test_the_held_out_set_shares_no_question_with_training(chain_sum):
    questions = {p.text for p in chain_sum.table}
    assert chain_sum.eval_seed == 200  # past every seed the 200 training entries took
    assert not questions & {p.text for p in chain_sum.held_out}
    # The settings allow few enough sums that some held-out questions came up in training too:
    # they were dropped.
    assert 50 <= len(chain_sum.held_out) < 100
    assert chain_sum.held_out[0].row.startswith("chain_sum (seed 200) entry ")


def test_a_held_out_seed_that_repeats_the_training_questions_is_refused():
    # Seed 1's entry i is seed 0's entry i + 1 (a generator seeds entry i with seed + i).
    overlapping = source(
        "chain_sum", CHAIN_SUM, reasoning_gym_eval_size=50, reasoning_gym_eval_seed=1
    )
    with pytest.raises(ConfigError) as refused:
        ReasoningGymTask(overlapping, at="task.sources.sums")
    assert str(refused.value) == (
        "task.sources.sums.reasoning_gym_eval_seed = 1: 50 of the 50 held-out questions are "
        "training questions too: use a seed of 1000 or more (a generator seeds entry i with "
        "seed + i), or settings that make more distinct questions"
    )


def open_toml(tmp_path, text: str, *flags: str):
    path = write_toml(tmp_path, text + "\n[training]\nmax_prompt_len = 160\n")
    return open_task(parse_args(["--job.config_file", path, "--model.hf_checkpoint", TINY, *flags]))


ONE = """
[task]
name = "reasoning_gym"
reasoning_gym = "chain_sum"
reasoning_gym_size = 100
reasoning_gym_eval_size = 20

[task.reasoning_gym_config]
min_terms = 2
max_terms = 3
"""


def test_an_unknown_generator_or_setting_is_one_line_at_open(tmp_path):
    with pytest.raises(ConfigError) as unknown:
        open_toml(tmp_path, ONE, "--task.reasoning_gym", "chain_summ")
    message = str(unknown.value)
    assert "\n" not in message
    assert re.fullmatch(
        r"task\.reasoning_gym = 'chain_summ': reasoning-gym 0\.1\.25 has no such generator: "
        r"did you mean chain_sum, decimal_chain_sum\? its generators: ab, .*, basic_arithmetic, "
        r".*, chain_sum, .*, zebra_puzzles",
        message,
    ), message
    with pytest.raises(ConfigError) as bad_key:
        open_toml(tmp_path, ONE.replace("min_terms", "min_termz"))
    assert str(bad_key.value) == (
        "task.reasoning_gym_config.min_termz: chain_sum has no such setting: did you mean "
        "min_terms, max_terms? its settings: min_terms, max_terms, min_digits, max_digits, "
        "allow_negation"
    )
    # reasoning-gym's own refusal (an assert in its config's checks), reworded.
    with pytest.raises(ConfigError) as refused:
        open_toml(tmp_path, ONE.replace("max_terms = 3", "max_terms = 1"))
    assert str(refused.value) == (
        "task.reasoning_gym_config = {'min_terms': 2, 'max_terms': 1}: chain_sum refuses it "
        "(max_terms must be >= min_terms): fix the settings (their defaults: "
        "reasoning_gym.arithmetic.chain_sum.ChainSumConfig)"
    )
    with pytest.raises(ConfigError, match=r"^task.answer_extraction = 'last_number' \(also when "):
        open_toml(tmp_path, ONE.replace("chain_sum", "spell_backward").split("[task.reasoning")[0])


@pytest.mark.parametrize(
    "text, message",
    [
        ('[task]\nname = "reasoning_gym"', "task.name = 'reasoning_gym' needs task.reasoning_gym"),
        (
            '[task]\nreasoning_gym = "chain_sum"',
            "task.reasoning_gym = 'chain_sum' but task.name = 'echo_digits': set task.name = "
            "'reasoning_gym', or unset it",
        ),
        (ONE + "seed = 3", "task.reasoning_gym_config.seed = 3: set task.reasoning_gym_seed"),
        (ONE.replace("size = 100", "size = 0"), "task.reasoning_gym_size = 0: must be >= 1"),
        (
            '[task.sources.s]\nname = "reasoning_gym"\nreasoning_gym = "chain_sum"\n'
            'eval_dataset_path = "data/arith/test.parquet"',
            "task.sources.s.eval_dataset_path is set but task.sources.s.name = 'reasoning_gym' "
            "generates its held-out set: set task.sources.s.reasoning_gym_eval_size",
        ),
    ],
)
def test_bad_values_are_refused_by_the_config(tmp_path, text, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_args(["--job.config_file", write_toml(tmp_path, text), "--model.hf_checkpoint", TINY])


MIXTURE = f"""
[task.sources.sums]
weight = 3
name = "reasoning_gym"
reasoning_gym = "chain_sum"
reasoning_gym_size = 100
reasoning_gym_eval_size = 20
reasoning_gym_config = {{ min_terms = 2, max_terms = 3, min_digits = 1, max_digits = 2 }}

[task.sources.arith]
weight = 1
name = "reasoning_gym"
reasoning_gym = "basic_arithmetic"
reasoning_gym_size = 100
reasoning_gym_eval_size = 10
answer_extraction = "answer_tags"
system_prompt = "Put the answer in <answer></answer> tags."

[task.sources.arith.reasoning_gym_config]
{ARITHMETIC_TOML}
"""


def test_a_mixture_of_two_generators_each_with_its_rewards_and_eval_set(tmp_path):
    config = parse_args(
        ["--job.config_file", write_toml(tmp_path, MIXTURE), "--model.hf_checkpoint", TINY]
    )
    assert config.task.sources["arith"].reasoning_gym_config["operators"] == ["+", "-"]
    # The written config reads back as the same config (the settings tables included).
    assert parse_args(["--job.config_file", write_toml(tmp_path, to_toml(config))]) == config
    opened = open_toml(tmp_path, MIXTURE)
    assert isinstance(opened.task, Mixture) and opened.task.weights_S == [3.0, 1.0]
    drawn = [p.source for step in range(1, 51) for p in opened.task.prompts(step, 16)]
    assert 0.7 < drawn.count("sums") / len(drawn) < 0.8
    held = {s: [p for p in opened.eval_prompts if p.source == s] for s in ("sums", "arith")}
    assert 10 <= len(held["sums"]) <= 20 and len(held["arith"]) == 10
    sums, arith = held["sums"][0], held["arith"][0]
    assert "<answer></answer> tags" in opened.renderer_of(arith).text(arith)
    assert "tags" not in opened.renderer_of(sums).text(sums)
    # Each source scores with its own generator and rule; its figures are its own.
    replies = [f"so {sums.answer}", f"<answer>{sums.answer}</answer>, checked 2 times"]
    replies.append(arith.answer)
    replies.append(f"<answer>{arith.answer}</answer>")
    total, parts = asyncio.run(opened.scorer.score([sums, sums, arith, arith], replies))
    assert total == [1.0, 0.0, 0.0, 1.0]  # sums reads the last number, arith the tags
    assert set(parts) == {"extracted/sums", "raw/sums", "extracted/arith", "raw/arith"}
    assert parts["extracted/arith"][2:] == [0.0, 1.0] and parts["raw/arith"][2] == 1.0
    assert all(math.isnan(v) for v in parts["raw/arith"][:2] + parts["raw/sums"][2:])
    assert parts["raw/sums"][0] < 1.0  # "so -12": the answer with a word before it


class Replies:
    """Stands for the generator where the test chooses each reply (no engine can be told what
    to sample): the reply of each prompt's ids."""

    def __init__(self, replies: dict[tuple[int, ...], list[int]]):
        self.replies = replies

    def generate(self, prompts, *, n, max_tokens, seed, temperature=None):
        samples = [
            [Sample(ids, [0.0] * len(ids), "stop")] * n
            for ids in (self.replies[tuple(p)] for p in prompts)
        ]
        return Completions([list(p) for p in prompts], samples)


def test_evaluation_gives_the_score_of_the_raw_reply_beside_the_extracted_one(tmp_path):
    path = write_toml(tmp_path, ONE + "\n[training]\nmax_prompt_len = 160\n")
    config = parse_args(["--job.config_file", path, "--model.hf_checkpoint", TINY])
    opened = open_task(config)
    prompts: list[Prompt] = opened.eval_prompts
    renderer = opened.renderer
    # Half the replies explain, then give the right number; the rest give it alone.
    replies = [
        f"First I add the numbers. The answer is {p.answer}." if i % 2 else p.answer
        for i, p in enumerate(prompts)
    ]
    ids = renderer.encode(prompts)
    encoded = {
        tuple(p): renderer.tokenizer.encode(r, add_special_tokens=False)
        for p, r in zip(ids, replies, strict=True)
    }
    evaluator = build_evaluator(config, opened)
    shard = evaluator.run(Replies(encoded), version=0)
    figures = shard.metrics()
    assert figures["eval/prompts"] == len(prompts) and figures["eval/accuracy"] == 1.0
    assert figures["eval/reward/extracted"] == 1.0
    bare = math.ceil(len(prompts) / 2) / len(prompts)
    assert bare < figures["eval/reward/raw"] < bare + 0.1  # the explained ones: partial credit
    logged = shard.samples[1]
    assert logged["reward_parts"]["extracted"] == [1.0] and logged["reward_parts"]["raw"][0] < 0.2
