"""Property: whatever order sessions open, end, publish unnamed weights and sample, the sampling
bookkeeping of :class:`mizzen_train.serve.sampling.Sampling` keeps its bounds.

The real ``Sampling`` on a real ``ServerState`` and a parsed server configuration; the engine is
not started (every adapter is marked loaded before it is published, so no load is asked).
Invariants checked after every step:

- a key holds at most ``server.max_sampling_sessions_per_key`` sampling sessions, and the
  recency lists hold exactly the live sessions;
- every live sampling session's parent session is live (none survives or opens in an ended one);
- unnamed sampler weights exist on disk exactly while a live sampling session samples them.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from mizzen_ci import register_cpu_ci

register_cpu_ci(est_time=15, labels=["train"])

TENANTS = ("alice", "bob")
PARENTS = ("p0", "p1", "p2")
CAP = 2

steps = st.lists(
    st.one_of(
        st.tuples(st.just("open"), st.sampled_from(PARENTS)),
        st.tuples(st.just("end"), st.sampled_from(PARENTS)),
        st.tuples(st.just("base"), st.sampled_from(TENANTS), st.sampled_from(PARENTS)),
        st.tuples(st.just("publish"), st.sampled_from(TENANTS), st.sampled_from(PARENTS)),
        st.tuples(st.just("use"), st.sampled_from(TENANTS), st.integers(0, 7)),
    ),
    max_size=40,
)


def _sampling(root: Path):
    from mizzen_train.serve.config import parse_serve_config
    from mizzen_train.serve.sampling import Sampling
    from mizzen_train.serve.state import ModelRecord, ServerState

    keys = root / "keys"
    keys.write_text("".join(f"{t} tml-{t}-{'0' * 24}{i}\n" for i, t in enumerate(TENANTS)))
    server = {"state_dir": str(root / "state"), "api_keys_file": str(keys),
              "max_sampling_sessions_per_key": CAP}  # fmt: skip
    config = parse_serve_config({"server": server, "model": {"path": "tiny"}})
    state = ServerState(root / "state")
    for tenant in TENANTS:
        state.add_model(ModelRecord(f"m-{tenant}", tenant, "tiny", 2, 0, 0.0))
    return Sampling(config, state), state


@settings(max_examples=150, deadline=None)
@given(steps)
def test_sampling_sessions_and_unnamed_weights_stay_bounded(plan):
    from mizzen_train.serve.wire import WireError

    with tempfile.TemporaryDirectory() as tmp:
        sampling, state = _sampling(Path(tmp))
        live_parents = set(PARENTS[:2])  # p2 is opened (or not) by the plan
        for parent in live_parents:
            sampling.open_parent(parent)
        published: list[Path] = []
        for number, step in enumerate(plan):
            kind = step[0]
            if kind == "open":
                sampling.open_parent(step[1])
                live_parents.add(step[1])
            elif kind == "end":
                sampling.end_sessions_of(step[1])
                live_parents.discard(step[1])
            elif kind == "use":
                mine = [sid for sid, s in sampling.sessions.items() if s.tenant == step[1]]
                if mine:
                    assert sampling.session_of(step[1], mine[step[2] % len(mine)]) is not None
            else:
                tenant, parent = step[1], step[2]
                try:
                    if kind == "base":
                        sampling.create_session(tenant, None, "tiny", parent)
                    else:
                        name = f"unnamed-{number}"
                        directory = state.write_checkpoint(
                            f"m-{tenant}", "sampler_weights", name, lambda d: d.mkdir()
                        )
                        published.append(directory)
                        path = f"tinker://m-{tenant}/sampler_weights/{name}"
                        sampling.loaded.add(sampling._adapter_name(path))
                        sampling.publish(tenant, path, directory, parent)
                    assert parent in live_parents
                except WireError as exc:
                    assert parent not in live_parents and exc.status == 404
            _check(sampling, live_parents, published)
        sampling.stop()
        assert not any(d.exists() for d in published)


def _check(sampling, live_parents: set[str], published: list[Path]) -> None:
    recency = sampling.recency
    assert all(len(ids) <= CAP for ids in recency.values())
    assert sorted(i for ids in recency.values() for i in ids) == sorted(sampling.sessions)
    assert {s.parent for s in sampling.sessions.values()} <= live_parents
    sampled = {s.model_path for s in sampling.sessions.values()}
    for directory in published:
        path = f"tinker://{directory.parent.parent.name}/sampler_weights/{directory.name}"
        assert directory.exists() == (path in sampled), path
