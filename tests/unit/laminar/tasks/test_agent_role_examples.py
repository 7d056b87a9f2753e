"""The agent role's two example programs, their logic without a policy (laminar/tasks/):

- every generated repair task is sound: its test fails on the buggy module and passes on the
  reference fix; the repair agent writes the files, applies a `write_file` tool call, runs the
  test when asked, and reports whether it passes (a stand-in client plays the policy);
- the calculator agent evaluates arithmetic only, answers a tool call with the tool's result, and
  stops when the reply calls no tool;
- the word problems' arithmetic, as the calc agent's warm start writes it, is right.
"""
from __future__ import annotations

import json
from types import SimpleNamespace

from laminar.tasks import calc_agent, repair_agent
from laminar.tasks.agent_warmstart import expression
from laminar.tasks.repair_tasks import files_of, tasks
from laminar.tasks.word_problems import problem


class Policy:
    """A client whose replies are scripted: each a list of (tool name, arguments) or a text."""

    def __init__(self, replies):
        self.replies, self.seen = list(replies), []
        self.chat = SimpleNamespace(completions=SimpleNamespace(create=self.create))

    def create(self, **kw):
        self.seen.append({**kw, "messages": list(kw["messages"])})  # as it was at this call
        r = self.replies.pop(0)
        calls = None if isinstance(r, str) else [
            SimpleNamespace(id=f"call_{k}", function=SimpleNamespace(name=n, arguments=json.dumps(a)))
            for k, (n, a) in enumerate(r)]
        text = r if isinstance(r, str) else None
        msg = SimpleNamespace(content=text, tool_calls=calls,
                              model_dump=lambda **_: {"role": "assistant", "content": text})
        return SimpleNamespace(choices=[SimpleNamespace(message=msg)])


def test_repair_tasks_are_sound_and_the_agent_reports_the_test(tmp_path):
    for i, t in enumerate(tasks(12, seed=3)):
        d = tmp_path / str(i)
        d.mkdir()
        for name, text in files_of(t["prompt"]).items():
            (d / name).write_text(text)
        assert not repair_agent.run_tests(str(d))[0], t["prompt"]
        (d / "solution.py").write_text(t["answer"])
        assert repair_agent.run_tests(str(d))[0], t["answer"]
    t = tasks(1, seed=5)[0]
    fixing = Policy([[("run_tests", {})], [("write_file", {"path": "solution.py", "content": t["answer"]})], "done"])
    (tmp_path / "ok").mkdir()
    assert repair_agent.repair(fixing, "e1", t["prompt"], str(tmp_path / "ok"), "m") is True
    assert fixing.seen[0]["user"] == "e1" and fixing.seen[0]["tools"] == repair_agent.TOOLS
    assert fixing.seen[1]["messages"][-1]["content"].startswith("exit 1")   # the test's result went back
    sneaky = Policy([[("write_file", {"path": "../test_solution.py", "content": "print('ok')"})], "done"])
    (tmp_path / "no").mkdir()
    assert repair_agent.repair(sneaky, "e2", t["prompt"], str(tmp_path / "no"), "m") is False
    assert sneaky.seen[1]["messages"][-1]["content"].startswith("error: only solution.py")


def test_calc_agent_uses_the_calculator_until_the_policy_answers():
    assert calc_agent.calculate("3 + 4 - 2") == "5" and calc_agent.calculate("6*7/4") == "10.5"
    assert calc_agent.calculate("__import__('os')").startswith("error")
    policy = Policy([[("calculator", {"expression": "3 + 4"})], "The answer is \\boxed{7}."])
    msgs = calc_agent.solve(policy, "e1", "Tom has 3, gets 4.", "m")
    assert [m["role"] for m in msgs] == ["user", "assistant", "tool", "assistant"] and msgs[2]["content"] == "7"
    assert policy.seen[0]["tools"] == calc_agent.TOOLS and policy.seen[1]["user"] == "e1"


def test_word_problem_arithmetic():
    import random
    rng = random.Random(1)
    for _ in range(50):
        rec = problem(rng)
        assert calc_agent.calculate(expression(rec)) == rec["answer"]
