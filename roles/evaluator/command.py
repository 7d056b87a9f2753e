"""`laminar-node eval MODEL --sets CONFIG`: weights evaluated on a config's eval sets outside a run,
with the evaluator role's own harness (roles/evaluator/harness.py, beside this command: its vLLM
engine settings, greedy, avg@k, pass@k, maj@k, its seeds), so the numbers are the ones the role
reports for the same weights and version. `laminar-node` (laminar/cli.py) dispatches to `run`.

MODEL is one of:
- a Hugging Face folder (config.json and weights): an export (`laminar-node export`), the
  evaluator's `best/`, any model folder;
- a relay's shared-memory folder: its newest complete version, loaded into an engine started on
  the evaluator's `model_dir` (the base), exactly as the evaluator loads it (LoRA adapters too);
- a trainer checkpoint (or its folder of checkpoints: the newest): written first as a Hugging
  Face folder in a temporary directory (laminar/export.py), on the evaluator's `model_dir`.

Settings: the config's evaluator (`--evaluator ID`; default the first one placed, else the
`roles.evaluator` section): its `sets` (or `dataset`), reward, answer extractor, max_tokens, seed
and engine settings; the engine's threads are bound to the placement's `cores:` as in the role.
`--set` overrides values of the config as on every command.

Version: the sampled answers are seeded by the version (as in the role), so the version number
matters: by default the one MODEL records (the relay manifest's, the checkpoint's, an export's
`laminar_version.json`; 0 for a folder that records none); `--version N` sets it.

Seals: when the config's cluster has keys (`cluster.keys_dir`), a relay version is evaluated only
if its seals verify against the trainer's public key (`weights.key`; laminar/weights/seal.py's
check, through laminar/weights/pull.py): one that does not is refused (exit 2) before any engine
starts, and the engine's workers check it again as they load it.

Progress: a line on stderr per set every 30 s and when the set is done (answers so far, rate).

Output: a table (set, metric, value, its 95% interval, problems) and a JSON file (`--out`, default
`eval-<model folder name>-v<version>.json`): {model, kind, version, lineage, config, evaluator,
sets: {set: {problems, metrics: {metric: {value, lo, hi}}}}, values: the role's flat values,
scores: {set: {metric: [score per problem]}}, prompt_ids: {set: [id]}}.

Before and after: `--compare BEFORE.json` (an earlier document of this command, e.g. the warm
start's) adds each set's and metric's after − before on the same problems with the paired 95%
interval (roles/evaluator/compare.py), as a second table and as `after_minus_before` (and
`unpaired`) in the JSON.
Exit codes: 0 done, 2 a usage or config error or a refused version.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

from laminar import checkpoint_files
from laminar.config import UsageError, load_config
from laminar.export import export


def add_arguments(s: argparse.ArgumentParser) -> None:
    s.add_argument("model", help="a Hugging Face folder, a relay's shared-memory folder, or a trainer checkpoint "
                   "(or its folder of checkpoints)")
    s.add_argument("--sets", required=True, metavar="CONFIG", help="the run config whose evaluator's eval sets, "
                   "reward and engine settings are used")
    s.add_argument("--evaluator", default=None, metavar="ID", help="which evaluator of the config (default: the "
                   "first placed, else the roles.evaluator section)")
    s.add_argument("--version", type=int, default=None, help="the version number that seeds the sampled answers "
                   "(default: the one MODEL records, else 0)")
    s.add_argument("--model-dir", default=None, help="the base model folder of a relay version or a checkpoint "
                   "(default: the evaluator's model_dir)")
    s.add_argument("--out", default=None, help="the JSON file to write (default: eval-<name>-v<version>.json)")
    s.add_argument("--compare", default=None, metavar="BEFORE_JSON", help="an earlier JSON of this command on the "
                   "same sets: after - before per set and metric, with the paired 95%% interval over problems")


def kind_of(model: Path) -> str:
    """'relay', 'hf' or 'checkpoint' (UsageError when MODEL is none of them)."""
    if (model / "current").exists():
        return "relay"
    if (model / "config.json").is_file():
        return "hf"
    if (model / "adapter_config.json").is_file():
        raise UsageError(f"{model}: a LoRA adapter folder: evaluate the relay version, or export it with --merge")
    if model.is_dir():
        ck = checkpoint_files
        if (model / "model.pt").exists() or (model / ck.DCP_DIR).is_dir() or ck.latest(model):
            return "checkpoint"
    raise UsageError(f"{model}: neither a Hugging Face folder (config.json), a relay folder (current) nor a "
                     "trainer checkpoint")


def evaluator_settings(cfg, ident: str | None):
    """The evaluator's validated settings (an instance's options included)."""
    placed = [s.id for _, s in cfg.find("evaluator")]
    if ident is not None and ident not in placed:
        raise UsageError(f"{cfg.source}: no evaluator {ident!r} placed (placed: {placed or 'none'})")
    settings = cfg.settings_of("evaluator", ident or (placed[0] if placed else "0"))
    if not settings.sets and settings.dataset is None:
        raise UsageError(f"{cfg.source}: roles.evaluator: no eval sets (set `dataset` or `sets`)")
    return settings


def placed_cores(cfg, ident: str | None):
    """The cores the config places the evaluator on (`cores:` of its placement; None: not placed
    or no cores): its engine's OpenMP threads are bound to them as in the role, so a command on a
    2-core machine computes with both (vLLM's own binding leaves one core for its engine process)."""
    found = [s for _, s in cfg.find("evaluator") if ident is None or s.id == ident]
    return found[0].cores if found else None


def seal_keys(cfg):
    """The trainer's public signing key, as the keys seal.py reads it from, when the cluster has
    keys (None: no keys, nothing checked)."""
    d = cfg.cluster.keys_dir
    if not d:
        return None
    # late: cli.py imports this module to build its parser; this is for a run of the command
    from laminar.bus.auth import load_weights_key

    from laminar.weights.seal import verifier_of
    if not Path(d).is_dir():
        raise FileNotFoundError(f"{cfg.source}: cluster.keys_dir {d} does not exist: relay versions cannot be "
                                "checked against the trainer's key")
    keys = SimpleNamespace(weights_public=load_weights_key(d, secret=False)[0], public_dir=d)
    verifier_of(keys)   # a cluster with keys must have the trainer's public key: it says so
    return keys


def check_relay(model: Path, key: bytes):
    """The relay's newest manifest, after its seals verified (with a key); UsageError: refused."""
    # late: cli.py imports this module to build its parser; this is for a run of the command
    from laminar.weights.pull import LocalWeights, WeightsRefused
    weights = LocalWeights(model, verify_key=key)
    try:
        held = weights.latest()
    except WeightsRefused as exc:
        raise UsageError(f"refused: {exc}") from None
    if held is None:
        raise UsageError(f"{model}: the relay folder holds no complete version")
    with held:
        return held.manifest


def recorded_version(folder: Path) -> int | None:
    try:
        return int(json.loads((folder / "laminar_version.json").read_text())["version"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


async def evaluate(model: Path, kind: str, settings, base: str, version: int | None, keys, tmp: Path,
                   cores=None) -> dict:
    """Start the engine on MODEL's weights, run the harness; {values, version}."""
    from laminar.roles.evaluator.harness import Harness, load_sets, make_engine  # late: cli.py's parser imports
    # this module for its arguments; the harness's datasets and engine are for a model being evaluated
    sets = await asyncio.to_thread(load_sets, settings)
    if kind == "checkpoint":
        model = await asyncio.to_thread(export, model, tmp / "model", base)
        kind = "hf"
    # late: cli.py imports this module to build its parser; this is for a run of the command
    from laminar.weights.seal import arm_engine_checks
    engine = make_engine(settings, model_dir=str(model) if kind == "hf" else base,
                         omp_threads_bind=settings.omp_bind(cores))
    arm_engine_checks(keys)   # with keys, the engine's workers check the seals again as they load
    await engine.start()
    try:
        if kind == "relay":
            got = await engine.load_relay(str(model), -1)
            if got < 0:
                raise UsageError(f"{model}: the engine could not load the relay's version")
            version = got if version is None else version
        elif version is None:
            version = recorded_version(model) or 0
        result = await Harness(engine, sets, settings, progress=print_progress).evaluate(version)
    finally:
        await engine.close()
    return {"values": result.values, "version": version, "scores": result.scores, "prompt_ids": result.prompt_ids}


def print_progress(name: str, answered: int, total: int, seconds: float) -> None:
    """One line on stderr as a set's answers come in (the harness's progress callback)."""
    rate = answered / seconds if seconds > 0 else 0.0
    print(f"eval {name}: {answered}/{total} answers in {seconds:.0f} s ({rate:.1f}/s)", file=sys.stderr, flush=True)


def by_set(values: dict[str, float]) -> dict:
    """{set: {problems, metrics: {metric: {value, lo, hi}}}} from the harness's flat values."""
    out: dict = {}
    for k, v in values.items():
        parts = k.split("/")
        if len(parts) != 3 or parts[0] != "eval":
            continue
        _, name, metric = parts
        entry = out.setdefault(name, {"problems": 0, "metrics": {}})
        if metric == "problems":
            entry["problems"] = int(v)
        elif metric != "response_len_mean":
            entry["metrics"][metric] = {"value": v, "lo": values.get(f"{k}/lo"), "hi": values.get(f"{k}/hi")}
    return out


def table(sets: dict) -> str:
    rows = [("set", "metric", "value", "95% interval", "problems")]
    for name, s in sets.items():
        for m, x in s["metrics"].items():
            ci = f"[{x['lo']:.3f}, {x['hi']:.3f}]" if x["lo"] is not None else "-"
            rows.append((name, m, f"{x['value']:.3f}", ci, str(s["problems"])))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows)


def run(a) -> int:
    cfg = load_config(a.sets, a.set)
    settings = evaluator_settings(cfg, a.evaluator)
    model = Path(a.model)
    kind = kind_of(model)
    base = a.model_dir or settings.model_dir
    keys = seal_keys(cfg)
    key = keys.weights_public if keys is not None else b""
    lineage = check_relay(model, key).lineage if kind == "relay" else None   # refused before any engine starts
    before = None
    if a.compare:
        from laminar.roles.evaluator.compare import read_doc  # late: numpy, with --compare only
        try:
            before = read_doc(a.compare)
        except (OSError, ValueError) as exc:
            raise UsageError(f"--compare: {exc}") from None
    if kind != "hf" and not (Path(base) / "config.json").is_file():
        raise UsageError(f"{base}: not a model folder (the base of a {kind}): pass --model-dir")
    # late: cli.py imports this module to build its parser; this is for a run of the command
    from laminar.node import run as run_loop
    with tempfile.TemporaryDirectory(prefix="laminar-eval-") as tmp:
        got: dict = {}

        async def main() -> int:
            got.update(await evaluate(model, kind, settings, base, a.version, keys, Path(tmp),
                                      cores=placed_cores(cfg, a.evaluator)))
            return 0
        run_loop(main())
    sets = by_set(got["values"])
    out = Path(a.out or f"eval-{model.resolve().name}-v{got['version']}.json")
    doc = {"model": str(model.resolve()), "kind": kind, "version": got["version"], "lineage": lineage,
           "config": a.sets, "evaluator": a.evaluator, "sets": sets, "values": got["values"],
           "scores": got["scores"], "prompt_ids": got["prompt_ids"]}
    print(f"{model} ({kind}) as version {got['version']} on the eval sets of {a.sets}:")
    print(table(sets))
    if before is not None:
        from laminar.roles.evaluator import compare as eval_compare  # late: numpy, with --compare only
        doc["after_minus_before"], doc["unpaired"] = eval_compare.paired(before, doc)
        doc["compared_with"] = a.compare
        print(f"after - before ({a.compare}: {before.get('model')} as version {before.get('version')}; "
              "paired 95% interval over problems, * excludes 0):")
        print(eval_compare.table(doc["after_minus_before"]))
        for line in doc["unpaired"]:
            print(f"unpaired: {line}")
    out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"written: {out}", file=sys.stderr)
    return 0
