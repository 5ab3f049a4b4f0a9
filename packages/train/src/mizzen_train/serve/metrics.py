"""Per-tenant counters and gauges, rendered as Prometheus text for ``/metrics``.

Exposed (label ``tenant`` everywhere but the slot gauges): operations by kind and outcome, the
queue depth of each tenant's models, executor-step latency (sum and count, and the last value),
tokens processed, and slot occupancy (``mizzen_serve_slots_used`` / ``..._total``).

Invariants: values are updated under one lock; label values are escaped per the text format
(backslash, quote, newline); nothing secret is a label (tenants are names from the key file).
"""

from __future__ import annotations

import threading
from collections import defaultdict

__all__ = ["ServeMetrics"]


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class ServeMetrics:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.ops: dict[tuple[str, str, str], int] = defaultdict(int)
        self.latency_sum: dict[tuple[str, str], float] = defaultdict(float)
        self.latency_count: dict[tuple[str, str], int] = defaultdict(int)
        self.token_count: dict[str, int] = defaultdict(int)
        self.batched_steps = 0
        self.batched_ops = 0

    def executed(self, group, seconds: float) -> None:
        with self._lock:
            self.batched_steps += 1
            self.batched_ops += len(group)
            for op in group:
                outcome = "failed" if op.failure else "ok"
                self.ops[(op.tenant, op.kind, outcome)] += 1
                self.latency_sum[(op.tenant, op.kind)] += seconds
                self.latency_count[(op.tenant, op.kind)] += 1

    def tokens(self, tenant: str, count: int) -> None:
        with self._lock:
            self.token_count[tenant] += count

    def render(self, *, depths: dict[str, int], slots_used: int, slots_total: int) -> str:
        lines = [
            "# TYPE mizzen_serve_operations_total counter",
            *(f'mizzen_serve_operations_total{{tenant="{_label(t)}",kind="{k}",outcome="{o}"}} {n}'
              for (t, k, o), n in sorted(self.ops.items())),
            "# TYPE mizzen_serve_step_seconds summary",
            *(f'mizzen_serve_step_seconds_sum{{tenant="{_label(t)}",kind="{k}"}} {v:.6f}'
              for (t, k), v in sorted(self.latency_sum.items())),
            *(f'mizzen_serve_step_seconds_count{{tenant="{_label(t)}",kind="{k}"}} {v}'
              for (t, k), v in sorted(self.latency_count.items())),
            "# TYPE mizzen_serve_tokens_total counter",
            *(f'mizzen_serve_tokens_total{{tenant="{_label(t)}"}} {v}'
              for t, v in sorted(self.token_count.items())),
            "# TYPE mizzen_serve_queue_depth gauge",
            *(f'mizzen_serve_queue_depth{{tenant="{_label(t)}"}} {v}'
              for t, v in sorted(depths.items())),
            "# TYPE mizzen_serve_slots_used gauge",
            f"mizzen_serve_slots_used {slots_used}",
            "# TYPE mizzen_serve_slots_total gauge",
            f"mizzen_serve_slots_total {slots_total}",
            "# TYPE mizzen_serve_executor_steps_total counter",
            f"mizzen_serve_executor_steps_total {self.batched_steps}",
            "# TYPE mizzen_serve_executor_operations_total counter",
            f"mizzen_serve_executor_operations_total {self.batched_ops}",
        ]  # fmt: skip
        return "\n".join(lines) + "\n"
