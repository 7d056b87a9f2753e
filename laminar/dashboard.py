"""`laminar-node dashboard CONFIG --out DIR`: a Grafana dashboard of the Prometheus series every
node exports (laminar/health.py, listed in laminar/health_facts.py), and a Prometheus scrape
config for the config's hosts.

    DIR/laminar-<run>.json    the dashboard (Grafana's JSON model: import it, pick the Prometheus data source)
    DIR/prometheus.yml        one scrape job per host with a `metrics_port` (its bearer token file, if any)
    DIR/laminar-<run>.png     with `--png-from URL`: the same panels drawn by matplotlib from a Prometheus
                              server's API (for a machine without Grafana)

Panels: trainer and rollout throughput, reward, held-out evaluation, staleness, train-inference
mismatch, KV-cache usage, relay progress, weight versions, relay lag, the pools, alarms and roles
down, the reward role's queue and latency, the publish stall, agent episodes and the latency of
their calls (the gateway). Every query names only series the
exporter writes (`metric_names()`) and every panel has a unit; the variables `run` and `host`
(from `laminar_node_info`) filter every query. Hosts without a `metrics_port` serve no metrics: they
are left out of the scrape config and named on stderr.
"""
from __future__ import annotations

import json
import re
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import yaml

from laminar.config import load_config

F = 'host=~"$host"'   # every selector carries the host filter of the dashboard's variable


def m(name: str, **labels: str) -> str:
    """A selector of series `name` with the host filter and `labels`."""
    return name + "{" + ",".join([F, *(f'{k}="{v}"' for k, v in labels.items())]) + "}"


# (title, unit, [(query, legend)]); units are Grafana's (a custom one is `suffix:<text>`)
PANELS: list[tuple[str, str, list[tuple[str, str]]]] = [
    ("Throughput: trainer (tokens/s)", "suffix: tok/s", [
        (m("laminar_trainer_throughput_tokens_per_second"), "batch tokens / time between versions"),
        (m("laminar_trainer_tokens_per_second"), "training tokens/s")]),
    ("Throughput: rollouts (generated tokens/s)", "suffix: tok/s", [
        (f"sum by (host) ({m('laminar_rollout_tokens_per_second')})", "{{host}}"),
        (m("laminar_rollout_tokens_per_second"), "rollout {{id}}")]),
    ("Reward (batch mean)", "short", [(m("laminar_trainer_reward_mean"), "trainer {{id}}")]),
    ("Held-out evaluation", "percentunit", [
        (m("laminar_eval_metric"), "{{set}}/{{metric}}"),
        (m("laminar_eval_accuracy"), "accuracy (greedy)")]),
    ("Staleness (versions)", "suffix: versions", [
        (m("laminar_trainer_staleness_mean"), "mean"), (m("laminar_trainer_staleness_max"), "max")]),
    ("Train-inference mismatch (logprob)", "suffix: nats", [
        (m("laminar_trainer_mismatch_mean_abs"), "mean |Δ|"), (m("laminar_trainer_mismatch_max_abs"), "max |Δ|"),
        (m("laminar_trainer_mismatch_k3"), "k3")]),
    ("KV-cache usage", "percentunit", [(m("laminar_rollout_kv_usage"), "rollout {{id}}")]),
    ("Relay progress (chunks of the arriving version)", "percentunit", [
        (f"{m('laminar_relay_chunks_have')} / {m('laminar_relay_chunks_total')}", "relay {{id}}")]),
    ("Weight versions", "short", [(m("laminar_weight_version"), "{{role}} {{id}}")]),
    ("Relay lag behind the trainer (versions)", "suffix: versions", [
        (f"scalar(max({m('laminar_weight_version', role='trainer')})) - {m('laminar_weight_version', role='relay')}",
         "relay {{id}}"),
        (m("laminar_manager_weights_lag_versions"), "rollouts (manager)")]),
    ("Pools", "short", [
        (m("laminar_prompt_pool_outstanding_groups"), "prompt pool: groups out"),
        (m("laminar_prompt_pool_requeued_groups"), "prompt pool: requeued"),
        (m("laminar_partial_pool_in_flight"), "partial pool: in flight"),
        (m("laminar_experience_buffer_complete_groups"), "buffer: complete groups"),
        (m("laminar_experience_buffer_leased_groups"), "buffer: leased")]),
    ("Alarms and roles down", "short", [
        (f"sum by (alarm) ({m('laminar_alarm')})", "{{alarm}}"),
        (f"count({m('laminar_role_up')} == 0) or vector(0)", "roles down"),
        (f"sum(increase({m('laminar_role_restarts_total')}[5m]))", "restarts (5 min)")]),
    ("Reward role: queue", "short", [
        (m("laminar_reward_queue_depth"), "replica {{id}}: awaiting its scorer"),
        (m("laminar_partial_pool_awaiting_reward"), "partial pool: awaiting a score")]),
    ("Reward role: latency", "s", [
        (m("laminar_reward_latency_p50_seconds"), "p50 {{id}}"),
        (m("laminar_reward_latency_max_seconds"), "max {{id}}")]),
    ("Publish stall of the trainer", "s", [(m("laminar_trainer_publish_stall_seconds"), "trainer {{id}}")]),
    ("Agent episodes (gateway)", "short", [
        (m("laminar_gateway_episodes_active"), "claimed {{id}}"),
        (m("laminar_gateway_episodes_open"), "open {{id}}"),
        (f"rate({m('laminar_gateway_episodes_finished_total')}[1m]) * 60", "finished a minute {{id}}"),
        (f"rate({m('laminar_gateway_episodes_failed_total')}[1m]) * 60", "failed a minute {{id}}"),
        (f"rate({m('laminar_gateway_history_rewrites_total')}[1m]) * 60", "history rewrites a minute {{id}}")]),
    ("Agent calls: latency (gateway)", "s", [
        (m("laminar_gateway_latency_p50_seconds"), "p50 {{id}}"),
        (m("laminar_gateway_latency_p99_seconds"), "p99 {{id}}")]),
]

_METRIC = re.compile(r"\blaminar_[a-z0-9_]+")


def metrics_in(expr: str) -> set[str]:
    """The series names a query reads."""
    return set(_METRIC.findall(expr))


def dashboard(run: str) -> dict:
    """The Grafana dashboard (JSON model, schema 39) of run `run`."""
    panels = []
    for i, (title, unit, targets) in enumerate(PANELS):
        panels.append({
            "id": i + 1, "type": "timeseries", "title": title,
            "gridPos": {"h": 8, "w": 12, "x": 12 * (i % 2), "y": 8 * (i // 2)},
            "datasource": {"type": "prometheus", "uid": "${datasource}"},
            "fieldConfig": {"defaults": {"unit": unit, **({"min": 0, "max": 1} if unit == "percentunit" else {})},
                            "overrides": []},
            "options": {"legend": {"displayMode": "list", "placement": "bottom"}, "tooltip": {"mode": "multi"}},
            "targets": [{"refId": chr(ord("A") + j), "expr": expr, "legendFormat": legend,
                         "datasource": {"type": "prometheus", "uid": "${datasource}"}}
                        for j, (expr, legend) in enumerate(targets)]})
    variables = [
        {"name": "datasource", "type": "datasource", "query": "prometheus", "label": "Prometheus"},
        {"name": "run", "type": "query", "label": "run", "datasource": {"type": "prometheus", "uid": "${datasource}"},
         "query": {"query": "label_values(laminar_node_info, run)", "refId": "run"}, "refresh": 2,
         "current": {"text": run, "value": run}},
        {"name": "host", "type": "query", "label": "host", "includeAll": True, "multi": True,
         "datasource": {"type": "prometheus", "uid": "${datasource}"},
         "query": {"query": 'label_values(laminar_node_info{run=~"$run"}, host)', "refId": "host"}, "refresh": 2,
         "current": {"text": "All", "value": "$__all"}}]
    return {"title": f"Laminar: {run}", "uid": f"laminar-{re.sub('[^a-zA-Z0-9_-]', '-', run)}"[:40],
            "schemaVersion": 39, "version": 1, "editable": True, "refresh": "10s", "tags": ["laminar"],
            "time": {"from": "now-1h", "to": "now"}, "templating": {"list": variables}, "panels": panels}


def scrape_config(cfg, interval_s: float = 5.0) -> tuple[dict, list[str]]:
    """(Prometheus config, hosts left out): one job per host with a metrics port, its target the
    address its /metrics listens on (the cluster address when that is every interface)."""
    from laminar.health import metrics_bind  # late: health imports the protocol
    jobs, skipped = [], []
    for hid, h in cfg.cluster.hosts.items():
        if h.metrics_port is None:
            skipped.append(hid)
            continue
        where = metrics_bind(h)
        where = h.address if where in ("0.0.0.0", "::", "", "*") else where
        target = f"[{where}]:{h.metrics_port}" if ":" in where else f"{where}:{h.metrics_port}"
        job = {"job_name": f"laminar-{cfg.run.name}-{hid}", "metrics_path": "/metrics",
               "static_configs": [{"targets": [target], "labels": {"laminar_run": cfg.run.name}}]}
        if h.metrics_token_file:
            job["authorization"] = {"type": "Bearer", "credentials_file": str(Path(h.metrics_token_file).resolve())}
        jobs.append(job)
    return {"global": {"scrape_interval": f"{interval_s:g}s", "evaluation_interval": "15s"},
            "scrape_configs": jobs}, skipped


def query_range(url: str, expr: str, start: float, end: float, step: float) -> list[dict]:
    """The series of a PromQL range query against a Prometheus server's HTTP API."""
    q = urllib.parse.urlencode({"query": expr, "start": start, "end": end, "step": step})
    with urllib.request.urlopen(f"{url.rstrip('/')}/api/v1/query_range?{q}", timeout=30) as r:
        body = json.loads(r.read())
    if body.get("status") != "success":
        raise RuntimeError(f"{url}: {expr}: {body.get('error')}")
    return body["data"]["result"]


def legend(template: str, labels: dict) -> str:
    return re.sub(r"\{\{(\w+)\}\}", lambda m: str(labels.get(m.group(1), "")), template)


def render_png(url: str, run: str, out: Path, minutes: float = 30.0, end: float | None = None) -> Path:
    """The dashboard's panels drawn with matplotlib from a Prometheus server (where no Grafana is
    at hand): the last `minutes` of data, every host."""
    import matplotlib  # late: matplotlib (heavy), only when panels are drawn
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # late: as matplotlib, after its backend is chosen
    end = end or time.time()
    start, step = end - 60 * minutes, max(1.0, 60 * minutes / 300)
    rows = (len(PANELS) + 1) // 2
    fig, axes = plt.subplots(rows, 2, figsize=(14, 2.6 * rows), sharex=True)
    for ax, (title, unit, targets) in zip(axes.flat, PANELS, strict=False):
        for expr, tmpl in targets:
            for series in query_range(url, expr.replace("$host", ".*"), start, end, step):
                pts = [(float(t) - start, float(v)) for t, v in series["values"]]
                ax.plot([p[0] / 60 for p in pts], [p[1] for p in pts], label=legend(tmpl, series["metric"]))
        ax.set_title(title, fontsize=9)
        ax.set_ylabel({"short": "", "percentunit": "0..1"}.get(unit, unit.removeprefix("suffix:").strip()), fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        if ax.get_lines():
            ax.legend(fontsize=6, loc="upper left")
        else:
            ax.text(0.5, 0.5, "no data in this run", ha="center", va="center", transform=ax.transAxes, fontsize=8)
    for ax in list(axes.flat)[len(PANELS):]:
        ax.axis("off")
    for ax in axes[-1]:
        ax.set_xlabel("minutes", fontsize=8)
    fig.suptitle(f"Laminar: {run} (the dashboard's queries, from Prometheus)", fontsize=11)
    fig.tight_layout(rect=(0, 0, 1, 0.98))
    fig.savefig(out, dpi=72)
    plt.close(fig)
    return out


def add_arguments(s) -> None:
    s.add_argument("--out", required=True, help="folder for the dashboard JSON and prometheus.yml")
    s.add_argument("--scrape-interval", type=float, default=5.0, metavar="S",
                   help="Prometheus' scrape interval in the written config (default 5 s)")
    s.add_argument("--png-from", default=None, metavar="URL", help="also draw the panels as a PNG (matplotlib) "
                   "from this Prometheus server's API, e.g. http://127.0.0.1:9090 (where no Grafana is at hand)")
    s.add_argument("--minutes", type=float, default=30.0, help="with --png-from: the last this many minutes")


def run(a) -> int:
    cfg = load_config(a.config, a.set)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    board = out / f"laminar-{cfg.run.name}.json"
    board.write_text(json.dumps(dashboard(cfg.run.name), indent=2) + "\n")
    prom, skipped = scrape_config(cfg, a.scrape_interval)
    (out / "prometheus.yml").write_text(yaml.safe_dump(prom, sort_keys=False))
    print(board)
    print(out / "prometheus.yml")
    for hid in skipped:
        print(f"note: cluster.hosts.{hid} has no metrics_port: it serves no /metrics and is not scraped",
              file=sys.stderr)
    print(f"run: prometheus --config.file {out / 'prometheus.yml'}; in Grafana: Dashboards > Import > {board.name}",
          file=sys.stderr)
    if a.png_from:
        print(render_png(a.png_from, cfg.run.name, out / f"laminar-{cfg.run.name}.png", a.minutes))
    return 0
