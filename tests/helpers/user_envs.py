"""Environments and hooks that tests name in a config (task.env, job.hooks), as a user's own
module would be: with tests/helpers on PYTHONPATH, no change to torchtitan_rl.

They speak the protocol of torchtitan_rl/tasks/env.py by duck typing (no base class)."""

import asyncio
import json
import os

from torchtitan_rl.tasks.env import EnvStep


class Chatter:
    """Answers every assistant turn with a tool message until `turns` turns, so that even a
    random model plays multi-turn episodes; the reward is the share of turns that sampled an
    even number of characters (a signal that varies within a group)."""

    def __init__(self, turns: int = 3, reply: str = "go on"):
        self.turns, self.reply = turns, reply
        self.seen: list[str] = []

    async def reset(self, prompt):
        return [{"role": "user", "content": prompt.text}], None

    async def step(self, message):
        self.seen.append(message["content"])
        if len(self.seen) >= self.turns:
            even = sum(len(text) % 2 == 0 for text in self.seen)
            return EnvStep([], done=True, reward=even / len(self.seen))
        return EnvStep([{"role": "tool", "content": f"{self.reply} {len(self.seen)}"}], done=False)


class Flaky(Chatter):
    """A Chatter whose step raises on rows with an odd answer (`fail`) or sleeps past any
    timeout on them (`hang`)."""

    def __init__(self, mode: str = "fail", **kwargs):
        super().__init__(**kwargs)
        self.mode = mode

    async def reset(self, prompt):
        self.odd = int(prompt.answer) % 2 == 1
        return await super().reset(prompt)

    async def step(self, message):
        if self.odd and self.mode == "fail":
            raise ValueError("odd rows fail")
        if self.odd:
            await asyncio.sleep(60)
        return await super().step(message)


class NeedsKwarg:
    def __init__(self, *, level: int):
        self.level = level

    async def reset(self, prompt):
        return [{"role": "user", "content": prompt.text}], None

    async def step(self, message):
        return EnvStep([], done=True)


class RecordSteps:
    """job.hooks: writes the steps it saw and the run's task.env to $HOOKS_RECORD."""

    def __init__(self, config):
        self.env, self.steps = config.task.env, []

    def before_step(self, step):
        pass

    def after_train(self, step, metrics):
        pass

    def after_sync(self, step, stats):
        pass

    def after_step(self, step, metrics):
        self.steps.append(step)
        path = os.environ.get("HOOKS_RECORD")
        if path:
            with open(path, "w") as f:
                json.dump({"env": self.env, "steps": self.steps}, f)


async def chatter_agent(client, model, row):
    """task.agent: `Chatter` from the agent's side, with the `openai` client: the same turns,
    replies and reward, so that its run samples the environment's tokens."""
    messages, seen = [{"role": "user", "content": row["prompt"]}], []
    while True:
        response = await client.chat.completions.create(model=model, messages=messages)
        choice = response.choices[0]
        seen.append(choice.message.content)
        if len(seen) >= 3:
            return sum(len(text) % 2 == 0 for text in seen) / len(seen)
        if choice.finish_reason != "stop":
            return 0.0  # cut at max_tokens: the environment's episode ends there too
        messages.append(choice.message.model_dump(exclude_none=True))
        messages.append({"role": "tool", "content": f"go on {len(seen)}"})


async def arith_agent(client, model, row):
    """task.agent: what verifiers' `null` harness does with a vf_arith task (one request with
    the task's prompt, the reply scored by vf_arith.reward_of), in process."""
    messages = [{"role": "user", "content": row["prompt"]}]
    response = await client.chat.completions.create(model=model, messages=messages)
    return len((response.choices[0].message.content or "").strip()) / 10


def serve_chatter_agent(port_file: str) -> None:
    """An agent server (task.agent_url) in its own process, as a user's would run in a
    container: POST / with {base_url, api_key, model, row} runs `chatter_agent` and answers
    {"reward": ...}; it writes its port to `port_file` once listening."""
    import socket

    import openai
    import uvicorn
    from fastapi import FastAPI, Request

    app = FastAPI()

    @app.post("/")
    async def episode(request: Request):
        body = await request.json()
        client = openai.AsyncOpenAI(base_url=body["base_url"], api_key=body["api_key"])
        async with client:
            return {"reward": await chatter_agent(client, body["model"], body["row"])}

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)  # NODELAY
    sock.bind(("127.0.0.1", 0))
    with open(port_file, "w") as f:
        f.write(str(sock.getsockname()[1]))
    uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[sock])


if __name__ == "__main__":
    import sys

    serve_chatter_agent(sys.argv[1])


async def vision_agent(client, model, row):
    """task.agent: a vision row's messages sent as the agent gets them (each image a data URL),
    the reply rewarded as `user_rewards.letters_of_answer` rewards a dataset row's."""
    from helpers.user_rewards import letters_of_answer

    response = await client.chat.completions.create(model=model, messages=row["messages"])
    return letters_of_answer(
        row["prompt"], response.choices[0].message.content or "", row["answer"]
    )


class LookAgain:
    """task.env for the vision task: the row's messages (its image); the first answer gets a
    user reply that shows the row's image again, mirrored (an image the episode has not
    shown), the second ends the episode, rewarded as `user_rewards.letters_of_answer` rewards
    a dataset row's answer."""

    async def reset(self, prompt):
        self.prompt, self.answers = prompt, 0
        return list(prompt.messages), None

    async def step(self, message):
        from helpers.user_rewards import letters_of_answer

        self.answers += 1
        if self.answers == 1:
            import PIL.Image

            with PIL.Image.open(self.prompt.images[0]) as image:
                mirrored = image.convert("RGB").transpose(PIL.Image.Transpose.FLIP_LEFT_RIGHT)
            look = [{"type": "text", "text": "look again:"}, {"type": "image", "image": mirrored}]
            return EnvStep([{"role": "user", "content": look}], done=False)
        reward = letters_of_answer(self.prompt.text, message["content"], self.prompt.answer)
        return EnvStep([], done=True, reward=reward)
