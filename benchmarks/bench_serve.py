"""Benchmark: ``mizzen-train serve`` with K concurrent tenants driven by the official Tinker SDK.

For K = 1, 4, 8 tenants (each its own API key, ServiceClient and LoRA model) on one server, every
tenant runs the same supervised loop: ``forward_backward`` (``rows`` datums of ``seq`` tokens)
then ``optim_step``, waiting for each result, ``steps`` times after ``warmup`` steps.  Reported
per K: operations/s over all tenants, p50/p99 latency of ``forward_backward`` (submit to
result), the server's executor steps per operation (how much the scheduler batched), the
server-side time of the scheduler steps the measured ``forward_backward`` calls ran in (the
executor call plus joining the rows and encoding the answer; the rest of the latency is HTTP,
decoding, queueing and the SDK's polling), and

    ratio = throughput(K tenants together) / throughput(1 tenant)
          = (time of K separate single-tenant runs) / (time of the K-tenant run),

the point of slots: > 1 means sharing one executor step beats running the tenants one after
another.  The K = 1 baseline is measured in the same run, on the same server.

Run from a fresh checkout (the server is a subprocess of this script; nothing edits sys.path)::

    uv run python benchmarks/bench_serve.py                        # tiny Llama on the CPU
    uv run python benchmarks/bench_serve.py --device cuda --model 100m --rows 8 --seq 256

``--model 100m`` is the ~101M-parameter Llama of the GPU e2e tests (byte vocabulary, random
weights written once into the state directory); ``--model PATH`` serves an HF Llama directory.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

KEY = "tml-bench-{:02d}-000000000000000000"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--model", default="tiny", help='"tiny", "100m" or an HF Llama directory')
    parser.add_argument("--tenants", default="1,4,8", help="the K values, comma-separated")
    parser.add_argument("--steps", type=int, default=10, help="measured steps per tenant")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rows", type=int, default=4, help="datums per forward_backward")
    parser.add_argument("--seq", type=int, default=64, help="tokens per datum")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--threads", type=int, default=0, help="server torch threads (0: default)")
    return parser.parse_args(argv)


def write_config(root: Path, args: argparse.Namespace, slots: int) -> Path:
    keys = root / "keys"
    keys.write_text("".join(f"t{i} {KEY.format(i)}\n" for i in range(slots)))
    os.chmod(keys, 0o600)
    model_lines = [
        f'path = "{args.model}"' if args.model not in ("tiny", "100m") else 'path = "tiny"'
    ]
    model_lines += [
        'name = "bench-base"', f'device = "{args.device}"', f"slots = {slots}",
        f"max_rank = {args.rank}", f"micro_batch_size = {args.micro_batch_size}",
        f"seq_bucket = {args.seq}", f"threads = {args.threads}",
    ]  # fmt: skip
    if args.model == "100m":
        from mizzen_train.hf.tiny import LLAMA_100M

        model_lines.append("[model.tiny]")
        model_lines += [f"{k} = {v}" for k, v in LLAMA_100M.items()]
    config = root / "serve.toml"
    config.write_text(
        "[server]\n"
        f'state_dir = "{root / "state"}"\napi_keys_file = "{keys}"\nport = 0\n'
        f'port_file = "{root / "url"}"\nmax_batch_rows = {slots * args.rows}\n'
        "[model]\n" + "\n".join(model_lines) + '\n[sampling]\nengine = "none"\n'
    )
    return config


def start_server(root: Path, config: Path) -> tuple[subprocess.Popen, str]:
    with open(root / "server.log", "w") as log:  # the child keeps its own descriptor
        process = subprocess.Popen(
        [sys.executable, "-m", "mizzen_train", "serve", "--config", str(config)],
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    deadline = time.monotonic() + 600
    while not (root / "url").exists():
        if process.poll() is not None or time.monotonic() > deadline:
            tail = (root / "server.log").read_text(errors="replace").splitlines()[-20:]
            sys.exit("the server did not start; the end of its log:\n" + "\n".join(tail))
        time.sleep(0.5)
    return process, (root / "url").read_text().strip()


def tenant_loop(url: str, index: int, args, barrier, out: dict) -> None:
    import tinker
    from tinker import types

    service = tinker.ServiceClient(base_url=url, api_key=KEY.format(index))
    training = service.create_lora_training_client(
        base_model="bench-base", rank=args.rank, seed=index
    ).result()
    tokens = [3 + (index * 7 + i) % 250 for i in range(args.seq + 1)]
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * args.seq},
    )
    data = [datum] * args.rows
    adam = types.AdamParams(learning_rate=1e-4)
    for _ in range(args.warmup):
        training.forward_backward(data, "cross_entropy").result()
        training.optim_step(adam).result()
    barrier.wait()
    latencies = []
    start = time.perf_counter()
    for _ in range(args.steps):
        t0 = time.perf_counter()
        training.forward_backward(data, "cross_entropy").result()
        latencies.append(time.perf_counter() - t0)
        training.optim_step(adam).result()
    out[index] = (start, time.perf_counter(), latencies, training.model_id)


def executor_counts(url: str) -> tuple[int, int, float, int]:
    """(executor steps, operations they ran, seconds and count of ``forward_backward`` executor
    steps summed over tenants) from the server's ``/metrics``."""
    import httpx

    text = httpx.get(f"{url}/metrics", timeout=30).text
    values = dict(line.rsplit(" ", 1) for line in text.splitlines() if not line.startswith("#"))
    fb_seconds = fb_count = 0.0
    for name, value in values.items():
        if 'kind="forward_backward"' in name:
            if name.startswith("mizzen_serve_step_seconds_sum"):
                fb_seconds += float(value)
            elif name.startswith("mizzen_serve_step_seconds_count"):
                fb_count += float(value)
    return (int(values["mizzen_serve_executor_steps_total"]),
            int(values["mizzen_serve_executor_operations_total"]),
            fb_seconds, int(fb_count))  # fmt: skip


def unload(url: str, index: int, model_id: str) -> None:
    import httpx

    headers = {"X-API-Key": KEY.format(index)}
    future = httpx.post(f"{url}/api/v1/unload_model", headers=headers,
                        json={"model_id": model_id}, timeout=60).json()  # fmt: skip
    while httpx.post(f"{url}/api/v1/retrieve_future", headers=headers,
                     json={"request_id": future["request_id"]}, timeout=60,
                     ).json().get("type") == "try_again":  # fmt: skip
        pass


def measure(url: str, k: int, args) -> dict:
    before: list = []  # the server's counters once every tenant is warm (the barrier's action)
    barrier = threading.Barrier(k, action=lambda: before.extend(executor_counts(url)))
    out: dict = {}
    threads = [
        threading.Thread(target=tenant_loop, args=(url, i, args, barrier, out)) for i in range(k)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if len(out) != k:
        sys.exit(f"{k - len(out)} of {k} tenants failed (their traceback is above)")
    steps0, ops0, fb_s0, fb_n0 = before
    steps1, ops1, fb_s1, fb_n1 = executor_counts(url)
    for index, (_, _, _, model_id) in out.items():
        unload(url, index, model_id)
    wall = max(v[1] for v in out.values()) - min(v[0] for v in out.values())
    latencies = sorted(x for v in out.values() for x in v[2])
    ops = 2 * k * args.steps
    return {
        "k": k, "ops_per_s": ops / wall, "wall": wall,
        "p50": statistics.median(latencies),
        "p99": latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
        "ops_per_executor_step": (ops1 - ops0) / max(1, steps1 - steps0),
        # server-side time of the scheduler step a measured forward_backward ran in
        "fb_step": (fb_s1 - fb_s0) / max(1, fb_n1 - fb_n0),
    }  # fmt: skip


def main(argv=None) -> int:
    args = parse_args(argv)
    counts = sorted({int(k) for k in args.tenants.split(",")} | {1})
    with tempfile.TemporaryDirectory(prefix="bench-serve-") as tmp:
        root = Path(tmp)
        process, url = start_server(root, write_config(root, args, max(counts)))
        try:
            results = {k: measure(url, k, args) for k in counts}
        finally:
            process.send_signal(signal.SIGINT)
            process.wait(60)
    base = results[1]["ops_per_s"]
    print(f"bench_serve: model={args.model} device={args.device} rows={args.rows} seq={args.seq} "
          f"rank={args.rank} steps={args.steps} micro_batch_size={args.micro_batch_size}")  # fmt: skip
    print(f"{'K':>3} {'ops/s':>9} {'fb p50 ms':>10} {'fb p99 ms':>10} {'ops/step':>9} "
          f"{'fb step ms':>11} {'ratio vs K x single':>20}")  # fmt: skip
    for k in counts:
        r = results[k]
        print(f"{k:>3} {r['ops_per_s']:>9.2f} {1e3 * r['p50']:>10.1f} {1e3 * r['p99']:>10.1f} "
              f"{r['ops_per_executor_step']:>9.2f} {1e3 * r['fb_step']:>11.1f} "
              f"{r['ops_per_s'] / base:>20.2f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
