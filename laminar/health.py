"""Node health: what every role on a node is doing, as Prometheus metrics and as `status` rows.

Sources (docs/architecture.md §3, §13). The supervisor's child states say whether a role's process runs here
(ready, backoff, finished...); the bus says what the role itself reports: heartbeats (`hb.*`: state,
status, dropped bad frames), `rollout.stats.*` (version, KV usage, tokens/s), `relay.progress.*`
(chunks of the version arriving), `metrics.trainer` (tokens/s, staleness, train-inference
mismatch), `metrics.evaluator` (held-out accuracy). Pub/sub carries only
superseding state, so the collector keeps the newest fact of each kind per role; nothing is summed.

Scope. `laminar-node up/start` runs one collector per node: its exposition, /healthz and snapshot
cover only the roles placed on its host, so each series comes from exactly one node (scrape every
node; nothing is counted twice). It still keeps what it hears of the other roles (`others`: the
trainer's versions on a rollout host, say) for the node's live view (laminar/live.py), which
reads this collector rather than keeping a copy of its own; `listeners` hear every event a role
reported, after the collector took it in. `laminar-node status` runs one over the whole cluster
for a short listen on the bus.

Exposition is hand-written (text format 0.0.4: HELP and TYPE lines, then samples). The collector
holds snapshots, not instrumented counters, so prometheus_client would need a custom collector
anyway; the format is a few lines, and writing it keeps the package's dependencies unchanged.

The HTTP server is `asyncio.start_server` on the event loop of `up`: GET /metrics and /healthz,
nothing else. Bounds: request line + headers at most `max_request` bytes, a deadline per
connection, at most `max_connections` connections at once, one request per connection. When all
slots are taken, a new connection takes the slot of the oldest one that has not yet sent its
request (so silent clients cannot starve a scrape, which sends its request at once); only when
every slot is busy answering is the new one closed unanswered.

Exposure: it listens on `metrics_bind` of the host, by default the host's `bind` when that names
one interface, else its cluster `address` (never every interface unless configured). /metrics
may require `Authorization: Bearer <token>` (the host's `metrics_token_file`, a 0600 file);
/healthz stays open, since it tells only which roles are up.
"""
from __future__ import annotations

import asyncio
import collections
import hmac
import json
import math
import os
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from laminar.health_facts import (
    DOWN_ON_PURPOSE,
    EVAL_FACTS,
    FAMILIES,
    GAVE_UP_ALARM_S,
    HB_FACTS,
    REFUSED_ALARM_S,
    SUPERVISOR_STATES,
    TRAINER_FACTS,
)
from laminar.protocol import Heartbeat, Metrics, RelayProgress, RolloutStats

log = structlog.get_logger("laminar.health")

@dataclass
class RoleHealth:
    role: str
    id: str
    host: str
    supervised: str | None = None   # the supervisor's child state; None where no supervisor reports
    restarts: int = 0
    pid: int | None = None          # the supervisor's child process
    beat: Heartbeat | None = None
    beat_at: float | None = None    # clock() when the newest heartbeat arrived
    state: str = ""                 # what the role says it is doing (rollout: generating, idle...)
    values: dict[str, float] = field(default_factory=dict)
    sets: dict[str, float] = field(default_factory=dict)  # evaluator: eval/<set>/<metric> of the last evaluation

    @property
    def key(self) -> str:
        return f"{self.role}.{self.id}"


def _number(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return v


class HealthCollector:
    """The newest facts about each role. `placed` maps role key -> host; with `only_placed` events
    of any other role are ignored (a node's exporter), else they are added as they appear."""

    def __init__(self, run: str, host: str, placed: dict[str, str], dead_after_s: float, only_placed: bool = True,
                 dropped: Callable[[], int] = lambda: 0, clock: Callable[[], float] = time.monotonic):
        self.run, self.host, self.dead_after_s = run, host, dead_after_s
        self.only_placed, self.dropped, self.clock = only_placed, dropped, clock
        self.roles: dict[str, RoleHealth] = {}
        for key, h in placed.items():
            role, _, id = key.partition(".")
            self.roles[key] = RoleHealth(role, id, h)
        self.others: dict[str, RoleHealth] = {}   # roles of other hosts (only_placed): for the live view only
        self.listeners: list[Callable[[RoleHealth, Any], None]] = []  # called after each event a role reported
        self._last_update: dict[str, float] = {}   # trainer key -> ts of its previous Metrics

    @classmethod
    def for_node(cls, cfg, host: str, **kw) -> HealthCollector:
        return cls(cfg.run.name, host, {s.key: host for s in cfg.cluster.hosts[host].roles},
                   cfg.cluster.dead_after_s, only_placed=True, **kw)

    def _role(self, role: str, id: str, host: str = "") -> RoleHealth:
        key = f"{role}.{id}"
        r = self.roles.get(key) or self.others.get(key)
        if r is None:
            where = self.others if self.only_placed else self.roles
            r = where[key] = RoleHealth(role, id, host or "?")
        elif host and r.host == "?":
            r.host = host
        return r

    def every_role(self) -> dict[str, RoleHealth]:
        """Every role heard of or placed, this node's and the others (what the live view shows)."""
        return {**self.others, **self.roles}

    # -- feeding ---------------------------------------------------------------------------
    def child_changed(self, c) -> None:
        r = self.roles.get(f"{c.role}.{c.id}")
        if r is not None:
            r.supervised, r.restarts, r.pid = c.state, c.restarts, c.pid

    def observe(self, ev: Any) -> None:
        """Take in one bus event (heartbeat, rollout stats, relay progress, metrics), then tell the
        listeners."""
        r = self._take(ev)
        if r is not None:
            for listener in self.listeners:
                listener(r, ev)

    def _take(self, ev: Any) -> RoleHealth | None:
        if isinstance(ev, Heartbeat):
            r = self._role(ev.role, ev.id, ev.host)
            r.beat, r.beat_at = ev, self.clock()
            for skey, name in HB_FACTS.get(ev.role, {}).items():
                if (v := _number(ev.status.get(skey))) is not None:
                    r.values[name] = v
            if ev.role == "relay" and (v := _number(ev.status.get("receiving"))) is not None:
                r.values["receiving"] = max(v, r.values.get("version", -1))
            if isinstance(ev.status.get("state"), str):
                r.state = ev.status["state"]
        elif isinstance(ev, RolloutStats):
            r = self._role("rollout", ev.rollout_id, ev.host)
            r.state = ev.state
            r.values.update(version=ev.version, kv_usage=ev.kv_usage, running=ev.running, waiting=ev.waiting,
                            active=ev.active, tokens_per_s=ev.tokens_per_s, generated_tokens=ev.generated_tokens,
                            batches=ev.batches)
        elif isinstance(ev, RelayProgress):
            r = self._role("relay", ev.relay_id)
            r.values.update(version=ev.complete_version, receiving=ev.version, chunks_have=ev.chunks_have,
                            chunks_total=ev.chunks_total, corrupt_chunks=ev.corrupt_chunks)
        elif isinstance(ev, Metrics) and ev.role == "trainer":
            r = self._role("trainer", ev.id)
            r.values.update({k: ev.values[k] for k in TRAINER_FACTS if _number(ev.values.get(k)) is not None})
            prev = self._last_update.get(r.key)
            if prev is not None and ev.ts > prev:   # prompt + response tokens of the batch / time between versions
                r.values["throughput"] = ev.values.get("batch_tokens", 0.0) / (ev.ts - prev)
            self._last_update[r.key] = ev.ts
        elif isinstance(ev, Metrics) and ev.role == "evaluator":
            r = self._role("evaluator", ev.id)
            r.values.update({name: ev.values[k] for k, name in EVAL_FACTS.items()
                             if _number(ev.values.get(k)) is not None})
            # per eval set and metric (eval/<set>/<metric>): laminar_eval_metric{set, metric}
            r.sets = {k: float(v) for k, v in ev.values.items()
                      if k.startswith("eval/") and k.count("/") == 2 and _number(v) is not None
                      and k.rsplit("/", 1)[1] not in ("problems", "response_len_mean")}
        else:
            return None
        return r

    # -- reading -----------------------------------------------------------------------------
    def up(self, r: RoleHealth, now: float | None = None) -> bool:
        """Running (where a supervisor reports), heard from within `dead_after_s` (from the
        process running now: a restarted role's last beat before it died does not count), and not
        saying it cannot serve (a pool whose store failed heartbeats `serving: false`)."""
        now = self.clock() if now is None else now
        fresh = r.beat_at is not None and now - r.beat_at <= self.dead_after_s
        serving = (r.beat.status or {}).get("serving", True) is not False if r.beat is not None else True
        return fresh and serving and r.supervised in (None, "ready") and r.pid in (None, r.beat.pid)

    def unhealthy(self) -> list[str]:
        """Roles of this node that should be up and are not (a finished role, or one an operator's
        Shutdown stopped, is fine)."""
        return sorted(k for k, r in self.roles.items() if r.supervised not in DOWN_ON_PURPOSE and not self.up(r))

    def alarms(self) -> list[str]:
        """Alarms raised by roles of this node that are up: a manager's `weights_stalled`; a partial
        pool's `reward_gave_up` while its newest give-up is younger than GAVE_UP_ALARM_S; an env
        role whose sandbox runs without a per-run cgroup (`cgroup: auto` found none); a partial pool
        holding parked trajectories (`reward_parked`); a pool that refused a write for want of a
        hand-out within REFUSED_ALARM_S (`writes_refused`, naming the key and its host)."""
        stalled = [f"weights_stalled ({k}: lag {int(r.values.get('weights_lag', 0))} versions)"
                   for k, r in self.roles.items() if r.values.get("weights_stalled") and self.up(r)]
        gave_up = [f"reward_gave_up ({k}: {int(r.values.get('gave_up', 0))} trajectories scored by the fallback, "
                   f"the newest {r.values['gave_up_age_s']:.0f} s ago)" for k, r in self.roles.items()
                   if 0 <= r.values.get("gave_up_age_s", -1) < GAVE_UP_ALARM_S and self.up(r)]
        no_cgroup = [f"sandbox_no_cgroup ({k}: {(r.beat.status or {}).get('sandbox_cgroup_reason', '?')})"
                     for k, r in self.roles.items()
                     if r.beat is not None and (r.beat.status or {}).get("sandbox_cgroup") == "none" and self.up(r)]
        parked = [f"reward_parked ({k}: {int(r.values['parked'])} scored trajectories the buffer refuses for good)"
                  for k, r in self.roles.items() if r.values.get("parked", 0) > 0 and self.up(r)]
        return sorted(stalled + gave_up + no_cgroup + parked + self._refused_alarms())

    def _refused_alarms(self) -> list[str]:
        """A pool's `writes_refused` while its newest refusal is younger than REFUSED_ALARM_S: a key
        wrote work it was never handed (a compromised host, or a misconfigured one), named with its host."""
        out = []
        for k, r in self.roles.items():
            if 0 <= r.values.get("writes_refused_age_s", -1) < REFUSED_ALARM_S and self.up(r):
                st = r.beat.status or {}
                out.append(f"writes_refused ({k}: {int(r.values.get('writes_refused', 0))} writes without a "
                           f"hand-out, the newest from {st.get('writes_refused_key', '?')} on host "
                           f"{st.get('writes_refused_host', '?')}, {r.values['writes_refused_age_s']:.0f} s ago)")
        return out

    def snapshot(self) -> dict[str, dict]:
        """Per role: liveness, the supervisor's view, the newest heartbeat and every fact (JSON-able)."""
        now, out = self.clock(), {}
        for key, r in sorted(self.roles.items()):
            hb = r.beat
            out[key] = {"up": self.up(r, now), "host": r.host, "supervised": r.supervised, "restarts": r.restarts,
                        "heartbeat_age_s": round(now - r.beat_at, 3) if r.beat_at is not None else None,
                        "state": hb.state if hb else None, "role_state": r.state or None,
                        "pid": hb.pid if hb else None, "uptime_s": hb.uptime_s if hb else None,
                        "dropped_frames": hb.dropped_frames if hb else None,
                        "status": hb.status if hb else {}, "metrics": dict(sorted(r.values.items()))}
        return out

    def exposition(self) -> str:
        """Every metric in the Prometheus text format (version 0.0.4)."""
        now = self.clock()
        out: list[str] = []

        def family(name: str, kind: str, help: str, samples: list[tuple[dict, float]]) -> None:
            if not samples:
                return
            out.append(f"# HELP {name} {help}")
            out.append(f"# TYPE {name} {kind}")
            out.extend(f"{name}{_labels(labels)} {_value(v)}" for labels, v in samples)

        roles = sorted(self.roles.values(), key=lambda r: r.key)
        lab = lambda r: {"role": r.role, "id": r.id, "host": r.host}  # noqa: E731
        family("laminar_node_info", "gauge", "this node's run and host", [({"run": self.run, "host": self.host}, 1)])
        family("laminar_node_dropped_frames_total", "counter", "bad frames the node's own bus subscriber dropped",
               [({"host": self.host}, self.dropped())])
        family("laminar_role_up", "gauge", "1 if the role runs and its heartbeat is younger than dead_after_s",
               [(lab(r), int(self.up(r, now))) for r in roles])
        family("laminar_role_state", "gauge", "the supervisor's state of the role's process (1 = current)",
               [({**lab(r), "state": s}, int(r.supervised == s)) for r in roles if r.supervised
                for s in SUPERVISOR_STATES])
        family("laminar_role_restarts_total", "counter", "restarts of the role's process by the supervisor",
               [(lab(r), r.restarts) for r in roles if r.supervised])
        family("laminar_role_heartbeat_age_seconds", "gauge", "seconds since the role's newest heartbeat",
               [(lab(r), now - r.beat_at) for r in roles if r.beat_at is not None])
        family("laminar_role_uptime_seconds", "gauge", "uptime the role reported in its newest heartbeat",
               [(lab(r), r.beat.uptime_s) for r in roles if r.beat])
        family("laminar_role_dropped_frames_total", "counter", "malformed, oversized, unknown or wrongly "
               "versioned frames the role dropped (since its start)",
               [(lab(r), r.beat.dropped_frames) for r in roles if r.beat])
        for name, kind, help, kinds, value in FAMILIES:
            with_role = len(kinds) > 1   # a series several kinds report: their ids may repeat (pool "0"s)
            family(name, kind, help, [(lab(r) if with_role else {"id": r.id, "host": r.host}, r.values[value])
                                      for r in roles if r.role in kinds and value in r.values])
        family("laminar_eval_metric", "gauge", "the last evaluation's result of one eval set and metric (greedy, "
               "avg@k, pass@k, maj@k)",
               [({"id": r.id, "host": r.host, "set": k.split("/")[1], "metric": k.split("/")[2]}, v)
                for r in roles if r.role == "evaluator" for k, v in sorted(r.sets.items())])
        family("laminar_alarm", "gauge", "1 per alarm raised now by a role of this node (its name and role; the "
               "text is /healthz's)",
               [({"alarm": a.split(" ", 1)[0], "role": a.split("(", 1)[1].split(":", 1)[0], "host": self.host}, 1)
                for a in self.alarms()])
        return "\n".join(out) + "\n"


def _labels(labels: dict[str, str]) -> str:
    esc = lambda s: str(s).replace("\\", r"\\").replace('"', r"\"").replace("\n", r"\n")  # noqa: E731
    return "{" + ",".join(f'{k}="{esc(v)}"' for k, v in labels.items()) + "}"


def _value(v: float) -> str:
    if isinstance(v, int):
        return str(v)
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(float(v))


def last_trainer_metrics(path: Path, n: int = 2, tail_bytes: int = 1 << 16) -> list[Metrics]:
    """The trainer's newest `n` records of metrics.jsonl as Metrics events (for `status`, which
    listens for a few seconds only and may see no version finish)."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, 2) - tail_bytes))
            lines = f.read().splitlines()[-n:]
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            continue  # the first line of the tail may be cut, the last one half written
        values = {k: v for k, v in rec.items() if _number(v) is not None}
        out.append(Metrics(role="trainer", id="0", ts=float(rec.get("ts", 0.0)), values=values))
    return out


# ---------------------------------------------------------------------------------------
def metrics_bind(host_spec) -> str:
    """Where a host's /metrics listens: `metrics_bind`, else `bind` unless that is a wildcard,
    else the cluster `address` the other hosts reach it by."""
    if getattr(host_spec, "metrics_bind", None):
        return host_spec.metrics_bind
    if host_spec.bind not in ("0.0.0.0", "::", "", "*"):
        return host_spec.bind
    return host_spec.address


def load_metrics_token(path: str) -> str:
    """The bearer token in `path`, which must be a private file of this user."""
    st = os.stat(path)
    if stat.S_IMODE(st.st_mode) & 0o077 or st.st_uid != os.geteuid():
        raise PermissionError(f"metrics token {path} must be owned by uid {os.geteuid()} and private: "
                              f"`chmod 600 {path}`")
    token = Path(path).read_text().strip()
    if len(token) < 8:
        raise ValueError(f"metrics token in {path} is shorter than 8 characters")
    return token


_REASONS = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 404: "Not Found", 405: "Method Not Allowed",
            431: "Request Header Fields Too Large", 500: "Internal Server Error", 503: "Service Unavailable"}


class MetricsServer:
    """GET /metrics (the exposition) and /healthz (200 when every role of the node is up and no alarm is raised
    (a manager's weights_stalled), else 503
    with the roles that are not) over plain HTTP/1.1, one request per connection."""

    def __init__(self, collector: HealthCollector, host: str, port: int, max_request: int = 8192,
                 deadline_s: float = 5.0, max_connections: int = 16, token: str | None = None):
        self.collector, self.host, self.port = collector, host, port
        self.max_request, self.deadline_s, self.max_connections = max_request, deadline_s, max_connections
        self.token = token
        self._server: asyncio.Server | None = None
        self._handlers: set[asyncio.Task] = set()
        self._writers: set[asyncio.StreamWriter] = set()
        self._waiting: collections.OrderedDict[asyncio.Task, asyncio.StreamWriter] = collections.OrderedDict()
        self.evicted = 0  # connections closed to make room, before they sent a request

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, self.host, self.port, limit=self.max_request)
        self.port = self._server.sockets[0].getsockname()[1]   # the bound one, where port 0 was asked

    async def close(self) -> None:
        """Stop listening, hang up on every open connection and wait for their handlers."""
        if self._server is None:
            return
        self._server.close()
        for w in list(self._writers):
            w.transport.abort()   # a waiting read ends with EOF (cancelling the handler task instead
        await asyncio.gather(*self._handlers, return_exceptions=True)  # makes 3.11's streams log errors)
        await self._server.wait_closed()

    def _respond(self, path: str, headers: dict[bytes, bytes] | None = None) -> tuple[int, str, str]:
        if path == "/metrics":
            if self.token is not None:
                given = (headers or {}).get(b"authorization", b"")
                if not hmac.compare_digest(given, b"Bearer " + self.token.encode()):
                    return 401, "text/plain; charset=utf-8", "a bearer token is required\n"
            return 200, "text/plain; version=0.0.4; charset=utf-8", self.collector.exposition()
        if path == "/healthz":
            down, alarms = self.collector.unhealthy(), self.collector.alarms()
            if not down and not alarms:
                return 200, "text/plain; charset=utf-8", "ok\n"
            lines = (["down: " + " ".join(down)] if down else []) + [f"alarm: {a}" for a in alarms]
            return 503, "text/plain; charset=utf-8", "\n".join(lines) + "\n"
        return 404, "text/plain; charset=utf-8", "not found: GET /metrics or /healthz\n"

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if len(self._handlers) >= self.max_connections:
            if not self._waiting:  # every slot is answering a request: this one must wait its turn
                writer.close()
                return
            _, oldest = self._waiting.popitem(last=False)  # a client that has sent nothing yet
            self.evicted += 1
            oldest.transport.abort()  # its read ends at once and its handler frees the slot
        task = asyncio.current_task()
        self._handlers.add(task)
        self._writers.add(writer)
        self._waiting[task] = writer
        try:
            async with asyncio.timeout(self.deadline_s):
                code, ctype, body = await self._answer(reader, task)
                extra = "WWW-Authenticate: Bearer realm=\"laminar\"\r\n" if code == 401 else ""
                head = (f"HTTP/1.1 {code} {_REASONS[code]}\r\nContent-Type: {ctype}\r\n{extra}"
                        f"Content-Length: {len(body.encode())}\r\nConnection: close\r\n\r\n")
                writer.write(head.encode() + body.encode())
                await writer.drain()
                if code == 431:  # the rest of the request is unread: closing now would reset the
                    writer.write_eof()  # connection before the client reads the answer, so let it finish
                    while await reader.read(self.max_request):
                        pass
        except (TimeoutError, ConnectionError, asyncio.IncompleteReadError):
            pass  # a slow, vanished or half-sent client: nothing to answer
        finally:
            self._handlers.discard(task)
            self._writers.discard(writer)
            self._waiting.pop(task, None)
            writer.close()

    async def _answer(self, reader: asyncio.StreamReader, task: asyncio.Task | None = None) -> tuple[int, str, str]:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.LimitOverrunError:
            return 431, "text/plain; charset=utf-8", "request too large\n"
        finally:
            self._waiting.pop(task, None)  # a request (or garbage) arrived: no longer evictable
        parts = head.split(b"\r\n", 1)[0].split()
        if len(parts) != 3 or not parts[2].startswith(b"HTTP/"):
            return 400, "text/plain; charset=utf-8", "bad request line\n"
        if parts[0] != b"GET":
            return 405, "text/plain; charset=utf-8", "only GET\n"
        path = parts[1].decode("latin-1").split("?", 1)[0]
        headers = {}
        for line in head.split(b"\r\n")[1:]:
            name, sep, value = line.partition(b":")
            if sep:
                headers[name.strip().lower()] = value.strip()
        try:
            return self._respond(path, headers)
        except Exception:
            log.exception("health_render_failed", path=path)   # loud, but a bad scrape never stops the node
            return 500, "text/plain; charset=utf-8", "internal error (see the supervisor's log)\n"
