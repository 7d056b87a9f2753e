"""Node health (laminar/health.py): the collector turns supervisor states and bus events into the
Prometheus text format (parsed back here with a tiny parser, and with prometheus_client's where it
is installed); the HTTP server answers /metrics and /healthz and stays bounded on bad requests."""
from __future__ import annotations

import asyncio
import json
import re
from types import SimpleNamespace

import pytest

from laminar.config import ConfigError, parse_config
from laminar.health import HealthCollector, MetricsServer, last_trainer_metrics
from laminar.protocol import Heartbeat, Metrics, RelayProgress, RolloutStats

pytestmark = pytest.mark.timeout(30)

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)",?')


def parse(text: str) -> dict[tuple[str, frozenset], float]:
    """The text exposition as {(name, labels): value}; every family announced by TYPE before use."""
    out, typed = {}, set()
    assert text.endswith("\n")
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            assert kind in ("gauge", "counter") and name not in typed, line
            typed.add(name)
            continue
        if line.startswith("#"):
            assert line.startswith("# HELP "), line
            continue
        m = _SAMPLE.match(line)
        assert m, line
        name, labels, value = m.groups()
        assert name in typed, f"{name} has no TYPE line"
        pairs = _LABEL.findall(labels or "")
        assert "".join(f'{k}="{v}",' for k, v in pairs).rstrip(",") == (labels or ""), line
        unesc = lambda s: re.sub(r"\\(.)", lambda x: {"n": "\n"}.get(x.group(1), x.group(1)), s)  # noqa: E731
        key = (name, frozenset((k, unesc(v)) for k, v in pairs))
        assert key not in out, f"duplicate sample {line}"
        out[key] = float(value)
    return out


def get(samples, name: str, **labels) -> float:
    hits = [v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= ls]
    assert len(hits) == 1, (name, labels, hits)
    return hits[0]


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


PLACED = {k: "h0" for k in ("broker.0", "manager.0", "relay.r0", "rollout.0", "rollout.1", "trainer.0")}


def hb(role: str, id: str, status: dict | None = None, dropped: int = 0) -> Heartbeat:
    return Heartbeat(role=role, id=id, host="h0", pid=1000, seq=1, uptime_s=12.5, state="ready",
                     status=status or {}, dropped_frames=dropped)


def child(role: str, id: str, state: str, restarts: int = 0, pid: int | None = 1000):
    return SimpleNamespace(role=role, id=id, state=state, restarts=restarts, pid=pid)


def fed() -> tuple[HealthCollector, Clock]:
    clock = Clock()
    c = HealthCollector("demo", "h0", PLACED, dead_after_s=5.0, dropped=lambda: 3, clock=clock)
    for key in PLACED:
        role, _, id = key.partition(".")
        c.child_changed(child(role, id, "ready"))
    c.observe(hb("broker", "0"))
    c.observe(hb("manager", "0", {"chain": ["r0"], "repacks": 4, "moved": 31, "dead_rollouts": 1, "recovered": 7,
                                  "failed_moves": 3, "replaced": 11, "orphans": 2, "repairs": 1,
                                  "last_repair_s": 0.12, "epoch": 3}))
    c.observe(hb("relay", "r0", {"version": 6, "receiving": -1, "chunks_have": 9, "chunks_total": 9,
                                 "corrupt_chunks": 0}, dropped=2))
    c.observe(RelayProgress(relay_id="r0", version=7, chunks_have=4, chunks_total=9, complete_version=6,
                            corrupt_chunks=1, upstream="", downstream=""))
    c.observe(hb("rollout", "0", {"version": 5, "kv": 0.25, "state": "generating"}, dropped=17))
    c.observe(RolloutStats(rollout_id="0", host="h0", version=6, kv_usage=0.5, running=12, waiting=0, active=14,
                           tokens_per_s=250.0, state="generating", generated_tokens=9000))
    c.observe(hb("rollout", "1", {"version": 5, "kv": 0.125, "state": "idle"}))  # no stats yet: heartbeat facts
    c.observe(hb("trainer", "0", {"version": 6, "state": "training"}))
    c.observe(Metrics(role="trainer", id="0", ts=1000.0, values={"version": 5.0, "batch_tokens": 4000.0}))
    c.observe(Metrics(role="trainer", id="0", ts=1002.0, values={
        "version": 6.0, "batch_tokens": 5000.0, "tokens_per_s": 1800.0, "staleness_mean": 0.75,
        "staleness_max": 2.0, "reward_mean": 0.5, "publish_stall_s": 0.01, "rss_bytes": 7.5e9}))
    c.observe(Metrics(role="echo", id="0", ts=1.0, values={"served": 1.0}))     # not a fact we report
    return c, clock


def test_exposition_reports_every_fact_of_the_node():
    c, _ = fed()
    s = parse(c.exposition())
    for key in PLACED:
        role, _, id = key.partition(".")
        assert get(s, "laminar_role_up", role=role, id=id, host="h0") == 1
        assert get(s, "laminar_role_state", role=role, id=id, state="ready") == 1
        assert get(s, "laminar_role_state", role=role, id=id, state="backoff") == 0
        assert get(s, "laminar_role_restarts_total", role=role, id=id) == 0
    assert get(s, "laminar_node_info", run="demo", host="h0") == 1
    assert get(s, "laminar_node_dropped_frames_total") == 3
    assert get(s, "laminar_role_dropped_frames_total", role="rollout", id="0") == 17
    assert get(s, "laminar_role_dropped_frames_total", role="relay", id="r0") == 2
    assert get(s, "laminar_role_dropped_frames_total", role="broker", id="0") == 0
    assert get(s, "laminar_role_uptime_seconds", role="trainer") == 12.5
    # versions of rollouts (stats beat the older heartbeat), relays and the trainer
    assert get(s, "laminar_weight_version", role="rollout", id="0") == 6
    assert get(s, "laminar_weight_version", role="rollout", id="1") == 5
    assert get(s, "laminar_weight_version", role="relay", id="r0") == 6
    assert get(s, "laminar_weight_version", role="trainer", id="0") == 6
    assert get(s, "laminar_rollout_kv_usage", id="0") == 0.5 and get(s, "laminar_rollout_kv_usage", id="1") == 0.125
    assert get(s, "laminar_rollout_tokens_per_second", id="0") == 250
    assert get(s, "laminar_rollout_generated_tokens_total", id="0") == 9000
    assert get(s, "laminar_rollout_running", id="0") == 12 and get(s, "laminar_rollout_active", id="0") == 14
    assert get(s, "laminar_relay_receiving_version", id="r0") == 7
    assert get(s, "laminar_relay_chunks_have", id="r0") == 4 and get(s, "laminar_relay_chunks_total", id="r0") == 9
    assert get(s, "laminar_relay_corrupt_chunks_total", id="r0") == 1
    assert get(s, "laminar_trainer_tokens_per_second") == 1800
    assert get(s, "laminar_trainer_throughput_tokens_per_second") == 5000 / 2.0
    assert get(s, "laminar_trainer_staleness_mean") == 0.75 and get(s, "laminar_trainer_staleness_max") == 2
    assert get(s, "laminar_trainer_reward_mean") == 0.5
    assert get(s, "laminar_trainer_resident_bytes") == 7.5e9   # a trainer whose memory grows is seen early
    assert get(s, "laminar_manager_repacks_total") == 4
    assert get(s, "laminar_manager_moved_trajectories_total") == 31
    assert get(s, "laminar_manager_dead_rollouts_total") == 1
    assert get(s, "laminar_manager_recovered_trajectories_total") == 7
    assert get(s, "laminar_manager_failed_moves_total") == 3
    assert get(s, "laminar_manager_replaced_trajectories_total") == 11
    assert get(s, "laminar_manager_orphans") == 2
    assert get(s, "laminar_manager_chain_repairs_total") == 1
    assert not [k for k in s if "echo" in str(k) or k[0].endswith("served")]


def test_exposition_parses_with_prometheus_client():
    parser = pytest.importorskip("prometheus_client.parser")
    c, _ = fed()
    families = {f.name: f for f in parser.text_string_to_metric_families(c.exposition())}
    assert families["laminar_role_up"].type == "gauge" and len(families["laminar_role_up"].samples) == len(PLACED)
    drops = {(s.labels["role"], s.labels["id"]): s.value for s in families["laminar_role_dropped_frames"].samples}
    assert families["laminar_role_dropped_frames"].type == "counter" and drops["rollout", "0"] == 17
    assert families["laminar_trainer_staleness_max"].samples[0].value == 2


def test_role_goes_down_on_silence_on_a_supervisor_state_and_healthz_lists_it():
    c, clock = fed()
    assert c.unhealthy() == []
    clock.t += 4.0
    c.observe(hb("broker", "0"))
    c.observe(hb("trainer", "0"))
    c.child_changed(child("trainer", "0", "finished"))          # done: down, yet not unhealthy
    c.child_changed(child("rollout", "1", "backoff", restarts=2, pid=None))
    clock.t += 2.0                                              # everyone else silent for 6 s > dead_after_s
    s = parse(c.exposition())
    assert get(s, "laminar_role_up", role="broker") == 1
    assert get(s, "laminar_role_up", role="manager") == 0
    assert get(s, "laminar_role_up", role="trainer") == 0
    assert get(s, "laminar_role_state", role="rollout", id="1", state="backoff") == 1
    assert get(s, "laminar_role_restarts_total", role="rollout", id="1") == 2
    assert get(s, "laminar_role_heartbeat_age_seconds", role="manager") == 6.0
    assert c.unhealthy() == ["manager.0", "relay.r0", "rollout.0", "rollout.1"]
    assert get(s, "laminar_weight_version", role="rollout", id="0") == 6   # last facts stay


def test_a_restarted_role_is_up_only_once_its_new_process_beats():
    c, clock = fed()
    c.child_changed(child("rollout", "0", "starting", restarts=1, pid=2000))
    c.child_changed(child("rollout", "0", "ready", restarts=1, pid=2000))
    assert not c.snapshot()["rollout.0"]["up"]            # the fresh beat is the dead process's (pid 1000)
    c.observe(Heartbeat(role="rollout", id="0", host="h0", pid=2000, seq=0, uptime_s=0.1, state="ready"))
    s = parse(c.exposition())
    assert get(s, "laminar_role_up", role="rollout", id="0") == 1
    assert get(s, "laminar_role_dropped_frames_total", role="rollout", id="0") == 0


def test_node_collector_ignores_roles_of_other_hosts_the_cluster_view_adds_them():
    node = HealthCollector("demo", "h1", {"rollout.5": "h1"}, dead_after_s=5.0)
    cluster = HealthCollector("demo", "", {"rollout.5": "h1"}, dead_after_s=5.0, only_placed=False)
    for c in (node, cluster):
        c.observe(hb("rollout", "7", {"version": 1}))
        c.observe(RolloutStats(rollout_id="7", host="h0", version=1, kv_usage=0.1, running=1, waiting=0, active=1,
                               tokens_per_s=1.0, state="idle"))
        c.observe(Metrics(role="trainer", id="0", ts=1.0, values={"staleness_max": 1.0}))
    assert set(node.snapshot()) == {"rollout.5"} and "rollout" not in node.exposition().split("laminar_role_up")[0]
    snap = cluster.snapshot()
    assert set(snap) == {"rollout.5", "rollout.7", "trainer.0"}
    assert (
        snap["rollout.7"]["up"]
        and snap["rollout.7"]["host"] == "h0"
        and snap["rollout.7"]["metrics"]["kv_usage"] == 0.1
    )
    assert not snap["rollout.5"]["up"] and snap["rollout.5"]["heartbeat_age_s"] is None
    assert snap["trainer.0"]["metrics"] == {"staleness_max": 1.0}
    json.dumps(snap)


def test_label_values_are_escaped():
    c = HealthCollector('r"un\\x\ny', "h0", {}, dead_after_s=1.0)
    s = parse(c.exposition())
    assert get(s, "laminar_node_info", run='r"un\\x\ny') == 1


def test_last_trainer_metrics_reads_the_tail_of_metrics_jsonl(tmp_path):
    p = tmp_path / "metrics.jsonl"
    assert last_trainer_metrics(p) == []
    p.write_text("".join(json.dumps({"version": v, "ts": 10.0 + v, "batch_tokens": 100.0, "staleness_max": v % 3,
                                     "group_ids": ["g"]}) + "\n" for v in range(1, 50)) + '{"version": 50, "ts"')
    ms = last_trainer_metrics(p, n=3, tail_bytes=300)
    assert [m.values["version"] for m in ms] == [48, 49]         # the half-written last line is skipped
    c = HealthCollector("demo", "h0", {"trainer.0": "h0"}, dead_after_s=1.0)
    for m in ms:
        c.observe(m)
    assert c.snapshot()["trainer.0"]["metrics"]["throughput"] == 100.0


def test_metrics_port_is_validated_against_the_other_ports_of_its_host():
    def cfg(port):
        return {"cluster": {"keys_dir": None, "broker": {"host": "h0", "pub_port": 5550},
                            "hosts": {"h0": {"address": "127.0.0.1", "metrics_port": port,
                                             "roles": [{"role": "broker"}, {"role": "echo", "port": 5600}]}}}}
    assert parse_config(cfg(9100)).cluster.hosts["h0"].metrics_port == 9100
    assert parse_config(cfg(None)).cluster.hosts["h0"].metrics_port is None
    with pytest.raises(ConfigError, match=r"metrics_port 5550 already used by broker\.pub_port"):
        parse_config(cfg(5550))
    with pytest.raises(ConfigError, match=r"port 5600 of echo\.0 already used by metrics_port"):
        parse_config(cfg(5600))
    with pytest.raises(ConfigError, match=r"cluster\.hosts\.h0\.metrics_port"):
        parse_config(cfg(0))


# -- the HTTP server ------------------------------------------------------------------------
async def _request(port: int, raw: bytes, read: bool = True) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(raw)
    await writer.drain()
    data = await reader.read() if read else b""
    writer.close()
    return data


def _split(resp: bytes) -> tuple[int, dict, str]:
    head, _, body = resp.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    assert int(headers["Content-Length"]) == len(body)
    return int(lines[0].split()[1]), headers, body.decode()


async def handlers(srv: MetricsServer, n: int) -> None:
    """Until the server holds `n` connections (accepting has no handshake a client could wait on)."""
    async with asyncio.timeout(5):
        while len(srv._handlers) != n:
            await asyncio.sleep(0.01)


def test_server_answers_metrics_and_healthz_and_refuses_the_rest():
    async def main():
        c, clock = fed()
        srv = MetricsServer(c, "127.0.0.1", 0, max_request=1024, deadline_s=0.5)
        await srv.start()
        try:
            code, h, body = _split(await _request(srv.port, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"))
            assert code == 200 and h["Content-Type"].startswith("text/plain; version=0.0.4")
            assert get(parse(body), "laminar_role_up", role="manager") == 1
            assert _split(await _request(srv.port, b"GET /healthz HTTP/1.0\r\n\r\n"))[::2] == (200, "ok\n")
            clock.t += 10
            assert _split(await _request(srv.port, b"GET /healthz?x HTTP/1.1\r\n\r\n"))[::2] == (
                503, "down: " + " ".join(sorted(PLACED)) + "\n")
            assert _split(await _request(srv.port, b"GET /nope HTTP/1.1\r\n\r\n"))[0] == 404
            assert _split(await _request(srv.port, b"POST /metrics HTTP/1.1\r\n\r\n"))[0] == 405
            assert _split(await _request(srv.port, b"\x00\xff garbage\r\n\r\n"))[0] == 400
            assert (
                _split(await _request(srv.port, b"GET /metrics HTTP/1.1\r\nX: " + b"a" * 5000 + b"\r\n\r\n"))[0] == 431
            )
            assert await _request(srv.port, b"GET /metrics HTT") == b""       # never finished: closed at the deadline
            # more clients than max_connections: a newcomer takes the slot of the oldest client that
            # has sent nothing, so stalled clients cannot starve a scrape
            srv.max_connections = 2
            stalled = [await asyncio.open_connection("127.0.0.1", srv.port) for _ in range(2)]
            await handlers(srv, 2)
            assert _split(await _request(srv.port, b"GET /metrics HTTP/1.1\r\n\r\n"))[0] == 200
            assert srv.evicted == 1 and await stalled[0][0].read() == b""   # the oldest was hung up on
            for _, w in stalled:
                w.close()
            await handlers(srv, 0)      # a client that hangs up frees its slot at once
            assert _split(await _request(srv.port, b"GET /healthz HTTP/1.1\r\n\r\n"))[0] == 503
        finally:
            await srv.close()
        with pytest.raises(OSError):
            await _request(srv.port, b"GET /metrics HTTP/1.1\r\n\r\n")
    asyncio.run(main())


def test_close_does_not_wait_for_a_stalled_client():
    async def main():
        c, _ = fed()
        srv = MetricsServer(c, "127.0.0.1", 0, deadline_s=30.0)
        await srv.start()
        _, w = await asyncio.open_connection("127.0.0.1", srv.port)
        w.write(b"GET /metr")
        await handlers(srv, 1)
        async with asyncio.timeout(2):
            await srv.close()
        w.close()
    asyncio.run(main())


def test_a_pool_that_heartbeats_serving_false_is_down_and_healthz_names_it():
    clock = Clock()
    placed = {"experience_buffer.0": "h0", "prompt_pool.0": "h0"}
    c = HealthCollector("demo", "h0", placed, dead_after_s=5.0, dropped=lambda: 0, clock=clock)
    for key in placed:
        role, _, id = key.partition(".")
        c.child_changed(child(role, id, "ready"))
    c.observe(hb("prompt_pool", "0", {"serving": True, "outstanding": 3}))
    c.observe(hb("experience_buffer", "0", {"serving": False, "fault": "store damaged: quarantine or rebuild"}))
    assert c.unhealthy() == ["experience_buffer.0"]          # beating on time, yet unable to serve
    snap = c.snapshot()
    assert snap["experience_buffer.0"]["up"] is False and snap["prompt_pool.0"]["up"] is True
    assert get(parse(c.exposition()), "laminar_role_up", role="experience_buffer") == 0
