"""Live experiment tracking: each version's metrics, each evaluation and the sample rows go to W&B
and MLflow as they happen, not only at the end of the run (laminar/tracking.py's `tracking:`
section; `live: false` keeps the end-of-run send alone).

Where: the node that runs the trainer (`laminar-node up`/`start` on the trainer's host,
laminar/node.py). It already follows `metrics.trainer` and `metrics.evaluator` on the bus for its
live view, and it reads the run's `samples.jsonl` in the workdir it shares with the trainer. So the
trainer process never imports a tracker library nor waits on one (a tracker cannot stall or crash
a training step), a trainer that restarts from a checkpoint does not open a second tracker run,
and the end-of-run send, which lives there too, completes the same run: it adds the versions the
bus dropped (pub/sub may drop under load; the trainer's metrics.jsonl is the durable record), the
summary's numbers and the last sample rows, then closes it. A node without the trainer, or
`live: false`, sends the whole run at the end as before (`python -m laminar.tracking CONFIG` sends
a copy of a finished run to any tracker).

The sender: one background thread per tracker, each behind a bounded queue (`queue_size`
updates). `submit` never blocks and never raises: a tracker that is slow, hangs or is down fills
its queue, and what does not fit is dropped and counted; an update the library raised on is
counted as failed (the first error is kept). `close` waits at most `close_timeout_s` per tracker,
then leaves its thread behind (a daemon thread: it does not keep the process alive) and says so.
The counts are shown on the live view and printed when `up` ends.

Identity: `<workdir>/tracking.json` keeps the W&B run id and the MLflow run id (and where they
went); a node that starts again on the same workdir (`--resume`, the default) continues those
runs (W&B `resume="allow"` with the same id: its offline folders then share one run id and `wandb
sync` merges them; MLflow: the same run, set RUNNING again), and `--fresh`, which moves the
workdir aside, starts new ones.

What each tracker gets: W&B logs `trainer/<key>` and `eval/<...>` with `version` as their x-axis
(`define_metric`, so a version sent late or again after a resume still lands at its version), and
each batch of sample rows as a `samples` table; MLflow logs the same metrics at step = version
(`@` spelled `_at_`) and each batch of rows as an artifact `samples/<version>-<n>.json`.
"""
from __future__ import annotations

import json
import os
import queue
import threading
import time
import uuid
from pathlib import Path

from laminar.extras import require
from laminar.tracking import SAMPLE_COLUMNS, _flat, _mlflow_key, _num, steps, summary_numbers

STATE_FILE = "tracking.json"
FLUSH_S = 2.0   # W&B: seconds between writes of the offline run file


class StateFile:
    """<workdir>/tracking.json: the run ids of the trackers, written whole (thread-safe)."""

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / STATE_FILE
        self.lock = threading.Lock()
        try:
            self.data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            self.data = {}

    def get(self, name: str) -> dict:
        with self.lock:
            return dict(self.data.get(name) or {})

    def put(self, name: str, value: dict) -> None:
        with self.lock:
            self.data[name] = value
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(f".{STATE_FILE}.{os.getpid()}")
            tmp.write_text(json.dumps(self.data, indent=2) + "\n")
            os.replace(tmp, self.path)


class WandbRun:
    """One W&B run, opened (or continued) in the sender's thread."""
    name = "wandb"

    def __init__(self, spec, run_dir: Path, name: str, config: dict):
        self.spec, self.run_dir, self.run_name, self.config = spec, run_dir, name, config
        self.run = None

    def open(self, state: dict) -> dict:
        wandb = require("wandb", "tracking.wandb")
        run_id = state.get("id") or uuid.uuid4().hex[:12]   # W&B run ids: lower-case letters and digits
        w = self.spec
        # console off: the node's terminal is the live view's; the offline run file is flushed every
        # FLUSH_S seconds (wandb's default, 15 s, leaves a reader of a running run that far behind)
        settings = wandb.Settings(console="off", x_transaction_log_flush_interval=FLUSH_S)
        self.run = wandb.init(project=w.project, entity=w.entity, name=w.name or self.run_name, id=run_id,
                              resume="allow", dir=str(Path(w.dir or self.run_dir)), mode=w.mode, config=self.config,
                              reinit="create_new", settings=settings)
        for prefix in ("trainer/*", "eval/*"):
            self.run.define_metric(prefix, step_metric="version")
        return {"id": run_id, "project": w.project, "dir": self.run.dir}

    def log(self, version: int, values: dict) -> None:
        self.run.log({**values, "version": version})

    def rows(self, version: int, rows: list) -> None:
        wandb = require("wandb", "tracking.wandb")
        self.run.log({"samples": wandb.Table(columns=SAMPLE_COLUMNS, data=rows), "version": version})

    def summary(self, numbers: dict) -> None:
        self.run.summary.update(numbers)

    def finish(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None


class MlflowRun:
    """One MLflow run, opened (or continued) in the sender's thread."""
    name = "mlflow"

    def __init__(self, spec, run_dir: Path, name: str, config: dict):
        self.spec, self.run_dir, self.run_name, self.config = spec, run_dir, name, config
        self.client, self.run_id, self.batches = None, None, 0

    def open(self, state: dict) -> dict:
        require("mlflow", "tracking.mlflow")
        from mlflow.entities import Param  # late: the tracking extra, only when MLflow is configured
        from mlflow.tracking import MlflowClient
        uri = self.spec.tracking_uri or f"file:{(self.run_dir / 'mlruns').resolve()}"
        if uri.startswith("file:"):  # MLflow 3.17+ refuses its file store unless asked for it
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(tracking_uri=uri)
        if state.get("run_id") and state.get("tracking_uri") == uri:
            self.run_id = state["run_id"]
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            exp_name = self.spec.experiment or self.run_name
            exp = self.client.get_experiment_by_name(exp_name)
            exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(exp_name)
            self.run_id = self.client.create_run(exp_id, run_name=self.spec.run_name or self.run_name).info.run_id
            params = [Param(k, str(v)[:500]) for k, v in _flat(self.config).items()][:100]
            if params:
                self.client.log_batch(self.run_id, params=params)
        return {"run_id": self.run_id, "tracking_uri": uri}

    def log(self, version: int, values: dict) -> None:
        from mlflow.entities import Metric  # late: the tracking extra, only when MLflow is configured
        ts = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(_mlflow_key(k), float(v), ts, version)
                                                    for k, v in values.items()])

    def rows(self, version: int, rows: list) -> None:
        self.batches += 1
        self.client.log_dict(self.run_id, {"columns": SAMPLE_COLUMNS, "data": rows},
                             f"samples/v{version:06d}-{os.getpid()}-{self.batches}.json")

    def summary(self, numbers: dict) -> None:
        from mlflow.entities import Metric  # late: the tracking extra, only when MLflow is configured
        ts = int(time.time() * 1000)
        metrics = [Metric(_mlflow_key(f"summary/{k}"), v, ts, 0) for k, v in numbers.items()]
        for i in range(0, len(metrics), 1000):
            self.client.log_batch(self.run_id, metrics=metrics[i:i + 1000])

    def finish(self) -> None:
        if self.client is not None and self.run_id is not None:
            self.client.set_terminated(self.run_id)


class Sender:
    """One tracker's thread and bounded queue: submit never blocks; drops and failures counted."""

    def __init__(self, tracker, state: StateFile, queue_size: int = 1000):
        self.tracker, self.state = tracker, state
        self.queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self.sent = self.dropped = self.failed = 0
        self.error: str | None = None
        self.opened = threading.Event()
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._work, name=f"tracking-{tracker.name}", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def submit(self, kind: str, *args) -> bool:
        """Queue one update (log, rows, summary, finish); False when it was dropped."""
        try:
            self.queue.put_nowait((kind, args))
            return True
        except queue.Full:
            self.dropped += 1
            return False

    def _work(self) -> None:
        try:
            self.state.put(self.tracker.name, self.tracker.open(self.state.get(self.tracker.name)))
            self.opened.set()
        except Exception as exc:  # noqa: BLE001 - a tracker that cannot open: count what it misses
            self._failed(exc)
        while True:
            kind, args = self.queue.get()
            if kind == "stop":
                break
            if not self.opened.is_set():
                self.failed += 1
                continue
            try:
                getattr(self.tracker, kind)(*args)
                self.sent += kind != "finish"
            except Exception as exc:  # noqa: BLE001 - a tracker's error never reaches training
                self._failed(exc)
        self.done.set()

    def _failed(self, exc: BaseException) -> None:
        self.failed += 1
        if self.error is None:
            self.error = f"{type(exc).__name__}: {exc}"[:300]

    def close(self, timeout_s: float) -> bool:
        """Stop after what is queued (waiting at most timeout_s); False: the thread is left behind."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                self.queue.put_nowait(("stop", ()))
                break
            except queue.Full:
                time.sleep(0.05)
        return self.done.wait(max(0.0, deadline - time.monotonic()))

    def status(self) -> str:
        s = f"{self.tracker.name}: {self.sent} sent"
        if self.dropped:
            s += f", {self.dropped} dropped (queue full: the tracker is slow or down)"
        if self.failed:
            s += f", {self.failed} failed ({self.error})"
        return s


class LiveTracking:
    """The node's live sender: Metrics events and new sample rows in, one Sender per tracker."""

    def __init__(self, spec, run_dir: str | Path, name: str, config: dict | None = None, queue_size: int = 1000,
                 close_timeout_s: float = 30.0):
        self.run_dir, self.close_timeout_s = Path(run_dir), close_timeout_s
        state = StateFile(self.run_dir)
        made = [cls(s, self.run_dir, name, config or {}) for cls, s in ((WandbRun, spec.wandb),
                                                                       (MlflowRun, spec.mlflow)) if s is not None]
        self.senders = [Sender(t, state, queue_size) for t in made]
        self.versions: set[tuple[str, int]] = set()    # (source, version) submitted
        samples = self.run_dir / "samples.jsonl"
        self.samples_at = samples.stat().st_size if samples.exists() else 0   # earlier rows went before

    def start(self) -> None:
        for s in self.senders:
            s.start()

    def _submit(self, kind: str, *args) -> None:
        for s in self.senders:
            s.submit(kind, *args)

    def observe(self, ev) -> None:
        """A bus event: a trainer's version or an evaluation becomes one update to every tracker."""
        if getattr(ev, "role", None) not in ("trainer", "evaluator") or not isinstance(getattr(ev, "values", None),
                                                                                       dict):
            return
        v = ev.values.get("version")
        if not _num(v):
            return
        if ev.role == "trainer":
            values = {f"trainer/{k}": float(x) for k, x in ev.values.items() if _num(x) and k != "version"}
        else:
            values = {k: float(x) for k, x in ev.values.items() if _num(x) and k.startswith("eval/")}
        self.versions.add((ev.role, int(v)))
        self._submit("log", int(v), values)

    def poll_samples(self) -> int:
        """Send the rows appended to samples.jsonl since the last call (grouped by version); how many."""
        path = self.run_dir / "samples.jsonl"
        try:
            with open(path, "rb") as f:
                f.seek(self.samples_at)
                data = f.read()
        except OSError:
            return 0
        whole = data[:data.rfind(b"\n") + 1]   # a row still being written waits for the next call
        self.samples_at += len(whole)
        by_version: dict[int, list] = {}
        for line in whole.splitlines():
            try:
                r = json.loads(line)
            except ValueError:
                continue
            by_version.setdefault(int(r.get("version", 0)), []).append([r.get(c) for c in SAMPLE_COLUMNS])
        for v, rows in sorted(by_version.items()):
            self._submit("rows", v, rows)
        return sum(len(r) for r in by_version.values())

    def finish(self, summary: dict | None = None) -> list[str]:
        """The end of the run: versions the bus dropped (from the durable records), the summary's
        numbers, the last rows; then each tracker's run is closed. Returns one status line each."""
        self.poll_samples()
        for v, values in steps(self.run_dir).items():
            trainer = {k: x for k, x in values.items() if k.startswith("trainer/")}
            evals = {k: x for k, x in values.items() if k.startswith("eval/")}
            if trainer and ("trainer", v) not in self.versions:
                self._submit("log", v, trainer)
            if evals and ("evaluator", v) not in self.versions:
                self._submit("log", v, evals)
        if summary:
            self._submit("summary", summary_numbers(summary))
        self._submit("finish")
        return self.close()

    def close(self) -> list[str]:
        out = []
        for s in self.senders:
            left = "" if s.close(self.close_timeout_s) else \
                f"; still busy after {self.close_timeout_s:g} s: left behind (the tracker hangs)"
            out.append(s.status() + left)
        return out

    def problems(self) -> str:
        """A short line for the live view when a tracker drops or fails updates ('' when all is well)."""
        bad = [f"{s.tracker.name} {s.dropped} dropped" + (f", {s.failed} failed" if s.failed else "")
               for s in self.senders if s.dropped or s.failed]
        return "tracking: " + "; ".join(bad) if bad else ""

