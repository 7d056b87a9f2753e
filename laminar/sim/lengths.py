"""Response-length distributions fit to a workload's summary statistics, and seeded sampling.

Design decisions:
- The workload file gives a mean and percentiles (p50/p90/p99) per task, nothing else. We fit a
  lognormal (right-skewed, heavy-ish tail: mean > median, p99 ≈ 5x the median, as reasoning
  lengths are) or, where the file notes "bimodal", a two-component lognormal mixture: that is the
  7B math workload, whose mean is *below* its median (a mass of short answers under a long mode).
- Lengths are clipped to [1, cap] (cap = max output tokens): the clipped distribution is what a
  rollout sees (a response that would run past the cap is cut there, finish reason "length").
  The fit matches the statistics *of the clipped distribution*: quantiles below the cap are
  unaffected, the mean uses E[min(X, cap)] in closed form.
- Fit = least squares on log(model stat / target stat) over whatever statistics are given,
  minimised by Nelder-Mead (numpy only; scipy is not a dependency).
- The mixture is not identified by four statistics: fits whose short mode sits anywhere from ~10
  to ~1,500 tokens all match 7B_math within 2% (the optimum left free is a spike of 8-token
  answers, which no reasoning model produces). So the short mode's median is a stated assumption,
  `BIMODAL_SHORT_FRACTION` × p50 (≈1,000 tokens for 7B_math: an answer without long reasoning),
  overridable per fit; the weight, the long mode's median and one shared sigma are fitted
  (three parameters, four statistics).
- Sampling goes through the standard normal: a length is `from_z(z)`, the quantile function at
  Φ(z), tabulated once per distribution on a z grid (linear in log-length between points). A
  request's z comes from its seed (`z_from_key`), so one seed always gives one length, in any
  process: that is what lets a migrated trajectory finish at the length it would have had.
- GRPO groups: `sample_groups(..., rho)` draws z = √ρ·z_prompt + √(1−ρ)·z_response, a Gaussian
  copula that keeps the marginal exactly (the paper's statistics hold for any ρ) while making the
  responses to one prompt alike. Harder prompts do produce longer reasoning for every sample, so
  ρ > 0 is realistic, but the workload file has no within-group statistic to set it from: the
  default is ρ = 0 (independent lengths) and a study that wants correlation must state its ρ.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import cached_property
from statistics import NormalDist

import numpy as np

from laminar.sim import load_workload

_N = NormalDist()
_erf = np.vectorize(math.erf, otypes=[float])
_Z_GRID = np.linspace(-7.0, 7.0, 897)  # 1/64 steps; Φ(±7) is 1e-12 from 0 or 1
BIMODAL_SHORT_FRACTION = 1 / 6  # median of the short mode ÷ overall p50 (module docstring)


def _phi(x: float) -> float:
    return 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))


@dataclass(frozen=True)
class LengthDistribution:
    """A mixture of lognormals (weights, mus, sigmas of log-length) clipped to [1, cap]."""
    weights: tuple[float, ...]
    mus: tuple[float, ...]
    sigmas: tuple[float, ...]
    cap: int
    name: str = ""

    # -- analytic statistics of the clipped distribution ---------------------------------------
    def cdf(self, x: float) -> float:
        """P(length <= x) before rounding; 1 at and above the cap."""
        if x >= self.cap:
            return 1.0
        if x <= 0:
            return 0.0
        lx = math.log(x)
        return sum(w * _phi((lx - m) / s) for w, m, s in zip(self.weights, self.mus, self.sigmas, strict=False))

    def quantile(self, q: float) -> float:
        """The q-quantile (bisection on log-length; the cap for q at or above P(X < cap))."""
        lo = min(m - 9 * s for m, s in zip(self.mus, self.sigmas, strict=False))
        hi = math.log(self.cap)
        if self.cdf(math.exp(hi) * (1 - 1e-12)) <= q:
            return float(self.cap)
        for _ in range(80):
            mid = 0.5 * (lo + hi)
            lo, hi = (mid, hi) if self.cdf(math.exp(mid)) < q else (lo, mid)
        return math.exp(0.5 * (lo + hi))

    def mean(self) -> float:
        """E[min(X, cap)] = Σ w (e^{μ+σ²/2} Φ((ln c − μ − σ²)/σ) + c (1 − Φ((ln c − μ)/σ)))."""
        lc = math.log(self.cap)
        return sum(w * (math.exp(m + s * s / 2) * _phi((lc - m - s * s) / s) + self.cap * (1 - _phi((lc - m) / s)))
                   for w, m, s in zip(self.weights, self.mus, self.sigmas, strict=False))

    def stat(self, key: str) -> float:
        return self.mean() if key == "mean" else self.quantile(int(key[1:]) / 100.0)

    def summary(self) -> dict[str, float]:
        return {k: round(self.stat(k), 1) for k in ("mean", "p50", "p90", "p99")}

    # -- sampling ---------------------------------------------------------------------------------
    @cached_property
    def _log_quantiles(self) -> np.ndarray:
        """log-length at Φ(z) for every z of the grid (vectorized bisection)."""
        u = np.array([_N.cdf(z) for z in _Z_GRID])
        lo = np.full_like(u, min(m - 9 * s for m, s in zip(self.mus, self.sigmas, strict=False)))
        hi = np.full_like(u, math.log(self.cap))
        for _ in range(60):
            mid = 0.5 * (lo + hi)
            f = sum(w * 0.5 * (1 + _erf((mid - m) / (s * math.sqrt(2))))
                    for w, m, s in zip(self.weights, self.mus, self.sigmas, strict=False))
            below = f < u
            lo, hi = np.where(below, mid, lo), np.where(below, hi, mid)
        return 0.5 * (lo + hi)

    def from_z(self, z):
        """Length(s) at standard-normal value(s) z: int for a scalar, int array for an array."""
        x = np.exp(np.interp(z, _Z_GRID, self._log_quantiles))
        out = np.clip(np.rint(x), 1, self.cap).astype(np.int64)
        return int(out) if np.ndim(out) == 0 else out

    def sample(self, rng: np.random.Generator | int, n: int) -> np.ndarray:
        rng = np.random.default_rng(rng) if not isinstance(rng, np.random.Generator) else rng
        return self.from_z(rng.standard_normal(n))

    # -- fitting ---------------------------------------------------------------------------------
    @classmethod
    def fit(cls, stats: dict, cap: int, components: int | None = None, name: str = "",
            short_median: float | None = None) -> LengthDistribution:
        """Fit to {"mean": .., "p50": .., "p90": .., "p99": ..} (any subset with >= 2 entries;
        "note": "bimodal" asks for two components, the short one with median `short_median`,
        default BIMODAL_SHORT_FRACTION × p50)."""
        targets = {k: float(v) for k, v in stats.items() if k == "mean" or (k[:1] == "p" and k[1:].isdigit())}
        if len(targets) < 2:
            raise ValueError(f"length statistics {name!r}: need at least two of mean/pNN, got {sorted(stats)}")
        if components is None:
            components = 2 if "bimodal" in str(stats.get("note", "")).lower() else 1
        med = targets.get("p50", targets.get("mean"))
        mu_short = math.log(short_median or med * BIMODAL_SHORT_FRACTION)

        def build(theta) -> LengthDistribution:
            if components == 1:
                return cls((1.0,), (theta[0],), (math.exp(theta[1]),), cap, name)
            w, s = 1 / (1 + math.exp(-theta[0])), math.exp(theta[2])
            return cls((w, 1 - w), (mu_short, theta[1]), (s, s), cap, name)

        def loss(theta) -> float:
            d = build(theta)
            return sum((math.log(d.stat(k)) - math.log(v)) ** 2 for k, v in targets.items())

        if components == 1:
            starts = [np.array([math.log(med), math.log(0.6)])]
        else:  # a few splits between the modes; keep the best
            starts = [np.array([math.log(w / (1 - w)), math.log(med * 1.2), math.log(0.3)]) for w in (0.1, 0.3)]
        best = min((_nelder_mead(loss, x0) for x0 in starts), key=lambda r: r[1])
        return build(best[0])


def _nelder_mead(f, x0: np.ndarray, step: float = 0.25, iters: int = 1500, tol: float = 1e-14):
    """Minimise f from x0 (standard reflection/expansion/contraction/shrink); (x, f(x))."""
    n = len(x0)
    pts = [x0.astype(float)] + [x0 + step * np.eye(n)[i] for i in range(n)]
    vals = [f(p) for p in pts]
    for _ in range(iters):
        order = np.argsort(vals)
        pts, vals = [pts[i] for i in order], [vals[i] for i in order]
        if vals[-1] - vals[0] < tol:
            break
        c = np.mean(pts[:-1], axis=0)
        xr = c + (c - pts[-1])
        fr = f(xr)
        if fr < vals[0]:
            xe = c + 2 * (c - pts[-1])
            fe = f(xe)
            pts[-1], vals[-1] = (xe, fe) if fe < fr else (xr, fr)
        elif fr < vals[-2]:
            pts[-1], vals[-1] = xr, fr
        else:
            xc = c + 0.5 * (pts[-1] - c)
            fc = f(xc)
            if fc < vals[-1]:
                pts[-1], vals[-1] = xc, fc
            else:
                pts = [pts[0]] + [pts[0] + 0.5 * (p - pts[0]) for p in pts[1:]]
                vals = [vals[0]] + [f(p) for p in pts[1:]]
    i = int(np.argmin(vals))
    return pts[i], vals[i]


_FITS: dict[str, LengthDistribution] = {}


def workload_lengths(name: str, workload: dict | None = None, cap: int | None = None) -> LengthDistribution:
    """The fitted distribution of workload `name` (e.g. '32B_math'); cap = the run's max output.
    Fitted once per process for the same statistics and cap (a distribution is read-only): a
    cluster of 128 sim rollouts built 128 identical fits, 13% of a 72B/1,024 sync run's CPU."""
    if workload is None:
        workload = load_workload()
    table = workload["response_length_tokens"]
    if name not in table:
        raise KeyError(f"no response-length statistics {name!r}; available: {sorted(table)}")
    cap = cap or int(workload.get("run_shape", {}).get("max_output_tokens", 16384))
    key = json.dumps([name, cap, table[name]], sort_keys=True, default=str)
    if key not in _FITS:
        _FITS[key] = LengthDistribution.fit(table[name], cap, name=name)
    return _FITS[key]


def z_from_key(key: int, stream: int = 0) -> float:
    """A standard-normal value determined by an integer key (a seed, a prompt hash): the same in
    every process and Python version (splitmix64's mixer; no hash randomization)."""
    x = (key + (stream + 1) * 0x9E3779B97F4A7C15) & (2 ** 64 - 1)
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & (2 ** 64 - 1)
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & (2 ** 64 - 1)
    x ^= x >> 31
    u = ((x >> 11) + 0.5) / 2 ** 53  # in (0, 1)
    return _N.inv_cdf(u)


def sample_groups(dist: LengthDistribution, rng: np.random.Generator | int, n_groups: int,
                  group_size: int, rho: float = 0.0) -> np.ndarray:
    """(n_groups, group_size) lengths; within a group correlated through ρ (module docstring)."""
    if not 0 <= rho <= 1:
        raise ValueError(f"rho must be in [0, 1], got {rho}")
    rng = np.random.default_rng(rng) if not isinstance(rng, np.random.Generator) else rng
    z = (math.sqrt(rho) * rng.standard_normal((n_groups, 1))
         + math.sqrt(1 - rho) * rng.standard_normal((n_groups, group_size)))
    return dist.from_z(z)
