"""Weight broadcast benchmark (docs/architecture.md §6): the relay chain vs naive fan-out vs torch.distributed
(gloo) vs one raw socket transfer, on an emulated cluster network; plus the trainer's publish stall,
the local pull rate and what authenticating the chunk links costs, on loopback. Prints tables,
writes JSON.

    sudo python bench/broadcast.py --quick --out runs/bench/broadcast.json   # S 64 MiB, K 1 and 8
    sudo python bench/broadcast.py --out runs/bench/broadcast_full.json      # S 256 MiB + 1 GiB
    python bench/broadcast.py --skip-network --out runs/bench/broadcast_local.json  # loopback only

Authentication (bench/broadcast_auth.py): publisher -> relay -> relay on loopback with every
message MAC'd and versions signed (`full`, what runs) vs the same code with the crypto replaced by
no-ops (`none`) and with chunk digests only (`digests`, the per-byte work of protocol 2), each in a
process of its own, in turn; throughput ratios from the same run (key `auth`).

Network: host 0 (the trainer) and K relay hosts in network namespaces on a bridge, every egress
shaped to R (laminar/testing/netns.py); one agent process per host (bench/broadcast_agent.py)
runs the real data-plane code. A transfer of S bytes over one link is limited to S/R, so the raw
single transfer is the physical limit and every method is reported as a ratio to it:
  chain   publisher (host 0) -> relay 1 -> ... -> relay K, pipelined in chunks;
  fanout  host 0 sends the version to each relay itself (its egress R is shared K ways);
  gloo    torch.distributed.broadcast from rank 0 among the same K+1 hosts;
  raw     one plain socket transfer host 0 -> host 1.
Time = from the start on host 0 until the last relay holds the whole version (for the chain and
fan-out: made visible, i.e. verified and committed). Steady state: one untimed version goes down
the whole chain first (relays and the publisher allocate their buffers once, then reuse them). CPU
use is the machine's busy share during each run (/proc/stat), to show the cores were not what
limited it; for the chain, each row also has `relay_cpu_s`, the CPU seconds (user + system, every
thread, from rusage) a relay's process used for that one version, averaged over the K relays
(`relay_cpu_max_s` the busiest, `relay_system_s` the kernel's part, `relay_switches` its threads'
wake-ups: voluntary context switches), and the summary their median
over the rounds at K = 8 (`relay_cpu_s_k8`): a measure of the relays' own work that, unlike the
ratios, load on the machine moves much less. `--net-repeats N` runs every method N times (raw
first in each round, each round's ratios to its own raw transfer): the ratios are the medians over
the rounds, with their spread.
Chunks are 256 KiB unless `--chunk-mib` says otherwise (CHUNK_MIB says why).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import broadcast_auth  # noqa: E402
import broadcast_local  # noqa: E402
from _common import print_table, write_json  # noqa: E402

MiB = 1 << 20
# The chain forwards a chunk once it has all arrived and its digest checked, so relay K holds the
# last byte (K - 1) chunk times after relay 1 does: a pipeline's fill, (K - 1) * chunk / S of one
# transfer. With S = 64 MiB and K = 8, 1 MiB chunks cost 7/64 = 11% (what this bench measured,
# 1.11 x raw); 256 KiB chunks cost 2.7%, and their per-chunk work (a header, its MAC, a wakeup)
# stays far below the link's time per chunk (5 ms at 400 Mbit/s).
CHUNK_MIB = 0.25
ROOT = Path(__file__).resolve().parents[1]


def cpu_ticks() -> tuple[int, int]:
    f = [int(x) for x in open("/proc/stat").readline().split()[1:]]
    idle = f[3] + f[4]
    return sum(f) - idle, sum(f)


class Agents:
    """One agent per namespace host; `call` sends to several, then gathers their replies."""

    def __init__(self, net, n: int):
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.shm_prefix = f"/dev/shm/laminar-bench-{net.prefix}-h"
        self.procs = [net.popen(i, [sys.executable, str(ROOT / "bench" / "broadcast_agent.py"), net.address(i),
                                    f"{self.shm_prefix}{i}"],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env) for i in range(n)]

    def call(self, cmds: dict[int, dict]) -> dict[int, dict]:
        for i, cmd in cmds.items():
            self.procs[i].stdin.write(json.dumps(cmd) + "\n")
            self.procs[i].stdin.flush()
        out = {}
        for i in cmds:
            line = self.procs[i].stdout.readline()
            if not line:
                raise RuntimeError(f"agent {i} died (exit {self.procs[i].poll()})")
            out[i] = json.loads(line)
            if "error" in out[i]:
                raise RuntimeError(f"agent {i}: {out[i]['error']}")
        return out

    def one(self, i: int, **cmd) -> dict:
        return self.call({i: cmd})[i]

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    p.stdin.write(json.dumps({"op": "quit"}) + "\n")
                    p.stdin.flush()
                except (BrokenPipeError, OSError):
                    pass
        for p in self.procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()  # only the agents this program started
                p.wait(5)
        for i in range(len(self.procs)):  # a killed agent cannot clean its store: do it here
            shutil.rmtree(f"{self.shm_prefix}{i}", ignore_errors=True)


class Bench:
    def __init__(self, agents: Agents, chunk_mib: float):
        self.a, self.chunk_mib = agents, chunk_mib
        self.version = 0
        self.addresses: dict[int, str] = {}

    def start_relays(self, k_max: int) -> None:
        got = self.a.call({i: {"op": "relay"} for i in range(1, k_max + 1)})
        self.addresses = {i: r["address"] for i, r in got.items()}

    def _wait(self, relays: list[int], version: int, timeout: float) -> float:
        got = self.a.call({i: {"op": "wait_visible", "version": version, "timeout": timeout} for i in relays})
        missing = [i for i, r in got.items() if not r["ok"]]
        if missing:
            raise RuntimeError(f"relays {missing} did not get v{version} within {timeout}s")
        self.last_times = [got[i]["t"] for i in relays]
        return max(self.last_times)

    def raw(self, nbytes: int) -> float:
        addr = self.a.one(1, op="raw_listen", nbytes=nbytes)["address"]
        t0 = self.a.one(0, op="raw_send", address=addr, nbytes=nbytes)["t0"]
        return self.a.one(1, op="raw_wait")["t"] - t0

    def chain(self, nbytes: int, k: int, timeout: float) -> float:
        for i in range(1, k + 1):
            self.a.one(i, op="link", address=self.addresses[i + 1] if i < k else "")
        self.a.one(0, op="target", address=self.addresses[1], chunk_mib=self.chunk_mib)
        if self.version:  # untimed: newly linked relays first catch up with relay 1's version
            self._wait(list(range(1, k + 1)), self.version, timeout)
        self.version += 1
        relays = list(range(1, k + 1))
        cpu0 = self._cpu(relays)
        t0 = self.a.one(0, op="publish", version=self.version, nbytes=nbytes)["t0"]
        secs = self._wait(relays, self.version, timeout) - t0
        cpu1 = self._cpu(relays)
        self.relay_cpu = [b["cpu_s"] - a["cpu_s"] for a, b in zip(cpu0, cpu1, strict=True)]
        self.relay_sys = [b["system_s"] - a["system_s"] for a, b in zip(cpu0, cpu1, strict=True)]
        self.relay_switches = [b.get("switches", 0) - a.get("switches", 0) for a, b in zip(cpu0, cpu1, strict=True)]
        return secs

    def _cpu(self, relays: list[int]) -> list[dict]:
        """CPU seconds (cpu_s = user + system, every thread; system_s) each relay's process used so far."""
        got = self.a.call({i: {"op": "cpu"} for i in relays})
        return [got[i] for i in relays]

    def fanout(self, nbytes: int, k: int, timeout: float) -> float:
        for i in range(1, k + 1):
            self.a.one(i, op="link", address="")
        self.version += 1
        t0 = self.a.one(0, op="fanout", version=self.version, nbytes=nbytes, chunk_mib=self.chunk_mib,
                        addresses=[self.addresses[i] for i in range(1, k + 1)])["t0"]
        return self._wait(list(range(1, k + 1)), self.version, timeout) - t0

    def gloo(self, nbytes: int, k: int, master: str) -> float:
        port = random.randint(20000, 60000)
        got = self.a.call({i: {"op": "gloo", "rank": i, "world": k + 1, "master": master, "port": port,
                               "nbytes": nbytes} for i in range(k + 1)})
        return max(r["t1"] for r in got.values()) - got[0]["t0"]


def measure(fn, *args) -> tuple[float, float]:
    b0, t0 = cpu_ticks()
    secs = fn(*args)
    b1, t1 = cpu_ticks()
    return secs, 100.0 * (b1 - b0) / max(1, t1 - t0)


def measure_row(b: Bench, net, method: str, s: int, k: int, fn, timeout: float) -> dict:
    """One timed transfer of `method` (a row; a failure is kept in it, not raised, unless an agent died)."""
    row = dict(size_mib=s // MiB, k=k, method=method)
    try:
        if fn is None:
            row["seconds"], row["cpu_pct"] = measure(b.gloo, s, k, net.address(0))
        else:
            row["seconds"], row["cpu_pct"] = measure(fn, s, k, timeout)
            row["relay_spread_s"] = max(b.last_times) - min(b.last_times)
            if method == "chain":  # CPU-s per relay for this one version: mean, and the busiest relay
                row["relay_cpu_s"] = statistics.mean(b.relay_cpu)
                row["relay_cpu_max_s"] = max(b.relay_cpu)
                row["relay_system_s"] = statistics.mean(b.relay_sys)
                row["relay_switches"] = statistics.mean(b.relay_switches)  # wake-ups per relay per version
    except RuntimeError as exc:  # keep what was measured; say what was not
        row["error"] = str(exc)[:300]
        print(f"  {method} S={s // MiB} MiB K={k}: FAILED: {row['error']}", flush=True)
        if "died" in row["error"]:
            raise
    return row


def one_size(args, b: Bench, net, agents: Agents, s: int, ks: list[int], rows: list[dict], checkpoint) -> None:
    """Every method at size `s`, `args.net_repeats` times: raw first, then the chain for K
    descending (every relay stays in sync, so no catch-up is needed), fan-out; gloo (which frees
    the relays) in the last repeat only. Each row's ratios are to its own repeat's raw transfer."""
    k_max = max(ks)
    b.start_relays(k_max)  # fresh stores: at most two versions per relay in memory
    limit = s / (args.rate_mbit * 1e6 / 8)
    timeout = 10 * k_max * limit + 30
    b.chain(s, k_max, timeout)  # untimed warm-up: buffers allocated, as in steady state
    for rep in range(args.net_repeats):
        last = rep == args.net_repeats - 1
        raw_s, cpu = measure(b.raw, s)
        mine = [dict(size_mib=s // MiB, k=1, method="raw", seconds=raw_s, cpu_pct=cpu, rep=rep)]
        plan = [("chain", k, b.chain) for k in sorted(ks, reverse=True)] + \
               [("fanout", k, b.fanout) for k in ks] + ([("gloo", k, None) for k in ks] if last else [])
        for method, k, fn in [p for p in plan if p[0] in args.methods]:
            if method == "gloo" and b.addresses:  # free the relays' memory for gloo's
                agents.call({i: {"op": "reset"} for i in b.addresses})
                b.addresses = {}
            mine.append({**measure_row(b, net, method, s, k, fn, timeout), "rep": rep})
            if checkpoint:
                checkpoint(rows + mine)
        for r in mine:
            if "seconds" in r:
                r["over_raw"] = r["seconds"] / raw_s
                r["over_limit"] = r["seconds"] / limit
        rows += mine


def network_part(args, sizes: list[int], ks: list[int], checkpoint=None) -> tuple[list[dict], dict]:
    from laminar.testing.netns import NetnsCluster
    k_max = max(ks)
    rows: list[dict] = []
    with NetnsCluster(k_max + 1, args.rate_mbit) as net:
        agents = Agents(net, k_max + 1)
        try:
            agents.call({i: {"op": "import_torch"} for i in range(k_max + 1)})
            b = Bench(agents, args.chunk_mib)
            for s in sizes:
                one_size(args, b, net, agents, s, ks, rows, checkpoint)
        finally:
            agents.close()
    return rows, {"rate_mbit": args.rate_mbit, "namespaces": "cleaned up"}


def summary(rows: list[dict], size_mib: int, k: int) -> dict:
    """The ratios at `size_mib` and `k`: each repeat's from its own rows, their median, and with
    several repeats `<key>_spread`, (max - min) / median over them."""
    per = []
    for rep in sorted({r.get("rep", 0) for r in rows}):
        t = {r["method"]: r.get("seconds") for r in rows if r["size_mib"] == size_mib and r.get("rep", 0) == rep
             and (r["k"] == k or r["method"] == "raw")}

        def ratio(a: str, b: str, t=t) -> float | None:  # None where a measurement failed
            return t[a] / t[b] if t.get(a) and t.get(b) else None
        cpu = [r.get("relay_cpu_s") for r in rows if r["size_mib"] == size_mib and r.get("rep", 0) == rep
               and r["method"] == "chain" and r["k"] == k]
        per.append({f"chain_over_raw_k{k}": ratio("chain", "raw"), f"fanout_over_chain_k{k}": ratio("fanout", "chain"),
                    f"gloo_over_chain_k{k}": ratio("gloo", "chain"), f"relay_cpu_s_k{k}": cpu[0] if cpu else None})
    out: dict = {}
    for key in per[0] if per else []:
        vals = [p[key] for p in per if p[key] is not None]
        out[key] = statistics.median(vals) if vals else None
        if len(vals) > 1:
            out[f"{key}_spread"] = (max(vals) - min(vals)) / out[key]
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="S = 64 MiB, K in {1, 8} (under 60 s)")
    p.add_argument("--out", default=None, help="JSON output file")
    p.add_argument("--rate-mbit", type=float, default=400.0, help="egress rate R of every emulated host")
    p.add_argument("--chunk-mib", type=float, default=CHUNK_MIB,
                   help=f"chunk size of the chain and fan-out, MiB (default {CHUNK_MIB:g}: see CHUNK_MIB)")
    p.add_argument("--sizes-mib", type=int, nargs="*", default=None, help="override S (MiB)")
    p.add_argument("--ks", type=int, nargs="*", default=None, help="override K")
    p.add_argument("--methods", nargs="*", default=["chain", "fanout", "gloo"], help="which to measure (raw always)")
    p.add_argument("--skip-network", action="store_true", help="loopback measurements only (no root)")
    p.add_argument("--skip-auth", action="store_true", help="leave out the cost of authenticated links")
    p.add_argument("--net-repeats", type=int, default=1,
                   help="timed rounds of every method over the namespaces (raw first in each; ratios per round, "
                        "their median and spread)")
    p.add_argument("--auth-rounds", type=int, default=2, help="processes per mode in the authentication part")
    args = p.parse_args()
    sizes = [s * MiB for s in (args.sizes_mib or ([64] if args.quick else [256, 1024]))]
    ks = args.ks or ([1, 8] if args.quick else [1, 2, 4, 8, 16])
    t_start = time.time()

    local = broadcast_local.run(sizes[0], int(args.chunk_mib * MiB), reps=3 if args.quick else 7)
    gc.collect()  # return the loopback run's buffers before the agents need the memory
    print_table(f"loopback, unshaped, S = {sizes[0] // MiB} MiB", ["measure", "value"],
                [[k, v] for k, v in local.items()])
    out = {"sizes_mib": [s // MiB for s in sizes], "ks": ks, "chunk_mib": args.chunk_mib, "local": local,
           "publish_stall_over_memcpy": local["publish_stall_over_memcpy"],
           "pull_over_memcpy": local["pull_over_memcpy"]}
    if not args.skip_auth:
        auth = broadcast_auth.run(sizes[0], int(args.chunk_mib * MiB), reps=3 if args.quick else 5,
                                  rounds=args.auth_rounds)
        print_table(f"authenticated chunk links, loopback, publisher -> relay -> relay, S = {sizes[0] // MiB} MiB",
                    broadcast_auth.TABLE, broadcast_auth.table_rows(auth))
        out.update(auth=auth, auth_full_over_none=auth["full_over_none"],
                   auth_full_over_digests=auth["full_over_digests"], auth_cpu_full_over_none=auth["cpu_full_over_none"])
    if not args.skip_network:
        partial = Path(args.out + ".partial") if args.out else None
        rows, net = network_part(args, sizes, ks, checkpoint=(lambda rs: partial.write_text(
            json.dumps({**out, "rows": rs}, indent=1, default=str))) if partial else None)
        if partial:
            partial.unlink(missing_ok=True)
        out.update(net, rows=rows)
        print_table(f"broadcast over namespaces, R = {args.rate_mbit:g} Mbit/s, chunk {args.chunk_mib:g} MiB",
                    ["round", "S MiB", "K", "method", "seconds", "x raw", "x S/R", "cpu %", "relay cpu s",
                     "max relay cpu s"],
                    [[r["rep"], r["size_mib"], r["k"], r["method"], r.get("seconds", "FAILED"), r.get("over_raw", "-"),
                      r.get("over_limit", "-"), r.get("cpu_pct", "-"), r.get("relay_cpu_s", "-"),
                      r.get("relay_cpu_max_s", "-")] for r in rows])
        k_ref = 8 if 8 in ks else max(ks)
        for s in sizes:
            out[f"summary_{s // MiB}mib"] = summary(rows, s // MiB, k_ref)
        out.update(out[f"summary_{sizes[0] // MiB}mib"])
    keys = [k for k in ("chain_over_raw_k8", "chain_over_raw_k8_spread", "relay_cpu_s_k8", "fanout_over_chain_k8",
                        "gloo_over_chain_k8",
                        "publish_stall_over_memcpy", "pull_over_memcpy", "auth_full_over_none",
                        "auth_full_over_digests", "auth_cpu_full_over_none") if k in out]
    print_table("summary", ["key", "value"], [[k, out[k]] for k in keys])
    out["wall_s"] = time.time() - t_start
    print(f"\ntotal {out['wall_s']:.1f} s")
    write_json(args.out, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
