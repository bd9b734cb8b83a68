"""Environments, tool calls and multi-turn episodes with a scripted policy: token-exact,
limited, failing cleanly; the env config. On the real engine: tests/integration/test_envs.py.

    .venv/bin/python -m pytest tests/unit/test_envs.py
"""

import asyncio
import json

import numpy as np
import PIL.Image
import pytest
import torch
from helpers.launch import REPO
from helpers.render import chatter_renderer, encode, same_images, vision_renderer
from user_envs import Chatter, Flaky  # noqa: E402

from torchtitan_rl.config import ConfigError, parse_args
from torchtitan_rl.episodes import Episodes, Source, open_task
from torchtitan_rl.loop import load_hooks
from torchtitan_rl.metrics import MetricsLogger
from torchtitan_rl.tasks.env import Calculator, EnvStep, calc, load_env, parse_tool_calls
from torchtitan_rl.tasks.rewards import RewardError, Scorer
from torchtitan_rl.types import Completions, Prompt, Sample, rollout_batch

IM_END = 4
CALL = '<tool_call>\n{"name": "calc", "arguments": {"expression": "max(3,7)"}}\n</tool_call>'


@pytest.fixture(scope="module")
def renderer():
    return chatter_renderer()


# Tool calls and the calculator environment.


# Rendering the environment's replies without re-encoding the sampled turn.


# Episodes with a scripted policy: the token bookkeeping, the limits and the failures.


class Scripted:
    """Stands for the generator where the test must choose what the policy samples (vLLM
    samples from the model; no real engine can be told which ids to sample). Turn t of every
    episode samples `turns[t]`; logprobs are -(position + 1) / 100."""

    def __init__(self, turns: list[list[int]]):
        self.turns, self.prompts, self.images = turns, [], []

    def generate(self, prompts, *, n, max_tokens, seed, temperature=None, images=None):
        self.prompts.append([list(p) for p in prompts])
        self.images.append(images)
        ids = self.turns[len(self.prompts) - 1]
        limits = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(prompts)
        samples = []
        for limit in limits:
            cut = ids[:limit]
            sample = Sample(
                cut, [-(i + 1) / 100 for i in range(len(cut))], "stop" if cut == ids else "length"
            )
            samples.append([sample] * n)
        return Completions([list(p) for p in prompts], samples)


def episodes(renderer, make_env, *, max_turns=4, max_model_len=512, on_error="zero", timeout=5.0):
    scorer = Scorer(None, {}, on_error)
    runner = Episodes(
        {"": Source(renderer, make_env, max_turns)},
        scorer,
        stop_ids=[IM_END, 1],
        max_model_len=max_model_len,
        timeout_s=timeout,
    )
    return runner, scorer


# Multi-turn episodes on the real vLLM engine.


# Config: task.env, its kwargs table, job.hooks.


# The whole loop: a user environment and user hooks from the config, 2 ranks, bitwise.


# The calculator demo's data.


def test_tool_calls_parse_in_the_hermes_format_and_malformed_ones_are_errors():
    (call,) = parse_tool_calls(f"let me compute {CALL}")
    assert (call.name, call.arguments, call.error) == ("calc", {"expression": "max(3,7)"}, None)
    compact = '<tool_call>{"name":"calc","arguments":{"expression":"1+2"}}</tool_call>'
    assert [c.name for c in parse_tool_calls(compact + compact)] == ["calc", "calc"]
    assert parse_tool_calls("7") == []
    errors = [
        c.error
        for c in parse_tool_calls(
            '<tool_call>{"name": "calc"</tool_call><tool_call>{"arguments": {}}</tool_call>'
            '<tool_call>{"name": "calc", "arguments": 3}</tool_call><tool_call>{"name": "c'
        )
    ]
    assert errors == [
        "the tool call is not JSON (Expecting ',' delimiter)",
        'the tool call needs a "name"',
        '"arguments" must be an object',
        "the <tool_call> is not closed by </tool_call>",
    ]


def test_calc_evaluates_integer_arithmetic_and_nothing_else():
    assert [calc(e) for e in ("max(3,7)", "min(3,7)", "12+30", "2*-3", "max(1,min(5,4))")] == [
        "7",
        "3",
        "42",
        "-6",
        "4",
    ]
    for bad in ("__import__('os')", "2**99", "1/2", "x", "max()", "1" * 65):
        with pytest.raises(ValueError):
            calc(bad)


def test_the_calculator_answers_calls_and_rewards_the_final_answer():
    async def episode(turns: list[str]):
        env = Calculator()
        messages, tools = await env.reset(Prompt("max(3,7)=", "7"))
        steps = [await env.step({"role": "assistant", "content": t}) for t in turns]
        return messages, tools, steps

    messages, tools, (call, answer) = asyncio.run(episode([CALL, "7"]))
    assert messages == [{"role": "user", "content": "max(3,7)="}]
    assert tools[0]["function"]["name"] == "calc"
    assert (call.messages, call.done, call.tool_calls, call.tool_errors) == (
        [{"role": "tool", "content": "7"}],
        False,
        1,
        0,
    )
    assert (answer.done, answer.reward) == (True, 1.0)
    _, _, (wrong,) = asyncio.run(episode(["3"]))
    assert (wrong.done, wrong.reward) == (True, 0.0)
    # The model's mistakes are replies, never exceptions.
    bad = '<tool_call>{"name": "sqrt", "arguments": {"x": 2}}</tool_call><tool_call>{oops'
    _, _, (step,) = asyncio.run(episode([bad]))
    assert [m["content"] for m in step.messages] == [
        "error: no tool 'sqrt'",
        "error: the <tool_call> is not closed by </tool_call>",
    ]
    assert (step.done, step.tool_calls, step.tool_errors) == (False, 2, 2)


def test_reply_ids_continue_the_sampled_ids_as_the_whole_chat_renders(renderer):
    """prompt + sampled call (with <|im_end|>) + reply ids == the full chat, encoded at once:
    what SFT on this trace trains on is what RL samples."""
    user = [{"role": "user", "content": "max(3,7)="}]
    tool = [{"role": "tool", "content": "7"}]
    prompt = renderer.chat(user, None, generation_prompt=True)
    sampled = encode(renderer, CALL) + [IM_END]
    reply = renderer.reply_ids(user, tool, None, stop_id=IM_END)
    assert (
        renderer.tokenizer.decode(reply)
        == "\n<|im_start|>tool\n7<|im_end|>\n<|im_start|>assistant\n"
    )
    whole = user + [{"role": "assistant", "content": CALL}] + tool
    assert encode(renderer, prompt) + sampled + reply == encode(
        renderer, renderer.chat(whole, None, generation_prompt=True)
    )
    # A turn that ended on a stop string, or on <|eos|> (which the template does not close
    # turns with), has no <|im_end|>: the reply closes the turn.
    assert renderer.reply_ids(user, tool, None, stop_id=None) == [IM_END] + reply
    assert renderer.reply_ids(user, tool, None, stop_id=1) == [IM_END] + reply


REWRITING = (
    "{% for m in messages %}{% if loop.last %}last {% endif %}<|im_start|>{{ m['role'] }}\n"
    "{{ m['content'] }}<|im_end|>\n{% endfor %}"
)


def test_a_template_that_rewrites_earlier_turns_is_refused(renderer):
    user = [{"role": "user", "content": "max(3,7)="}]
    original = renderer.tokenizer.chat_template
    renderer.tokenizer.chat_template = REWRITING
    try:
        with pytest.raises(
            ConfigError, match="does not render a chat as the chat before it plus the new messages"
        ):
            renderer.reply_ids(user, [{"role": "tool", "content": "7"}], None, stop_id=IM_END)
    finally:
        renderer.tokenizer.chat_template = original


def test_a_template_that_rewrites_earlier_turns_stops_the_run_with_its_own_line(renderer):
    """The template's error is the run's, not the environment's: no episode scores it as a
    failure (its ConfigError is a ValueError, which an unreadable image reply also is)."""
    original = renderer.tokenizer.chat_template
    renderer.tokenizer.chat_template = REWRITING
    try:
        runner, scorer = episodes(renderer, lambda: Chatter(turns=2))
        turn = encode(renderer, "12") + [IM_END]
        with pytest.raises(ConfigError, match="does not render a chat as the chat before it"):
            runner.run(Scripted([turn] * 2), [Prompt("max(3,7)=", "7")], seed=0, n=2, max_tokens=8)
        assert scorer.errors == 0
    finally:
        renderer.tokenizer.chat_template = original


def test_an_environments_malformed_image_part_is_one_line_naming_the_part(renderer):
    """At reset the run stops on it; at a step the episode scores as the environment's
    failure (or the run stops, under reward_on_error = "fail"): never a bare KeyError."""
    bare = [{"type": "text", "text": "look"}, {"type": "image"}]
    url_without = [{"type": "image_url", "image_url": {"detail": "low"}}]

    class Opens(Chatter):
        async def reset(self, prompt):
            return [{"role": "user", "content": bare}], None

    class Replies(Chatter):
        async def step(self, message):
            return EnvStep([{"role": "user", "content": url_without}], done=False)

    turn = encode(renderer, "12") + [IM_END]
    prompts = [Prompt("max(3,7)=", "7")]
    runner, _ = episodes(renderer, Opens)
    with pytest.raises(RewardError, match="message 0's part 1 is an image part without its image"):
        runner.run(Scripted([turn]), prompts, seed=0, n=1, max_tokens=8)
    runner, scorer = episodes(renderer, Replies)
    scored = runner.run(Scripted([turn] * 2), prompts, seed=0, n=2, max_tokens=8)
    assert scorer.errors == 2 and scored.rewards_PN.tolist() == [[0.0, 0.0]]
    runner, _ = episodes(renderer, Replies, on_error="fail")
    with pytest.raises(
        RewardError, match="step gave message 0's part 0 is an image_url part without its image"
    ):
        runner.run(Scripted([turn] * 2), prompts, seed=0, n=1, max_tokens=8)


def test_decoding_and_re_encoding_the_sampled_turn_would_change_the_trained_ids(renderer):
    """The constructed case: the policy samples the seven characters of "<think>" one by one.
    Decoded, they are the text "<think>", which encodes to one id: a loop that re-encodes turns
    would train on an id the policy never sampled, with the wrong logprob."""
    think = [renderer.tokenizer.convert_tokens_to_ids(c) for c in "<think>"]
    assert encode(renderer, renderer.tokenizer.decode(think)) == [5] != think
    scripted = Scripted([think + [IM_END], encode(renderer, "7") + [IM_END]])
    runner, _ = episodes(renderer, lambda: Chatter(turns=2))
    scored = runner.run(scripted, [Prompt("max(3,7)=", "7")], seed=0, n=1, max_tokens=16)
    (sample,) = scored.completions.samples[0]
    first = scored.completions.prompts[0]
    reply = renderer.reply_ids(
        sample.messages[:2], [{"role": "tool", "content": "go on 1"}], None, stop_id=IM_END
    )
    assert sample.token_ids == think + [IM_END] + reply + encode(renderer, "7") + [IM_END]
    assert sample.sampled_mask == [1] * 8 + [0] * len(reply) + [1, 1]
    # The second turn's prompt was the first turn's ids, extended: nothing re-encoded.
    assert scripted.prompts[1] == [first + think + [IM_END] + reply]
    # The generator's logprobs of every sampled token, 0 at the environment's.
    assert sample.logprobs == [-0.01 * i for i in range(1, 9)] + [0.0] * len(reply) + [-0.01, -0.02]
    assert [m["role"] for m in sample.messages] == ["user", "assistant", "tool", "assistant"]
    assert (sample.turns, sample.finish_reason) == (2, "stop")
    # Re-rendering the chat from its messages gives other ids than the episode trained on.
    rerendered = encode(renderer, renderer.chat(sample.messages, None, generation_prompt=False))
    assert first + sample.token_ids != rerendered[: len(first) + len(sample.token_ids)]


def test_episodes_end_as_truncated_at_max_turns_and_max_model_len(renderer):
    turn = encode(renderer, "12") + [IM_END]
    runner, _ = episodes(renderer, lambda: Chatter(turns=10), max_turns=2)
    scored = runner.run(Scripted([turn] * 3), [Prompt("max(3,7)=", "7")], seed=0, n=2, max_tokens=8)
    for sample in scored.completions.samples[0]:
        assert (sample.turns, sample.finish_reason, sum(sample.sampled_mask)) == (2, "length", 6)
    # 28 prompt + 3 sampled + 27 reply ids = 58: no room for a second turn in 58; in 59, one
    # token (the generator is asked for no more).
    runner, _ = episodes(renderer, lambda: Chatter(turns=10), max_model_len=58)
    scored = runner.run(Scripted([turn] * 3), [Prompt("max(3,7)=", "7")], seed=0, n=1, max_tokens=8)
    (sample,) = scored.completions.samples[0]
    assert (sample.turns, sample.finish_reason, sample.token_ids) == (1, "length", turn)
    runner, _ = episodes(renderer, lambda: Chatter(turns=10), max_model_len=59)
    scripted = Scripted([turn] * 3)
    scored = runner.run(scripted, [Prompt("max(3,7)=", "7")], seed=0, n=1, max_tokens=8)
    (sample,) = scored.completions.samples[0]
    assert (sample.turns, sample.finish_reason, len(sample.token_ids)) == (2, "length", 31)
    assert len(scripted.prompts[1][0]) == 58
    # A turn cut by max_tokens ends the episode: no stop token to continue from.
    runner, _ = episodes(renderer, lambda: Chatter(turns=10))
    scored = runner.run(Scripted([turn]), [Prompt("max(3,7)=", "7")], seed=0, n=1, max_tokens=2)
    assert scored.completions.samples[0][0].finish_reason == "length"


def test_an_environment_that_raises_or_hangs_scores_as_a_reward_error(renderer):
    turn = encode(renderer, "12") + [IM_END]
    prompts = [Prompt("max(3,7)=", "7"), Prompt("max(3,8)=", "8")]
    for mode in ("fail", "hang"):
        runner, scorer = episodes(renderer, lambda m=mode: Flaky(m, turns=2), timeout=0.2)
        scored = runner.run(Scripted([turn] * 2), prompts, seed=0, n=2, max_tokens=8)
        assert scorer.errors == 2  # the odd row's two episodes
        assert scored.rewards_PN[0].tolist() == [0.0, 0.0]
        assert [s.turns for s in scored.completions.samples[0]] == [1, 1]
        assert [s.turns for s in scored.completions.samples[1]] == [2, 2]

    class Sloppy(Chatter):
        async def step(self, message):
            return EnvStep([{"role": "tool", "content": 42}], done=False)

    runner, scorer = episodes(renderer, Sloppy)
    scored = runner.run(Scripted([turn]), prompts[:1], seed=0, n=1, max_tokens=8)
    assert (scorer.errors, scored.completions.samples[0][0].turns) == (1, 1)
    runner, _ = episodes(renderer, lambda: Flaky("fail"), on_error="fail")
    with pytest.raises(RewardError, match="the environment's step raised ValueError"):
        runner.run(Scripted([turn]), prompts, seed=0, n=1, max_tokens=8)


def test_a_group_whose_episodes_open_differently_is_refused(renderer):
    class Moody(Chatter):
        count = 0

        async def reset(self, prompt):
            Moody.count += 1
            return [{"role": "user", "content": f"{prompt.text} {Moody.count}"}], None

    runner, _ = episodes(renderer, Moody)
    with pytest.raises(ConfigError, match="opened the episodes of one prompt differently"):
        runner.run(Scripted([[IM_END]]), [Prompt("max(3,7)=", "7")], seed=0, n=2, max_tokens=8)


def test_an_environments_image_reply_shows_the_policy_that_image_from_then_on(tmp_path):
    """A vision-language policy's episodes, the environment replying to the first turn with an
    image (a PIL image part): each episode's next request carries the row's image and the
    reply's, each where its run lies (the reply's after the sampled ids), and the episode's
    sample carries both to the trainer's rows, its messages to rollouts.jsonl (the image in a
    few words). A text-only policy's episode given such a reply scores as the environment's
    failure, in one line."""
    renderer = vision_renderer()
    rng = np.random.default_rng(0)
    first, shown = (
        PIL.Image.fromarray(rng.integers(0, 256, (*size, 3), dtype=np.uint8))
        for size in ((56, 84), (56, 56))
    )
    row = ({"role": "user", "content": [{"type": "text", "text": "a"}, _image(first)]},)
    prompt = Prompt(text="a", answer="", messages=row, images=(first,))
    (row_ids,), (row_images,) = renderer.encode_images([prompt])

    class Shows(Chatter):
        async def reset(self, prompt):
            return list(prompt.messages or [{"role": "user", "content": prompt.text}]), None

        async def step(self, message):
            self.seen.append(message["content"])
            if len(self.seen) == 2:
                return EnvStep([], done=True, reward=1.0)
            look = [{"type": "text", "text": "look"}, _image(shown)]
            return EnvStep([{"role": "user", "content": look}], done=False)

    turn = encode(renderer, "b") + [IM_END]
    runner, _ = episodes(renderer, Shows)
    scripted = Scripted([turn, turn])
    scored = runner.run(scripted, [prompt], seed=0, n=2, max_tokens=8)
    assert scripted.prompts[0] == [row_ids] and same_images(scripted.images[0][0], row_images)
    samples = scored.completions.samples[0]
    for ids, images, sample in zip(scripted.prompts[1], scripted.images[1], samples, strict=True):
        assert ids[: len(row_ids) + len(turn)] == row_ids + turn
        assert len(images.starts) == 2 and images.starts[1] > len(row_ids) + len(turn)
        located = renderer.images.images(ids, images.pixel_values_PX, images.grid_thw_N3)
        assert same_images(images, located)  # each image's run where its start says
        reply_rows = images.pixel_values_PX[len(row_images.pixel_values_PX) :]
        assert torch.equal(reply_rows, renderer.images.read([shown])[0])
        assert sample.images is images and sample.turns == 2 and sample.token_ids[-1] == IM_END
    batch = rollout_batch(
        scored.completions.prompts, scored.completions.samples, scored.rewards_PN, 0
    )
    assert batch.images_B == tuple(sample.images for sample in samples)
    logger = MetricsLogger(str(tmp_path), enabled=True, total_steps=1, log_interval=1)
    logger.log_rollouts(1, [{"messages": samples[0].messages}])
    logged = json.loads((tmp_path / "rollouts.jsonl").read_text())["samples"][0]["messages"]
    assert logged[-2]["content"][1] == {"type": "image", "image": "<image: 56x56 RGB>"}

    text_only = chatter_renderer()
    runner, _ = episodes(text_only, Shows, on_error="fail")
    turn = encode(text_only, "b") + [IM_END]
    reads_none = "the reply holds 1 image\\(s\\), but the model reads no images"
    with pytest.raises(RewardError, match=reads_none):
        runner.run(Scripted([turn]), [Prompt("max(3,7)=", "7")], seed=0, n=1, max_tokens=8)


def _image(image) -> dict:
    return {"type": "image", "image": image}


def test_env_config_loads_a_user_class_with_its_kwargs_from_toml_and_cli(tmp_path, repo_cwd):
    toml = tmp_path / "run.toml"
    toml.write_text(
        (REPO / "run_configs" / "debug_cpu.toml")
        .read_text()
        .replace(
            'name = "echo_digits"',
            'name = "env"\nenv = "user_envs:Chatter"\ndataset_path = "data/arith/train.jsonl"\n'
            'max_turns = 3\nenv_timeout_s = 2.5\n[task.env_kwargs]\nturns = 2\nreply = "again"',
        )
    )
    config = parse_args(["--job.config_file", str(toml), "--task.env_kwargs.turns", "5"], 2)
    assert (config.task.env_kwargs, config.task.turns) == ({"turns": 5, "reply": "again"}, 3)
    env = load_env(config.task.env, config.task.env_kwargs)()
    assert (env.turns, env.reply) == (5, "again")
    assert config.episode_tokens == 3 * config.generator.sampling.max_tokens
    opened = open_task(config)  # what the run builds from them
    episodes = opened.episodes
    source = episodes.sources[""]
    assert (source.max_turns, episodes.timeout_s, episodes.stop_ids) == (3, 2.5, {1, 4})
    assert isinstance(source.make_env(), Chatter) and source.make_env().turns == 5


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--task.env", "user_envs:Chatter"], "task.env = 'user_envs:Chatter' but task.name"),
        (["--task.name", "env", "--task.dataset_path", "data/arith/train.jsonl"], "needs task.env"),
        (["--task.max_turns", "2"], "task.max_turns = 2 but task.name = 'echo_digits'"),
    ],
)
def test_env_fields_without_an_env_task_are_refused(flags, message):
    with pytest.raises(ConfigError, match=message):
        parse_args(["--job.config_file", str(REPO / "run_configs" / "debug_cpu.toml"), *flags], 2)


def test_a_bad_env_or_hooks_class_is_one_line_naming_the_field():
    with pytest.raises(ConfigError, match="task.env = 'user_envs:Nope': user_envs has no class"):
        load_env("user_envs:Nope", {})
    with pytest.raises(ConfigError, match=r"NeedsKwarg\(\*\*task.env_kwargs\) raised TypeError"):
        load_env("user_envs:NeedsKwarg", {"levl": 1})
    config = parse_args(["--job.config_file", str(REPO / "run_configs" / "debug_cpu.toml")], 2)
    config.job.hooks = "user_envs:NeedsKwarg"
    with pytest.raises(ConfigError, match=r"'user_envs:NeedsKwarg': NeedsKwarg\(config\) raised"):
        load_hooks(config)
    config.job.hooks = "user_envs:Chatter"
    with pytest.raises(ConfigError, match="Chatter has no before_step, after_train, after_sync"):
        load_hooks(config)
    config.job.hooks = "user_envs:RecordSteps"
    assert load_hooks(config).env is None
