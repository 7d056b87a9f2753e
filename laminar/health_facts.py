"""What the node's health collector (laminar/health.py) takes from each role's reports, and what it
exposes: the facts per role kind (heartbeat status keys, trainer and evaluator metrics), the
Prometheus families, and the alarms' windows. Data only: adding a fact or a series is a line here.
"""
from __future__ import annotations

SUPERVISOR_STATES = ("pending", "starting", "ready", "backoff", "finished", "failed", "stopped",
                     "stopped_by_operator")
DOWN_ON_PURPOSE = ("finished", "stopped_by_operator")  # not up, and not unhealthy
GAVE_UP_ALARM_S = 600.0  # a partial pool's reward_gave_up alarm stays up this long after its newest give-up
REFUSED_ALARM_S = 600.0  # a pool's writes_refused alarm stays up this long after its newest refusal

# every pool: writes refused for want of a hand-out (roles/handout.py), and how long ago the newest was
_REFUSED = {"writes_refused": "writes_refused", "writes_refused_age_s": "writes_refused_age_s"}
# Facts a role's heartbeat status carries, per role kind: status key -> value name.
HB_FACTS = {
    "rollout": {"version": "version", "kv": "kv_usage", "active": "active", "batches": "batches"},
    "relay": {"version": "version", "chunks_have": "chunks_have", "chunks_total": "chunks_total",
              "corrupt_chunks": "corrupt_chunks"},
    "trainer": {"version": "version", "publish_stall_s": "publish_stall_s"},
    "evaluator": {"eval_version": "eval_version", "accuracy": "eval_accuracy",
                  "accuracy_sampled": "eval_accuracy_sampled"},
    "reward": {"scored": "reward_scored", "scores_refused": "reward_refused", "failed_batches": "reward_failed",
               "queue_depth": "reward_queue", "parse_failures": "reward_parse_failures",
               "latency_p50_s": "reward_p50", "latency_max_s": "reward_max", "batches": "reward_batches",
               "scoring_s_total": "reward_seconds"},
    "partial_pool": {"in_flight": "in_flight", "tokens": "in_flight_tokens", "awaiting_reward": "awaiting",
                     "awaiting_oldest_s": "awaiting_oldest_s",
                     "reward_parse_failed": "parse_failed", "reward_lease_expired": "lease_expired",
                     "reward_lease_shared": "lease_shared",
                     "reward_late_scores": "late_scores", "reward_gave_up": "gave_up",
                     "reward_gave_up_age_s": "gave_up_age_s", "reward_unserved": "unserved",
                     "reward_parked": "parked", **_REFUSED},
    "experience_buffer": {"stored": "stored", "capacity": "capacity", "complete_groups": "complete_groups",
                          "leased": "leased", **_REFUSED},
    "prompt_pool": {"groups_handed": "groups_handed", "outstanding": "outstanding", "requeued": "requeued",
                    "epoch": "epoch", **_REFUSED},
    "manager": {"repacks": "repacks", "moved": "moved", "dead_rollouts": "dead_rollouts", "recovered": "recovered",
                "failed_moves": "failed_moves", "replaced": "replaced", "orphans": "orphans", "repairs": "repairs",
                "last_repair_s": "last_repair_s", "epoch": "epoch", "weights_stalled": "weights_stalled",
                "weights_lag": "weights_lag", "weights_stalled_total": "weights_stalled_total"},
    "gateway": {"episodes_open": "episodes_open", "episodes_active": "episodes_active",
                "episodes_finished": "episodes_finished", "episodes_failed": "episodes_failed", "calls": "agent_calls",
                "calls_per_episode": "calls_per_episode", "tokens_per_call": "tokens_per_call",
                "latency_p50_s": "gateway_p50", "latency_p99_s": "gateway_p99",
                "history_rewrites": "history_rewrites"},
}
TRAINER_FACTS = ("version", "tokens_per_s", "staleness_mean", "staleness_max", "reward_mean", "publish_stall_s",
                  "mismatch_mean_abs", "mismatch_max_abs", "mismatch_k3", "groups_generated", "groups_kept",
                  "groups_dropped_nosignal", "rss_bytes")
# the evaluator's Metrics value -> fact name (the version it evaluated is `eval_version`, not the
# weight version it holds: the node's laminar_weight_version stays what engines serve)
EVAL_FACTS = {"version": "eval_version", "eval/accuracy": "eval_accuracy",
               "eval/accuracy_sampled": "eval_accuracy_sampled"}

# (metric, type, help, role kinds it is reported for, value name); role-level metrics are below.
FAMILIES = [
    ("laminar_weight_version", "gauge", "weight version: loaded in the engine (rollout), newest complete "
     "(relay), last published (trainer)", ("rollout", "relay", "trainer"), "version"),
    ("laminar_rollout_kv_usage", "gauge", "KV-cache usage of the engine, 0..1", ("rollout",), "kv_usage"),
    ("laminar_rollout_tokens_per_second", "gauge", "generated tokens per second over the last report "
     "interval", ("rollout",), "tokens_per_s"),
    ("laminar_rollout_generated_tokens_total", "counter", "tokens generated since the rollout started",
     ("rollout",), "generated_tokens"),
    ("laminar_rollout_running", "gauge", "trajectories the engine is decoding", ("rollout",), "running"),
    ("laminar_rollout_waiting", "gauge", "trajectories queued in the engine", ("rollout",), "waiting"),
    ("laminar_rollout_active", "gauge", "trajectories the rollout owns", ("rollout",), "active"),
    ("laminar_relay_receiving_version", "gauge", "version whose chunks are arriving (the weight version "
     "when idle)", ("relay",), "receiving"),
    ("laminar_relay_chunks_have", "gauge", "chunks of the receiving version that arrived and verified",
     ("relay",), "chunks_have"),
    ("laminar_relay_chunks_total", "gauge", "chunks of the receiving version", ("relay",), "chunks_total"),
    ("laminar_relay_corrupt_chunks_total", "counter", "chunks that failed their checksum (resent)",
     ("relay",), "corrupt_chunks"),
    ("laminar_trainer_tokens_per_second", "gauge", "training tokens per second of the last iteration",
     ("trainer",), "tokens_per_s"),
    ("laminar_trainer_throughput_tokens_per_second", "gauge", "prompt + response tokens of the last global "
     "batch / time since the previous version (the paper's throughput)", ("trainer",), "throughput"),
    ("laminar_trainer_staleness_mean", "gauge", "mean staleness of the last batch, in versions", ("trainer",),
     "staleness_mean"),
    ("laminar_trainer_staleness_max", "gauge", "max staleness of the last batch, in versions", ("trainer",),
     "staleness_max"),
    ("laminar_trainer_reward_mean", "gauge", "mean reward of the last batch", ("trainer",), "reward_mean"),
    ("laminar_trainer_publish_stall_seconds", "gauge", "training stall of the last weight publish",
     ("trainer",), "publish_stall_s"),
    ("laminar_trainer_resident_bytes", "gauge", "resident set of the trainer's process (rank 0) after the last "
     "version: a growth from version to version ends in the kernel's OOM killer", ("trainer",), "rss_bytes"),
    ("laminar_trainer_mismatch_mean_abs", "gauge", "train-inference mismatch of the last version: mean "
     "|trainer - rollout| logprob of the same tokens under the same weights", ("trainer",), "mismatch_mean_abs"),
    ("laminar_trainer_mismatch_max_abs", "gauge", "train-inference mismatch of the last version: largest "
     "|trainer - rollout| logprob", ("trainer",), "mismatch_max_abs"),
    ("laminar_trainer_mismatch_k3", "gauge", "train-inference mismatch of the last version: k3 estimate of "
     "KL(rollout || trainer) per token", ("trainer",), "mismatch_k3"),
    ("laminar_trainer_groups_generated", "gauge", "groups the last version consumed: trained, or dropped for "
     "no reward spread by dynamic sampling", ("trainer",), "groups_generated"),
    ("laminar_trainer_groups_kept", "gauge", "groups of the last version with a reward spread (in the loss)",
     ("trainer",), "groups_kept"),
    ("laminar_trainer_groups_dropped_nosignal", "gauge", "groups the last version dropped for no spread "
     "(dynamic sampling: the extra generation it cost)", ("trainer",), "groups_dropped_nosignal"),
    ("laminar_eval_accuracy", "gauge", "held-out accuracy of the last evaluation, greedy answers",
     ("evaluator",), "eval_accuracy"),
    ("laminar_eval_accuracy_sampled", "gauge", "held-out accuracy of the last evaluation, sampled answers "
     "(mean over samples)", ("evaluator",), "eval_accuracy_sampled"),
    ("laminar_eval_version", "gauge", "weight version of the last evaluation", ("evaluator",), "eval_version"),
    ("laminar_reward_scored_total", "counter", "trajectories a reward replica scored and submitted", ("reward",),
     "reward_scored"),
    ("laminar_reward_batches_total", "counter", "batches a reward replica scored", ("reward",), "reward_batches"),
    ("laminar_reward_scoring_seconds_total", "counter", "seconds a reward replica spent scoring (rate over "
     "batches_total: the mean latency of a batch)", ("reward",), "reward_seconds"),
    ("laminar_reward_latency_p50_seconds", "gauge", "median seconds to score one batch (newest 256 batches)",
     ("reward",), "reward_p50"),
    ("laminar_reward_latency_max_seconds", "gauge", "slowest batch of the newest 256, seconds", ("reward",),
     "reward_max"),
    ("laminar_reward_queue_depth", "gauge", "trajectories awaiting this replica's scorer, not leased, at its "
     "last lease", ("reward",), "reward_queue"),
    ("laminar_reward_parse_failures_total", "counter", "judge answers the parser could not read (scored by the "
     "fallback)", ("reward",), "reward_parse_failures"),
    ("laminar_reward_failed_batches_total", "counter", "batches the backend could not score (left to their "
     "lease's expiry)", ("reward",), "reward_failed"),
    ("laminar_reward_scores_refused_total", "counter", "scores the pool refused (another replica's came "
     "first)", ("reward",), "reward_refused"),
    ("laminar_partial_pool_awaiting_reward", "gauge", "finished trajectories awaiting a model's score",
     ("partial_pool",), "awaiting"),
    ("laminar_partial_pool_awaiting_oldest_seconds", "gauge", "age of the oldest trajectory awaiting a score",
     ("partial_pool",), "awaiting_oldest_s"),
    ("laminar_partial_pool_reward_parse_failed_total", "counter", "scores applied that were a judge's "
     "fallback (unparseable answer)", ("partial_pool",), "parse_failed"),
    ("laminar_partial_pool_reward_lease_expired_total", "counter", "reward leases that expired (a replica died, "
     "hung or failed): the work handed out again", ("partial_pool",), "lease_expired"),
    ("laminar_partial_pool_reward_lease_shared_total", "counter", "leases of items already leased "
     "lease_shared_after_s without a score (a slow or sitting replica): the first score wins", ("partial_pool",),
     "lease_shared"),
    ("laminar_partial_pool_reward_late_scores_total", "counter", "scores refused as already applied",
     ("partial_pool",), "late_scores"),
    ("laminar_partial_pool_reward_gave_up_total", "counter", "trajectories given up on by their scorer and "
     "scored by the fallback (since the pool started)", ("partial_pool",), "gave_up"),
    ("laminar_partial_pool_reward_unserved_total", "counter", "trajectories given up on because no replica of "
     "their scorer leased them (a scorer nobody serves)", ("partial_pool",), "unserved"),
    ("laminar_partial_pool_reward_parked", "gauge", "scored trajectories the buffer refused for good, held back "
     "(the reward_parked alarm)", ("partial_pool",), "parked"),
    ("laminar_pool_writes_refused_total", "counter", "writes refused for want of a hand-out or a lease (a key "
     "writing work it was never given: the writes_refused alarm)", ("partial_pool", "experience_buffer"),
     "writes_refused"),
    ("laminar_manager_repacks_total", "counter", "repack moves executed", ("manager",), "repacks"),
    ("laminar_manager_moved_trajectories_total", "counter", "trajectories moved by repacks", ("manager",), "moved"),
    ("laminar_manager_dead_rollouts_total", "counter", "rollouts declared dead", ("manager",), "dead_rollouts"),
    ("laminar_manager_recovered_trajectories_total", "counter", "in-flight trajectories of dead rollouts "
     "resumed elsewhere", ("manager",), "recovered"),
    ("laminar_manager_failed_moves_total", "counter", "repack moves whose destination did not take every "
     "trajectory", ("manager",), "failed_moves"),
    ("laminar_manager_replaced_trajectories_total", "counter", "trajectories of a failed repack move placed "
     "on another rollout", ("manager",), "replaced"),
    ("laminar_manager_orphans", "gauge", "partials whose owner is no live rollout, waiting for a place",
     ("manager",), "orphans"),
    ("laminar_manager_chain_repairs_total", "counter", "relay chain repairs", ("manager",), "repairs"),
    ("laminar_manager_chain_last_repair_seconds", "gauge", "duration of the last chain repair", ("manager",),
     "last_repair_s"),
    ("laminar_manager_chain_epoch", "gauge", "epoch of the relay chain", ("manager",), "epoch"),
    ("laminar_manager_weights_stalled", "gauge", "1 while the weights_stalled alarm is raised: the rollouts' "
     "newest version lags the trainer's by more than stall_lag_versions for stall_after_s", ("manager",),
     "weights_stalled"),
    ("laminar_manager_weights_lag_versions", "gauge", "versions the trainer's newest leads the newest a live "
     "rollout serves (same lineage)", ("manager",), "weights_lag"),
    ("laminar_manager_weights_stalled_total", "counter", "times the weights_stalled alarm was raised",
     ("manager",), "weights_stalled_total"),
    ("laminar_prompt_pool_groups_handed_total", "counter", "GRPO groups the prompt pool handed out", ("prompt_pool",),
     "groups_handed"),
    ("laminar_prompt_pool_outstanding_groups", "gauge", "groups handed out and neither settled nor requeued",
     ("prompt_pool",), "outstanding"),
    ("laminar_prompt_pool_requeued_groups", "gauge", "groups waiting to be handed out again", ("prompt_pool",),
     "requeued"),
    ("laminar_prompt_pool_epoch", "gauge", "passes over the dataset so far", ("prompt_pool",), "epoch"),
    ("laminar_experience_buffer_stored", "gauge", "trajectories the buffer holds", ("experience_buffer",), "stored"),
    ("laminar_experience_buffer_capacity", "gauge", "trajectories the buffer may hold", ("experience_buffer",),
     "capacity"),
    ("laminar_experience_buffer_complete_groups", "gauge", "complete groups ready to be sampled",
     ("experience_buffer",), "complete_groups"),
    ("laminar_experience_buffer_leased_groups", "gauge", "groups leased to the trainer, not yet covered by a "
     "checkpoint", ("experience_buffer",), "leased"),
    ("laminar_partial_pool_in_flight", "gauge", "in-flight trajectories the partial pool holds", ("partial_pool",),
     "in_flight"),
    ("laminar_partial_pool_in_flight_tokens", "gauge", "generated tokens of those trajectories", ("partial_pool",),
     "in_flight_tokens"),
    ("laminar_gateway_episodes_open", "gauge", "agent episodes the rollouts hold open (claimed or waiting for an "
     "agent)", ("gateway",), "episodes_open"),
    ("laminar_gateway_episodes_active", "gauge", "open agent episodes an agent has claimed", ("gateway",),
     "episodes_active"),
    ("laminar_gateway_episodes_finished_total", "counter", "agent episodes stored", ("gateway",), "episodes_finished"),
    ("laminar_gateway_episodes_failed_total", "counter", "agent episodes that failed (stored untrained, or lost)",
     ("gateway",), "episodes_failed"),
    ("laminar_gateway_calls_total", "counter", "API calls of agent episodes served", ("gateway",), "agent_calls"),
    ("laminar_gateway_calls_per_episode", "gauge", "calls per episode that had any", ("gateway",),
     "calls_per_episode"),
    ("laminar_gateway_tokens_per_call", "gauge", "completion tokens per call (newest 4,096 calls)", ("gateway",),
     "tokens_per_call"),
    ("laminar_gateway_latency_p50_seconds", "gauge", "median seconds of an API call, generation included (newest "
     "4,096)", ("gateway",), "gateway_p50"),
    ("laminar_gateway_latency_p99_seconds", "gauge", "99th percentile seconds of an API call (newest 4,096)",
     ("gateway",), "gateway_p99"),
    ("laminar_gateway_history_rewrites_total", "counter", "calls whose context rewrote their episode's recorded "
     "history", ("gateway",), "history_rewrites"),
]

# written for every role (or the node itself) by HealthCollector.exposition
NODE_FAMILIES = ("laminar_node_info", "laminar_node_dropped_frames_total", "laminar_role_up", "laminar_role_state",
                 "laminar_role_restarts_total", "laminar_role_heartbeat_age_seconds", "laminar_role_uptime_seconds",
                 "laminar_role_dropped_frames_total", "laminar_eval_metric", "laminar_alarm")


def metric_names() -> set[str]:
    """Every series name the node exporter can write (the dashboard, laminar/dashboard.py, queries only these)."""
    return {f[0] for f in FAMILIES} | set(NODE_FAMILIES)
