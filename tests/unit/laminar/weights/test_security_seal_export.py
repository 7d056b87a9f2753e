"""What is evaluated and exported is what the trainer sealed.

Before: rollouts checked each version's seals, but the evaluator's engine workers did not (the
evaluator never armed them) and `laminar-node export` read a relay folder without looking at
seals at all: a byte flipped in /dev/shm was evaluated, kept as "best" and exported as the model.

Now the evaluator arms its engine's workers with the trainer's public key as the rollout does,
and an export from a relay folder checks the version's seals against its bytes: always their
digests (a changed byte is refused with or without keys), and their signature with the cluster's
public weights key (`--keys DIR`, or the key an evaluator armed).
"""
from __future__ import annotations

import asyncio
import json
import os
import shutil
import uuid

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from laminar.bus.auth import generate_keys, load_keys  # noqa: E402
from laminar.bus.inproc import InprocHub  # noqa: E402
from laminar.roles.evaluator.role import EvaluatorRole  # noqa: E402

from laminar.export import export  # noqa: E402
from laminar.models.tiny import build_tiny_model  # noqa: E402
from laminar.role_base import RoleContext  # noqa: E402
from laminar.weights import seal  # noqa: E402
from laminar.weights.local_write import write_version  # noqa: E402
from laminar.weights.pull import WeightsRefused  # noqa: E402
from laminar.weights.store import ShmStore  # noqa: E402

pytestmark = pytest.mark.timeout(120)
VERIFY_ENV = "LAMINAR_WEIGHTS_VERIFY_KEY"


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("seal-export") / "base", seed=0)


@pytest.fixture
def keys(tmp_path):
    generate_keys(tmp_path / "keys")
    return tmp_path / "keys"


@pytest.fixture
def relay(base, keys):
    """A relay folder holding version 3 of the base's weights, sealed by the cluster's trainer key."""
    import transformers
    sd = transformers.AutoModelForCausalLM.from_pretrained(base, local_files_only=True).state_dict()
    signer = seal.signer_of(load_keys(keys, "trainer"))
    store = ShmStore(f"/dev/shm/laminar-unit-sealx-{uuid.uuid4().hex[:10]}")
    store.open()
    write_version(store, sd, 3, chunk_bytes=64 << 10, signer=signer)
    yield store
    store.close()
    shutil.rmtree(store.dir, ignore_errors=True)


def flip_a_byte(store: ShmStore) -> None:
    cur = store.current
    with open(store.slot_path(cur.slot), "r+b") as f:
        f.seek(cur.manifest.offsets[1] + 5)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x40]))


def test_seal_export_an_intact_version_exports_and_names_it(relay, base, keys, tmp_path):
    public = load_keys(keys).weights_public
    out = export(relay.dir, tmp_path / "hf", base, dtype="same", verify_key=public)
    assert json.loads((out / "laminar_version.json").read_text())["version"] == 3


def test_seal_export_a_byte_changed_in_shared_memory_is_never_exported(relay, base, keys, tmp_path, monkeypatch):
    monkeypatch.setenv(VERIFY_ENV, "")  # recorded, so whatever the code under test sets is undone
    flip_a_byte(relay)
    public = load_keys(keys).weights_public
    with pytest.raises(WeightsRefused, match="not the bytes the trainer sealed"):
        export(relay.dir, tmp_path / "hf", base, verify_key=public)
    with pytest.raises(WeightsRefused):  # no key at hand: the seals' digests still catch it
        export(relay.dir, tmp_path / "hf2", base)
    assert not (tmp_path / "hf").exists() and not (tmp_path / "hf2").exists()


def test_seal_export_the_cli_checks_seals_with_the_cluster_keys(relay, base, keys, tmp_path, capsys):
    from laminar.cli import main as node_main
    other = tmp_path / "other-keys"
    generate_keys(other)  # another cluster's weights key: the signature is not its trainer's
    args = ["export", str(relay.dir), str(tmp_path / "hf"), "--model-dir", str(base)]
    assert node_main([*args, "--keys", str(other)]) == 2
    assert "refused" in capsys.readouterr().err
    assert node_main([*args, "--keys", str(keys)]) == 0


class StubEngine:
    """The evaluator's engine, as far as arming goes: what its worker processes would inherit."""

    def __init__(self, *a, **k):
        self.armed = None

    @classmethod
    def from_settings(cls, *a, **k) -> StubEngine:
        return cls()

    async def start(self) -> None:
        self.armed = os.environ.get(VERIFY_ENV)

    async def close(self) -> None:
        pass


def test_seal_export_the_evaluator_arms_its_engine_workers(relay, keys, tmp_path, monkeypatch):
    monkeypatch.setenv(VERIFY_ENV, "")  # recorded, so whatever the code under test sets is undone
    monkeypatch.setattr("laminar.roles.evaluator.role.make_engine", StubEngine)   # the harness makes it
    heldout = tmp_path / "heldout.jsonl"
    heldout.write_text('{"id": "q0", "prompt": "1+1?", "answer": "2"}\n')
    transport = InprocHub().transport()
    transport.keys = load_keys(keys, "evaluator")

    async def main():
        role = EvaluatorRole(RoleContext(role="evaluator", id="0", host="h0", transport=transport, settings={
            "dataset": str(heldout), "shm_dir": str(relay.dir), "samples": 0}))
        role.ctx.settings["out_dir"] = str(tmp_path / "out")
        await role.setup()
        armed = role.engine.armed
        await role.stop()
        return armed
    assert asyncio.run(main()) == load_keys(keys).weights_public.hex()
