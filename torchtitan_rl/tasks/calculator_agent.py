"""The calculator task as a plain OpenAI-client agent: the agent demo's (AGENT=1 ./scripts/demo.sh).

    .venv/bin/python -m pytest tests/integration/test_gateway.py -k calculator

It does what the `Calculator` environment (tasks/env.py) does, from the other side: it asks the
model with `tools=[calc]`, runs the calls the answer makes, sends their results back as tool
messages, and lets the task's reward function score the final answer. Its replies are the
environment's, word for word (a call that does not parse gets the environment's error text),
so that a run of it samples the same tokens as the environment's run: that equality is the
proof that the gateway is token-exact and seeded as the in-process path is.
"""

import json

from torchtitan_rl.tasks.env import Calculator, ToolCall, calc, parse_tool_calls

TOOLS = Calculator.schemas
MAX_TURNS = 2
"""A call, then the answer (the environment demo's task.max_turns)."""


async def calculator(client, model: str, row: dict) -> float | None:
    """One episode: at most MAX_TURNS turns. None: the task's reward function scores the final
    answer; 0.0 when the turns ran out on a tool call."""
    import openai

    messages = list(row["messages"])
    for _ in range(MAX_TURNS):
        try:
            response = await client.chat.completions.create(
                model=model, messages=messages, tools=TOOLS
            )
        except openai.BadRequestError as e:
            if "max_model_len" not in e.message:
                raise
            return 0.0  # the conversation outgrew the model's context: cut, as environments are
        message = response.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        replies = _replies(message)
        if not replies:
            return None  # the answer, even one cut at max_tokens: the reward function's
        if response.choices[0].finish_reason == "length":
            return 0.0  # a call cut at max_tokens: the environment ends such an episode too
        messages += replies
    return 0.0


def _replies(message) -> list[dict]:
    """The tool messages answering an assistant turn, as Calculator would: one per call, the
    result or "error: ..."; none for a turn without calls (the final answer)."""
    if message.tool_calls:
        calls = []
        for call in message.tool_calls:
            arguments = json.loads(call.function.arguments)
            if isinstance(arguments, dict):
                calls.append(ToolCall(call.function.name, arguments))
            else:
                calls.append(ToolCall("", {}, '"arguments" must be an object'))
        return [_reply(call, id_=c.id) for call, c in zip(calls, message.tool_calls, strict=True)]
    # A call the gateway's parser could not read comes back as text; the environment answers
    # its calls with their errors.
    return [_reply(call) for call in parse_tool_calls(message.content or "")]


def _reply(call: ToolCall, id_: str | None = None) -> dict:
    if call.error is not None:
        content = f"error: {call.error}"
    elif call.name != "calc":
        content = f"error: no tool {call.name!r}"
    else:
        try:
            content = calc(**call.arguments)
        except Exception as e:  # the model's arguments: any failure is the model's mistake
            content = f"error: {e}"
    reply = {"role": "tool", "content": content}
    if id_ is not None:
        reply["tool_call_id"] = id_
    return reply
