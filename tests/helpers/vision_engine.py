"""The tiny vision-language Muse Glimmer in a real vLLM engine (compiled, as users run it), its
requests carrying each prompt's images; print JSON on the last line.

    .venv/bin/python tests/helpers/vision_engine.py

Runs in its own process: vLLM's CPU worker binds threads, and its registry of HF config
classes (its own Muse Glimmer config among them) must not leak into pytest.
"""

import asyncio
import json
import sys
from pathlib import Path

import numpy as np
import PIL.Image
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # helpers.titan

from helpers.gateway_checks import drive  # noqa: E402
from helpers.render import same_images  # noqa: E402
from helpers.titan import torchtitan_model  # noqa: E402

from torchtitan_rl.config import GeneratorSection, ModelSection  # noqa: E402
from torchtitan_rl.generator.engine import LocalGenerator  # noqa: E402
from torchtitan_rl.models.vision import encoder_inputs  # noqa: E402
from torchtitan_rl.vision.preprocess import (  # noqa: E402
    ImageProcessorConfig,
    placeholder_count,
    preprocess,
)
from torchtitan_rl.vision.prompts import prompt_images  # noqa: E402

CHECKPOINT = str(Path(__file__).resolve().parents[2] / "assets" / "tiny_vl_muse_glimmer")
PATCH, IMAGE_START, IMAGE_END = 68, 69, 70


def prompt(sizes, seed: int):
    """A prompt with an image of each size (random pixels), and its Images."""
    rng = np.random.default_rng(seed)
    pictures = [PIL.Image.fromarray(rng.integers(0, 256, (*s, 3), dtype=np.uint8)) for s in sizes]
    config = ImageProcessorConfig.from_checkpoint(CHECKPOINT)
    pixel_values_PX, grid_thw_N3 = preprocess(pictures, config)
    ids = [3, 10, 11]
    for grid in grid_thw_N3:
        ids += [IMAGE_START] + [PATCH] * placeholder_count(grid, 2) + [IMAGE_END] + [12]
    ids += [4, 3]
    return ids, prompt_images(ids, pixel_values_PX, grid_thw_N3, PATCH, 2)


def against_the_trainer(engine) -> float:
    """Three prompts in one batch (two images of different shapes, one, none), two samples
    each: the largest |generator - torchtitan model| logprob over the sampled tokens."""
    prompts = [prompt(((56, 84), (28, 28)), 0), prompt(((84, 56),), 1), ([3, 10, 11, 4, 3], None)]
    completions = engine.generate(
        [ids for ids, _ in prompts],
        n=2,
        temperature=1.0,
        max_tokens=8,
        seed=0,
        images=[images for _, images in prompts],
    )
    assert completions.images[2] is None and completions.images[0] is prompts[0][1]
    model = torchtitan_model(CHECKPOINT, "tiny_vl", "muse_glimmer")
    worst = 0.0
    for (ids, images), samples in zip(prompts, completions.samples, strict=True):
        for sample in samples:
            expected = model_logprobs(model, ids, images, sample.token_ids)
            worst = max(worst, float((expected - torch.tensor(sample.logprobs)).abs().max()))
    return worst


def model_logprobs(model, ids: list[int], images, token_ids: list[int]) -> torch.Tensor:
    """The torchtitan model's logprob of each of `token_ids` after `ids` (with `images`)."""
    row = ids + token_ids
    vision = None if images is None else encoder_inputs([images], [0], 14, 2)
    with torch.no_grad():
        logits = model(torch.tensor([row]), positions=torch.arange(len(row))[None], vision=vision)
    logprobs = logits[0].log_softmax(-1)[len(ids) - 1 : -1]
    return logprobs.gather(1, torch.tensor(token_ids)[:, None])[:, 0]


def prefix_cache(engine) -> dict:
    """The same ids with the same image twice, then with another image of the same size."""
    ids, first = prompt(((56, 56),), 2)
    _, other = prompt(((56, 56),), 3)

    def logprobs(images):
        completions = engine.generate(
            [ids], n=1, temperature=0.0, max_tokens=4, seed=0, images=[images]
        )
        return completions.samples[0][0].logprobs

    once, again, another = logprobs(first), logprobs(first), logprobs(other)
    return {
        "same_image_equal": once == again,
        "other_image_diff": max(abs(a - b) for a, b in zip(another, once, strict=True)),
    }


def through_the_gateway(engine) -> dict:
    """Two turns of a gateway session over HTTP (the real `openai` client), each with an image
    as a data URL (a user's first message, then a reply). Given the prompt ids the gateway
    answered with and the images the renderer reads from the messages: whether the engine's
    own generate with the turn's seed samples the same ids with the same logprobs, the largest
    |returned - torchtitan model| logprob, and whether the session recorded the prompt and
    both turns' ids."""
    return asyncio.run(_gateway_turns(engine))


async def _gateway_turns(engine) -> dict:
    import httpx
    import openai

    from torchtitan_rl.config import ModelSection, TaskSection
    from torchtitan_rl.episodes import _defaults
    from torchtitan_rl.gateway.protocol import load_parsers
    from torchtitan_rl.gateway.server import Gateway, turn_seed
    from torchtitan_rl.generator.stream import AsyncStream, RequestStream
    from torchtitan_rl.tasks.render import build_renderer, image_reader
    from torchtitan_rl.vision.preprocess import data_url
    from torchtitan_rl.vision.prompts import join_images

    stream = AsyncStream(RequestStream(engine))
    stepping = asyncio.ensure_future(drive(stream))
    gateway = Gateway(stop_ids=set(engine.stop_token_ids), max_model_len=256)
    await gateway.start()
    model_section = ModelSection(name="muse_glimmer", flavor="tiny_vl", hf_checkpoint=CHECKPOINT)
    task = TaskSection(name="agent", agent="x:y", dataset_path=str(Path(CHECKPOINT).parent))
    renderer = build_renderer(task, CHECKPOINT, 256, images=image_reader(model_section))
    url, opened = gateway.open(
        renderer,
        load_parsers(renderer.tokenizer, None, None, "task"),
        seed=3,
        order=0,
        sample=_defaults(lambda _, *a, **k: stream.sample(*a, **k), 1.0, 6),
        max_turns=4,
    )
    rng = np.random.default_rng(6)
    pictures = [
        PIL.Image.fromarray(rng.integers(0, 256, (*size, 3), dtype=np.uint8))
        for size in ((56, 84), (56, 56))
    ]
    parts = [{"type": "image_url", "image_url": {"url": data_url(p)}} for p in pictures]
    messages = [{"role": "user", "content": [{"type": "text", "text": "a"}, parts[0]]}]
    model = torchtitan_model(CHECKPOINT, "tiny_vl", "muse_glimmer")
    worst, seen, same, row, images = 0.0, [], True, [], None
    async with httpx.AsyncClient(timeout=None) as http:
        client = openai.AsyncOpenAI(base_url=url, api_key=opened.key, http_client=http)
        for turn in range(2):
            answer = await client.chat.completions.create(
                model="policy",
                messages=messages,
                logprobs=True,
                extra_body={"return_token_ids": True},
            )
            choice = answer.choices[0]
            # This turn's image: its run in the ids after the last turn's (none sampled).
            new_ids = answer.prompt_token_ids[len(row) :]
            found = renderer.images.images(new_ids, *renderer.images.read([pictures[turn]]))
            images = join_images(images, found, len(row))
            expected = model_logprobs(model, answer.prompt_token_ids, images, choice.token_ids)
            returned = torch.tensor([c.logprob for c in choice.logprobs.content])
            worst = max(worst, float((expected - returned).abs().max()))
            direct = engine.generate(
                [answer.prompt_token_ids],
                n=1,
                temperature=1.0,
                max_tokens=6,
                seed=turn_seed(3, turn),
                images=[images],
            ).samples[0][0]
            same &= direct.token_ids == choice.token_ids and direct.logprobs == returned.tolist()
            seen += [answer.prompt_token_ids, choice.token_ids]
            row = answer.prompt_token_ids + choice.token_ids
            said = choice.message.model_dump(exclude_none=True)
            messages += [
                said,
                {"role": "user", "content": [{"type": "text", "text": "b"}, parts[1]]},
            ]
    stepping.cancel()
    (segment,) = opened.session.segments
    recorded = segment.first_ids + segment.token_ids
    return {
        "gateway_diff": worst,
        "gateway_same_as_generate": same,
        "gateway_images": len(segment.images.starts),
        "gateway_recorded": recorded == seen[2] + seen[3],
    }


def grouped_episodes(engine) -> dict:
    """The vision demo's task played by an environment whose reply to the first answer shows
    the row's image again, mirrored (helpers.user_envs:LookAgain), one prompt, the same seed:
    as the continuous placement runs a group (`Episodes.run_group`, its episodes as
    coroutines on the engine's stream) and as the other placements do (`Episodes.run`, a
    batched generate per turn). Whether they sample the same ids, score them alike and carry
    the same images (the row's, then the reply's), the largest difference of their
    logprobs, and the largest |generator - torchtitan model| logprob over both turns'
    sampled tokens, the model reading each episode's whole sequence with its images."""
    import tempfile

    from helpers import runs
    from helpers.launch import DEBUG_TOML

    from torchtitan_rl.config import parse_args
    from torchtitan_rl.episodes import open_task
    from torchtitan_rl.generator.stream import AsyncStream, RequestStream

    data = Path(tempfile.mkdtemp()) / "data"
    config = parse_args(
        [
            *("--job.config_file", DEBUG_TOML, *runs.VISION_MODEL),
            *runs.vision_task(data, 8, 4, env="helpers.user_envs:LookAgain"),
            # A turn that ends by max_tokens ends its episode: digits stop most turns sooner.
            *("--generator.sampling.stop", *"0123456789"),
            *("--training.max_prompt_len", "200", "--generator.max_model_len", "256"),
        ]
    )
    opened = open_task(config)
    (prompt,) = opened.task.every_prompt()[:1]
    sampling = {"seed": 11, "n": 3, "max_tokens": 8, "temperature": 1.0}
    engine.config.sampling, kept = config.generator.sampling, engine.config.sampling
    batched = opened.episodes.run(engine, [prompt], **sampling)

    async def streamed():
        stream = AsyncStream(RequestStream(engine))
        stepping = asyncio.ensure_future(drive(stream))
        try:
            return await opened.episodes.run_group(stream, prompt, **sampling)
        finally:
            stepping.cancel()

    grouped = asyncio.run(streamed())
    engine.config.sampling = kept
    (first_ids,), (first_images,) = batched.completions.prompts, batched.completions.images
    pairs = list(zip(batched.completions.samples[0], grouped.completions.samples[0], strict=True))
    model = torchtitan_model(CHECKPOINT, "tiny_vl", "muse_glimmer")
    worst = 0.0
    for sample, _ in pairs:
        images = sample.images or first_images  # None: the episode showed no other image
        logprobs = model_logprobs(model, first_ids, images, sample.token_ids)
        sampled = torch.tensor(sample.sampled_mask, dtype=torch.bool)
        diff = (logprobs - torch.tensor(sample.logprobs))[sampled].abs().max()
        worst = max(worst, float(diff))
    return {
        "group_same_as_batched": all(a.token_ids == b.token_ids for a, b in pairs)
        and torch.equal(batched.rewards_PN, grouped.rewards_PN),
        # First turns batch alike: their logprobs are equal. The second turns batch otherwise
        # (fp32, batch-invariant mode off).
        "group_first_turns_equal": all(
            a.logprobs[: _first_turn(a)] == b.logprobs[: _first_turn(b)] for a, b in pairs
        ),
        "group_logprob_diff": max(
            max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) for a, b in pairs
        ),
        "group_turns": [a.turns for a, _ in pairs],
        "group_images": [
            len((a.images or first_images).starts)
            if same_images(a.images or first_images, b.images or first_images)
            else -1
            for a, b in pairs
        ],
        "group_trainer_diff": worst,
    }


def _first_turn(sample) -> int:
    """How many tokens the episode's first turn sampled (its ids before the environment's)."""
    return sample.sampled_mask.index(0) if 0 in sample.sampled_mask else len(sample.token_ids)


def in_flight(engine) -> dict:
    """Requests with the same image streamed across weight updates of the tower alone (the
    continuous placement's), each token checked against the torchtitan model with the tower
    of the version that sampled it, over its whole prefix:
    - "recompute" (the default): a request in flight at the update 0 -> 1, its prompt and
      tokens prefilled again, and one submitted after it;
    - "keep": a request in flight at the update 1 -> 2 (its tokens before it), and one
      submitted after it, which no reset of the encoder cache protects."""
    from torchtitan_rl.generator.stream import RequestStream

    model = torchtitan_model(CHECKPOINT, "tiny_vl", "muse_glimmer")
    towers = {0: {n: t.clone() for n, t in model.state_dict().items() if n.startswith("vision_")}}
    ids, images = prompt(((56, 56),), 5)
    stream = RequestStream(engine)
    samples = {}

    def run(steps: int | None = None) -> None:
        for _ in range(steps or 1000):
            samples.update(stream.step())
            if not len(stream):
                return

    def submit(key: str, seed: int) -> None:
        stream.submit(key, ids, seed=seed, max_tokens=10, temperature=1.0, images=images)

    def update(version: int) -> None:
        noise = torch.Generator().manual_seed(version)
        with torch.no_grad():
            for name, param in engine.weights().items():
                if name.startswith("vision_"):
                    param.add_(torch.randn(param.shape, generator=noise) * param.std() / 2)
        towers[version] = {n: engine.weights()[n].detach().clone() for n in towers[0]}
        engine.refresh_after_weight_update()
        engine.policy_version = version

    def logprobs(sample, version: int) -> torch.Tensor:
        model.load_state_dict(towers[version], strict=False)
        return model_logprobs(model, ids, images, sample.token_ids)

    def diff(sample, versions: set[int]) -> float:
        worst = 0.0
        for version in versions:
            mine = torch.tensor([v == version for v in sample.versions])
            expected = logprobs(sample, version)[mine]
            worst = max(worst, float((expected - torch.tensor(sample.logprobs)[mine]).abs().max()))
        return worst

    submit("in flight", 1)
    run(3)
    update(1)
    submit("after", 2)
    run()
    straddling = samples["in flight"]
    moved = logprobs(straddling, 1) - logprobs(straddling, 0)
    figures = {
        "recompute_versions": sorted(set(straddling.versions)),
        "recompute_diff": max(diff(straddling, {0, 1}), diff(samples["after"], {1})),
        "tower_update_moves": float(moved.abs().max()),
    }
    engine.config.inflight_kv = "keep"
    submit("kept", 3)
    run(3)
    update(2)
    submit("after keep", 4)
    run()
    engine.config.inflight_kv = "recompute"
    model.load_state_dict(towers[0], strict=False)
    return {
        **figures,
        "keep_versions": sorted(set(samples["kept"].versions)),
        "keep_before_update_diff": diff(samples["kept"], {1}),
        "keep_after_diff": diff(samples["after keep"], {2}),
    }


def misplaced(engine) -> str:
    """A prompt whose image's run is cut short: the generator's one line."""
    ids, images = prompt(((28, 56),), 4)
    try:
        engine.generate([ids[:5] + ids[7:]], n=1, max_tokens=2, seed=0, images=[images])
    except ValueError as e:
        return str(e)
    return ""


def main() -> None:
    engine = LocalGenerator(
        generator=GeneratorSection(max_model_len=256),
        model=ModelSection(name="muse_glimmer", flavor="tiny_vl", hf_checkpoint=CHECKPOINT),
    )
    figures = {
        "compiled": engine.compiled,
        "trainer_diff": against_the_trainer(engine),
        **prefix_cache(engine),
        "misplaced": misplaced(engine),
        **through_the_gateway(engine),
        **grouped_episodes(engine),
        **in_flight(engine),
    }
    engine.close()
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
