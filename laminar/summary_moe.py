"""The mixture-of-experts section of the end-of-run summary (laminar/summary.py): per version.

From `<workdir>/trainer/metrics.jsonl`, the versions of a run whose trajectories carried routing
(the trainer's `routing_bytes_per_trajectory`, roles/trainer/routing_replay.py): one row per
version with its reward (batch mean), staleness (mean and max, in versions), the train-inference
mismatch (mean and max |trainer - behaviour| logprob over the tokens the version measured: those
sampled by the weights the trainer held; None for a version with none, as the trainer leaves it
out), the share of those tokens whose trainer top-k differs from the rollout's in some layer, the
load-balancing loss, and the routing bytes per trajectory; then the run's means. None for a run without routing (a dense
model, or `roles.rollout.moe.routing` off).
"""
from __future__ import annotations

# row key -> the trainer's metrics.jsonl key
COLUMNS = {"reward": "reward_mean", "staleness_mean": "staleness_mean", "staleness_max": "staleness_max",
           "mismatch_mean_abs": "mismatch_mean_abs", "mismatch_max_abs": "mismatch_max_abs",
           "routing_disagree_token_share": "routing_disagree_token_share", "moe_aux_loss": "moe_aux_loss",
           "routing_bytes_per_trajectory": "routing_bytes_per_trajectory"}


def _mean(values: list) -> float | None:
    got = [float(v) for v in values if v is not None]
    return sum(got) / len(got) if got else None


def moe_section(recs: list[dict]) -> dict | None:
    """{per_version: [rows], and each column's mean over the versions that have it}; None without routing."""
    if not any(r.get("routing_trajectories") for r in recs):
        return None
    rows = []
    for r in recs:
        row = {"version": int(r.get("version", len(rows) + 1))}
        row.update({k: r.get(src) for k, src in COLUMNS.items()})
        rows.append(row)
    out: dict = {"per_version": rows}
    for k in COLUMNS:
        out[f"{k}_mean"] = _mean([row[k] for row in rows])
    out["mismatch_versions"] = sum(row["mismatch_mean_abs"] is not None for row in rows)
    return out


def moe_table(section: dict) -> str:
    """The per-version rows as a fixed-width table (printed under the summary's)."""
    def f(v):
        return "-" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v)
    head = ["version", "reward", "stale mean", "stale max", "|dlogp| mean", "|dlogp| max", "top-k differs",
            "aux loss", "routing B/traj"]
    keys = ["version", *COLUMNS]
    lines = ["mixture of experts, per version:", "  " + "  ".join(f"{h:>13}" for h in head)]
    lines += ["  " + "  ".join(f"{f(row[k]):>13}" for k in keys) for row in section["per_version"]]
    return "\n".join(lines)
