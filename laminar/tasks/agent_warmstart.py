"""Teach a model the agent conversations of the calculator task, in the chat format the gateway renders.

    python -m laminar.tasks.agent_warmstart MODEL_DIR --data prompts.jsonl [--steps 400]

Each word problem (laminar/tasks/word_problems.py) becomes the conversation laminar/tasks/calc_agent.py
holds with the policy: the user's problem (with the calculator in the tools), the assistant's
`<tool_call>` of the problem's arithmetic, the tool's result, the assistant's boxed answer. The
conversation is rendered by laminar/chat.py, exactly as the gateway renders the agent's calls, and
the loss is on the assistant turns only (their end-of-turn token included). Tests teach one
fixed call and answer instead (a tiny model learns it in a hundred steps or so, so a test's
episode makes a tool call whatever the question).
"""
from __future__ import annotations

import argparse
import json
import random
import re
from pathlib import Path

from laminar.chat import ChatFormat
from laminar.tasks.calc_agent import TOOLS
from laminar.tasks.warmstart import fit

FIXED = ("6 * 7", "42")
_STEP = re.compile(r"(gets|loses) (\d+):")


def expression(rec: dict) -> str:
    """The arithmetic of a word problem from its worked solution: `3 + 4 - 2`."""
    start = rec["solution"].split(": ", 1)[1].split(" ", 1)[0]
    ops = " ".join(f"{'+' if k == 'gets' else '-'} {x}" for k, x in _STEP.findall(rec["solution"]))
    return f"{start} {ops}"


def conversation(prompt: str, expr: str, result: str, tool: str = "calculator", arg: str = "expression",
                 answer: str | None = None) -> list[dict]:
    """The calc agent's exchange with a policy that calls the tool once, then answers."""
    call = {"id": "call_0", "type": "function", "function": {"name": tool, "arguments": json.dumps({arg: expr})}}
    return [{"role": "user", "content": prompt}, {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_0", "content": result},
            {"role": "assistant", "content": answer or f"The answer is \\boxed{{{result}}}."}]


def calc_conversations(records: list[dict], fixed: bool = False) -> list[list[dict]]:
    """The word problems' conversations: each problem's own arithmetic, or one fixed call (FIXED)."""
    return [conversation(r["prompt"], *(FIXED if fixed else (expression(r), r["answer"]))) for r in records]


def encode(fmt: ChatFormat, messages: list[dict], tools: list[dict] = TOOLS) -> tuple[list[int], list[int]]:
    """Token ids of the whole conversation and the loss mask: 1 on each assistant turn (what the
    model writes after the template opened its turn, through its end-of-turn token)."""
    ids = fmt.encode(fmt.render(messages, tools, generation_prompt=False))
    mask = [0] * len(ids)
    for k, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        start = len(fmt.encode(fmt.render(messages[:k], tools, generation_prompt=True)))
        end = len(fmt.encode(fmt.render(messages[:k + 1], tools, generation_prompt=False)))
        end = next((i + 1 for i in range(start, end) if ids[i] == fmt.eos_id), end)
        mask[start:end] = [1] * (end - start)
    return ids, mask


def teach(model_dir: str | Path, conversations: list[list[dict]], steps: int = 400, lr: float = 1e-2,
          batch: int = 8, seed: int = 0, log_every: int = 0, tools: list[dict] = TOOLS) -> dict:
    """Fine-tune MODEL_DIR in place on `conversations` (drawn at random), `tools` offered in each; the
    rate warms up and decays from `lr` (warmstart.lr_factor's cosine)."""
    import torch  # late: torch; configs validate without it
    torch.manual_seed(seed)
    rng = random.Random(seed)
    fmt = ChatFormat.load(str(model_dir))
    encoded = [encode(fmt, c, tools) for c in conversations]

    def next_batch() -> tuple[list[list[int]], list[list[int]]]:
        seqs, masks = zip(*(rng.choice(encoded) for _ in range(batch)), strict=True)
        return list(seqs), list(masks)
    return fit(model_dir, next_batch, steps, lr, "cosine", 0, log_every, "agent warm start")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model_dir")
    ap.add_argument("--data", required=True, help="word problems (JSONL with prompt, answer, solution)")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--lr", type=float, default=5e-3, help="the first rate (it decays to 0, cosine)")
    ap.add_argument("--batch", type=int, default=8, help="conversations a step")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    import torch  # late: torch; configs validate without it
    torch.set_num_threads(2)
    records = [json.loads(line) for line in Path(a.data).read_text().splitlines() if line.strip()]
    print(teach(a.model_dir, calc_conversations(records), a.steps, a.lr, batch=a.batch, seed=a.seed, log_every=50))


if __name__ == "__main__":
    main()
