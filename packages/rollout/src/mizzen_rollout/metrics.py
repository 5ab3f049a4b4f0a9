"""Rollout metrics: throughput, latency percentiles, status counts, rewards.

Invariants:
- Computed from the samples of a batch plus its wall time, nothing else: the same samples give
  the same metrics (so they can be recomputed from a samples file).
- ``percentile`` interpolates linearly between order statistics (numpy's default); empty input
  gives 0.0 rather than NaN so summaries stay printable.
- Per-sample latency and serving engine are read from ``metadata["latency_s"]`` and
  ``metadata["engine"]`` (set by :mod:`mizzen_rollout.rollout`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from .samples import Sample, SampleStatus

__all__ = ["LatencyStats", "RolloutMetrics", "percentile"]


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) with linear interpolation; 0.0 for no values."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q is {q}; use a value in [0, 100]")
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclass(frozen=True)
class LatencyStats:
    count: int = 0
    mean: float = 0.0
    p50: float = 0.0
    p90: float = 0.0
    p99: float = 0.0
    max: float = 0.0

    @classmethod
    def of(cls, values: Sequence[float]) -> LatencyStats:
        if not values:
            return cls()
        return cls(
            count=len(values),
            mean=sum(values) / len(values),
            p50=percentile(values, 50),
            p90=percentile(values, 90),
            p99=percentile(values, 99),
            max=max(values),
        )


@dataclass
class RolloutMetrics:
    num_groups: int = 0
    num_samples: int = 0
    status_counts: dict[str, int] = field(default_factory=dict)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    wall_s: float = 0.0
    latency: LatencyStats = field(default_factory=LatencyStats)
    num_scored: int = 0
    reward_mean: float | None = None
    requests_per_engine: dict[str, int] = field(default_factory=dict)
    dropped_groups: int = 0
    engine_deaths: int = 0
    reissued_requests: int = 0

    @property
    def tokens_per_s(self) -> float:
        """Completion tokens per second of wall time."""
        return self.completion_tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def samples_per_s(self) -> float:
        return self.num_samples / self.wall_s if self.wall_s > 0 else 0.0

    @classmethod
    def from_samples(
        cls, samples: Iterable[Sample], *, num_groups: int, wall_s: float, **extra: Any
    ) -> RolloutMetrics:
        samples = list(samples)
        statuses = Counter(s.status.value for s in samples)
        rewards = [s.reward for s in samples if s.reward is not None]
        latencies = [float(s.metadata["latency_s"]) for s in samples if "latency_s" in s.metadata]
        engines = Counter(str(s.metadata["engine"]) for s in samples if s.metadata.get("engine"))
        prompt_tokens = sum(
            len(s.prompt_tokens) or int(s.metadata.get("prompt_token_count", 0)) for s in samples
        )
        completion_tokens = sum(
            len(s.response_tokens) or int(s.metadata.get("completion_token_count", 0))
            for s in samples
        )
        return cls(
            num_groups=num_groups,
            num_samples=len(samples),
            status_counts={st.value: statuses.get(st.value, 0) for st in SampleStatus},
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            wall_s=wall_s,
            latency=LatencyStats.of(latencies),
            num_scored=len(rewards),
            reward_mean=(sum(rewards) / len(rewards)) if rewards else None,
            requests_per_engine=dict(sorted(engines.items())),
            **extra,
        )

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["tokens_per_s"] = self.tokens_per_s
        out["samples_per_s"] = self.samples_per_s
        return out

    def summary_lines(self) -> list[str]:
        statuses = "  ".join(f"{k} {v}" for k, v in self.status_counts.items() if k != "pending")
        reward = (
            f"mean {self.reward_mean:.3f} over {self.num_scored} scored"
            if self.reward_mean is not None
            else "none scored"
        )
        lat = self.latency
        lines = [
            f"samples    {self.num_samples} in {self.num_groups} groups "
            f"({self.dropped_groups} groups dropped by filters)",
            f"status     {statuses}",
            f"reward     {reward}",
            f"tokens     prompt {self.prompt_tokens}  completion {self.completion_tokens}  "
            f"throughput {self.tokens_per_s:.1f} tok/s  ({self.samples_per_s:.2f} samples/s, "
            f"wall {self.wall_s:.2f} s)",
            f"latency    p50 {lat.p50:.3f} s  p90 {lat.p90:.3f} s  p99 {lat.p99:.3f} s  "
            f"max {lat.max:.3f} s",
        ]
        if self.requests_per_engine:
            per = "  ".join(f"{k}: {v}" for k, v in self.requests_per_engine.items())
            lines.append(f"engines    {per}")
        if self.engine_deaths or self.reissued_requests:
            lines.append(
                f"faults     {self.engine_deaths} engine death(s), "
                f"{self.reissued_requests} request(s) re-issued"
            )
        return lines
