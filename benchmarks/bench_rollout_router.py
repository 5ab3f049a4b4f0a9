"""Router and client overhead of mizzen_rollout against direct httpx calls, in the same run.

    .venv/bin/python benchmarks/bench_rollout_router.py [--requests 1000] [--rounds 5] [--engines 2]

Setup: ``--engines`` embedded servers with the ``echo`` backend (real HTTP servers on 127.0.0.1
that answer ``/generate`` instantly, no model).  Two ways to send the same ``/generate`` requests:

- baseline: one ``httpx.AsyncClient`` per server, posting the JSON payload round-robin and
  decoding the JSON answer;
- mizzen: :class:`~mizzen_rollout.router.EngineRouter` (least-outstanding routing) over one
  :class:`~mizzen_rollout.engines.SGLangClient` per server (payload built and answer parsed by
  :mod:`~mizzen_rollout.engines.protocol` into a ``GenerateResult``).

Both use one pool of ``POOL`` connections per server.  Three measurements:

1. added latency: one request at a time, baseline and mizzen interleaved request by request (so
   machine noise hits both alike); p50/p99 of each and the difference (target: <= 1 ms p50);
2. throughput: ``--requests`` requests issued at once (default 1000), ``--rounds`` rounds
   alternating baseline and mizzen (median round reported); requests/s and the ratio
   mizzen/baseline (target: >= 90 %), with p50/p99 latency under that load;
3. CPU cost of mizzen's layers alone (payload build, answer parse, routing), no network.

Invariants: both ways hit the same servers with the same payloads in the same process; every
answer is checked (status 200, the request id echoed back) so a failing server cannot look fast.
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import time

import httpx

from mizzen_rollout.engines import (
    FinishReason,
    GenerateRequest,
    SamplingParams,
    SGLangClient,
    protocol,
)
from mizzen_rollout.engines.launcher import launch_embedded
from mizzen_rollout.metrics import percentile
from mizzen_rollout.router import EngineRouter, LeastOutstandingRouter

POOL = 64  # connections per engine, the same for both ways
SAMPLING = SamplingParams(max_new_tokens=8, temperature=0.0)
PROMPT = (1, 40, 41, 42, 43, 44, 45, 46)


def _request(tag: str) -> GenerateRequest:
    return GenerateRequest(tag, input_ids=PROMPT, sampling=SAMPLING)


class Baseline:
    """Direct httpx: one pooled client per server, round-robin."""

    def __init__(self, urls: list[str]):
        limits = httpx.Limits(max_connections=POOL, max_keepalive_connections=POOL)
        self.clients = [httpx.AsyncClient(base_url=u, limits=limits, timeout=60.0) for u in urls]
        self.turn = 0

    async def call(self, payload: dict) -> None:
        client = self.clients[self.turn % len(self.clients)]
        self.turn += 1
        response = await client.post("/generate", json=payload)
        body = response.json()
        assert response.status_code == 200 and body["meta_info"]["id"] == payload["rid"]

    async def aclose(self) -> None:
        for client in self.clients:
            await client.aclose()


class Mizzen:
    """EngineRouter over SGLangClients."""

    def __init__(self, urls: list[str]):
        self.router = EngineRouter(
            [SGLangClient(u, max_connections=POOL, timeout_s=60.0) for u in urls]
        )

    async def call(self, request: GenerateRequest) -> None:
        result = await self.router.generate(request)
        assert result.request_id == request.request_id and result.completion_tokens == 7

    async def aclose(self) -> None:
        await self.router.aclose()


async def _timed(coro) -> float:
    start = time.perf_counter()
    await coro
    return time.perf_counter() - start


async def measure_latency(urls: list[str], n: int) -> tuple[list[float], list[float]]:
    base, ours = Baseline(urls), Mizzen(urls)
    try:
        for k in range(4 * len(urls)):  # open connections, warm both paths
            await base.call(protocol.build_generate_payload(_request(f"wb{k}")))
            await ours.call(_request(f"wm{k}"))
        lat_base, lat_ours = [], []
        for i in range(n):
            payload = protocol.build_generate_payload(_request(f"b{i}"))
            request = _request(f"m{i}")
            if i % 2:  # alternate which goes first
                lat_base.append(await _timed(base.call(payload)))
                lat_ours.append(await _timed(ours.call(request)))
            else:
                lat_ours.append(await _timed(ours.call(request)))
                lat_base.append(await _timed(base.call(payload)))
        return lat_base, lat_ours
    finally:
        await base.aclose()
        await ours.aclose()


async def _burst(make_calls) -> tuple[float, list[float]]:
    latencies: list[float] = []

    async def one(coro) -> None:
        latencies.append(await _timed(coro))

    started = time.perf_counter()
    await asyncio.gather(*(one(c) for c in make_calls()))
    return time.perf_counter() - started, latencies


async def measure_throughput(urls: list[str], n: int, rounds: int):
    results: dict[str, list[tuple[float, list[float]]]] = {"base": [], "ours": []}
    for r in range(rounds + 1):  # round 0 warms up and is discarded
        base, ours = Baseline(urls), Mizzen(urls)
        try:
            payloads = [protocol.build_generate_payload(_request(f"b{r}-{i}")) for i in range(n)]
            requests = [_request(f"m{r}-{i}") for i in range(n)]
            b = await _burst(lambda: [base.call(p) for p in payloads])  # noqa: B023
            m = await _burst(lambda: [ours.call(q) for q in requests])  # noqa: B023
        finally:
            await base.aclose()
            await ours.aclose()
        if r:
            results["base"].append(b)
            results["ours"].append(m)

    def median(rs):
        wall, lat = sorted(rs, key=lambda x: x[0])[len(rs) // 2]
        return n / wall, percentile(lat, 50), percentile(lat, 99)

    return median(results["base"]), median(results["ours"])


def measure_cpu_us(iterations: int = 50_000) -> float:
    """Microseconds of CPU per request spent in mizzen's own layers (no I/O)."""
    request = _request("cpu")
    answer = protocol.build_generate_response(
        request_id="cpu",
        text="0123456",
        output_ids=list(PROMPT[1:]),
        finish=FinishReason("length"),
        prompt_tokens=len(PROMPT),
        output_logprobs=None,
        e2e_latency=0.0,
    )
    router = LeastOutstandingRouter(["a", "b"])
    start = time.perf_counter()
    for _ in range(iterations):
        protocol.build_generate_payload(request)
        protocol.parse_generate_response(answer, request_id="cpu", engine="e")
        router.release(router.acquire())
    return (time.perf_counter() - start) / iterations * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=1000, help="concurrent requests")
    parser.add_argument("--sequential", type=int, default=500, help="requests for latency")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--engines", type=int, default=2)
    args = parser.parse_args()

    servers = [launch_embedded(backend="echo") for _ in range(args.engines)]
    urls = [s.url for s in servers]
    try:
        lat_base, lat_ours = asyncio.run(measure_latency(urls, args.sequential))
        thr_base, thr_ours = asyncio.run(measure_throughput(urls, args.requests, args.rounds))
    finally:
        for server in servers:
            server.stop()
            server.cleanup_logs()
    cpu_us = measure_cpu_us()

    ms = 1000.0
    b50, b99 = percentile(lat_base, 50) * ms, percentile(lat_base, 99) * ms
    o50, o99 = percentile(lat_ours, 50) * ms, percentile(lat_ours, 99) * ms
    ratio = thr_ours[0] / thr_base[0]
    print(
        f"bench_rollout_router: {args.engines} echo engine(s) on 127.0.0.1, pool {POOL}/engine; "
        f"{platform.node()} ({platform.machine()}), Python {platform.python_version()}, "
        f"{time.strftime('%Y-%m-%d %H:%M')}"
    )
    print()
    print(f"1) latency, one request at a time ({args.sequential} each, interleaved)")
    print(f"   {'':<26}{'p50 ms':>10}{'p99 ms':>10}")
    print(f"   {'direct httpx (baseline)':<26}{b50:>10.3f}{b99:>10.3f}")
    print(f"   {'mizzen router + client':<26}{o50:>10.3f}{o99:>10.3f}")
    print(f"   {'added':<26}{o50 - b50:>10.3f}{o99 - b99:>10.3f}   (target: p50 <= 1 ms)")
    print()
    print(f"2) throughput, {args.requests} concurrent requests (median of {args.rounds} rounds)")
    print(f"   {'':<26}{'req/s':>10}{'p50 ms':>10}{'p99 ms':>10}")
    for name, (rps, p50, p99) in (
        ("direct httpx (baseline)", thr_base),
        ("mizzen router + client", thr_ours),
    ):
        print(f"   {name:<26}{rps:>10.0f}{p50 * ms:>10.1f}{p99 * ms:>10.1f}")
    print(f"   {'ratio mizzen/baseline':<26}{ratio:>10.1%}   (target: >= 90 %)")
    print()
    print(f"3) CPU in mizzen's layers (build + parse + route), no network: {cpu_us:.1f} us/request")
    print()
    verdict = "MET" if o50 - b50 <= 1.0 and ratio >= 0.9 else "NOT MET"
    print(f"targets {verdict}: added p50 {o50 - b50:.3f} ms, throughput ratio {ratio:.1%}")


if __name__ == "__main__":
    main()
