"""The hand-out key and MAC (roles/handout.py): with scoped keys the key comes from
`clients/pool.key_secret`, which a rollout host does not hold, so it cannot make a hand-out; and a
hand-out binds every field of the spec the pools rely on, and the rollout it names."""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest
from laminar.bus.auth import generate_client_key, generate_keys
from laminar.roles.handout import Handouts

from laminar.handout_key import handout_key
from laminar.protocol import TrajectorySpec


def cluster(keys_dir, run="r"):
    return SimpleNamespace(cluster=SimpleNamespace(keys_dir=str(keys_dir) if keys_dir else None),
                           run=SimpleNamespace(name=run))


def test_squat_handout_key_comes_from_the_pool_key_with_scoped_keys(tmp_path):
    one = tmp_path / "one"
    generate_keys(one)
    scoped = tmp_path / "scoped"
    generate_keys(scoped)
    generate_client_key(scoped, "rollout.r0")
    with pytest.raises(FileNotFoundError, match="--client pool"):   # a rollout host's folder: no pool key
        handout_key(cluster(scoped))
    generate_client_key(scoped, "pool")
    keys = {handout_key(cluster(one)), handout_key(cluster(scoped)), handout_key(cluster(None)),
            handout_key(cluster(None, run="other"))}
    assert len(keys) == 4 and handout_key(cluster(scoped)) == handout_key(cluster(scoped))


def test_squat_a_handout_binds_the_spec_and_its_rollout():
    h = Handouts(b"k" * 32)
    spec = TrajectorySpec("e0-p3/1~a2", "3", "e0-p3", 1, 4, np.array([5, 6, 7], np.int32), "42", 64)
    signed = h.sign(spec, "r1")
    assert h.refusal(signed, "r1") == ""
    changed = {"rollout": (signed, "r0"), "unsigned": (spec, "r1"),
               "group_size": (dataclasses.replace(signed, group_size=1), "r1"),
               "sample": (dataclasses.replace(signed, sample_index=0), "r1"),
               "attempt": (dataclasses.replace(signed, trajectory_id="e0-p3/1"), "r1"),
               "prompt": (dataclasses.replace(signed, prompt_tokens=np.array([5, 6, 8], np.int32)), "r1"),
               "budget": (dataclasses.replace(signed, max_tokens=4096), "r1"),
               "answer": (dataclasses.replace(signed, answer="7"), "r1"),
               "other key": (Handouts(b"x" * 32).sign(spec, "r1"), "r1")}
    assert {k: h.refusal(s, r).startswith("not handed out") for k, (s, r) in changed.items()} == \
        dict.fromkeys(changed, True)
