"""Generation benchmark: raymesh.serve's /v1/generate batched (continuous batching) against one
stream at a time, in one run.

    python bench/serve_generate.py            # full: 3 rounds per client count, 64 tokens
    python bench/serve_generate.py --quick    # smoke run: 1 round, 32 tokens, no file

The model: a Llama-architecture causal LM built from a config (raymesh.train.hf's
save_tiny_llama, hidden 128, 4 layers, seed 0; byte-level tokenizer; nothing downloaded),
written to a temporary folder and served with serve.deploy(hf=folder, replicas=1,
cpus_per_replica=1, request_timeout_s=600) twice, one app after the other:
- one at a time: max_streams=1, the replica's one-stream path (raymesh.train.hf:generate, a KV
  cache per request): what a replica did before batching;
- batched: max_streams=64, the replica's decoder stepping every active stream as one padded
  batch that streams join and leave between tokens.
Load: a separate python (this script with --load, so it never shares the front's GIL) with N
threads, each on its own keep-alive connection: one untimed warm-up request each (concurrently),
then `rounds` streamed requests each back to back (prompt "def f" + the thread's number, greedy,
max_tokens tokens; a stream that meets eos ends early: tokens are counted as the events
received). Per client count (1, 16, 64): tokens/s = tokens received over the wall
time of the timed phase; first-token latency = from sending the request to its first event
(p50, p99 over all timed requests); every request's status checked. Greedy, so each stream's
text is also checked to be the same in both apps (batching must not change it).
Target (issue 39): batched tokens/s >= 4x one-at-a-time's at 16 clients. Progress goes to stderr;
one JSON object to stdout, also written to bench/results/serve_generate.json (not with
--quick), with the load average at the start and the end (the machine may be shared).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

SCRIPT = os.path.abspath(__file__)
RESULTS = Path(SCRIPT).parent / "results" / "serve_generate.json"
TARGET_AT_16 = 4.0
MODES = {"one_at_a_time": 1, "batched": 64}


def log(*a: object) -> None:
    print("[serve-generate-bench]", *a, file=sys.stderr, flush=True)


# -- the load generator (runs in its own python: `serve_generate.py --load SPEC`) --------------
def one(conn: http.client.HTTPConnection, prompt: str, tokens: int) -> dict[str, Any]:
    body = json.dumps({"prompt": prompt, "max_tokens": tokens, "stream": True}).encode()
    sent = time.perf_counter()
    conn.request("POST", "/v1/generate", body, {"Content-Type": "application/json"})
    response = conn.getresponse()
    first, pieces, status = None, [], response.status
    while True:
        line = response.readline()
        if not line or line.startswith(b"data: [DONE]"):
            break
        if line.startswith(b"event: error"):
            status = -1
        if line.startswith(b"data: "):
            first = first or time.perf_counter() - sent
            pieces.append(json.loads(line[6:]).get("text", ""))
    response.read()
    return {"status": status, "first_s": first, "tokens": len(pieces), "text": "".join(pieces)}


def load_main(spec: dict[str, Any]) -> dict[str, Any]:
    url, clients, rounds, tokens = spec["url"], spec["clients"], spec["rounds"], spec["tokens"]
    host, port = url.split("//")[1].split(":")
    results: list[list[dict[str, Any]]] = [[] for _ in range(clients)]
    start = threading.Barrier(clients + 1)

    def worker(k: int) -> None:
        conn = http.client.HTTPConnection(host, int(port), timeout=600)
        one(conn, f"def f{k}", 2)  # warm-up: the connection, the replica's first batch
        start.wait()
        for _ in range(rounds):
            results[k].append(one(conn, f"def f{k}", tokens))
        conn.close()

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(clients)]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join(900)
    wall = time.perf_counter() - t0
    flat = [r for rs in results for r in rs]
    firsts = sorted(r["first_s"] for r in flat if r["first_s"] is not None)
    made = sum(r["tokens"] for r in flat)
    return {
        "clients": clients,
        "requests": len(flat),
        "failed": sum(r["status"] != 200 for r in flat),
        "tokens": made,
        "wall_s": round(wall, 3),
        "tokens_per_s": round(made / wall, 1),
        "first_token_p50_ms": round(1000 * statistics.median(firsts), 1) if firsts else None,
        "first_token_p99_ms": round(1000 * firsts[int(0.99 * (len(firsts) - 1))], 1)
        if firsts
        else None,
        "texts": {f"def f{k}": rs[0]["text"] for k, rs in enumerate(results) if rs},
    }


def run_load(url: str, clients: int, rounds: int, tokens: int) -> dict[str, Any]:
    spec = {"url": url, "clients": clients, "rounds": rounds, "tokens": tokens}
    out = subprocess.run(
        [sys.executable, SCRIPT, "--load", json.dumps(spec)],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    if out.returncode != 0:
        raise RuntimeError(f"load generator failed: {out.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="1 round, 32 tokens, no file")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--clients", default="1,16,64")
    p.add_argument("--load", help=argparse.SUPPRESS)  # internal: one load generator run
    args = p.parse_args()
    if args.load:
        print(json.dumps(load_main(json.loads(args.load))), flush=True)
        return
    if args.quick:
        args.rounds, args.tokens = 1, 32
    stdout = os.fdopen(os.dup(1), "w")  # one JSON object on stdout; Ray's output to stderr
    os.dup2(2, 1)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import torch

    from raymesh import serve
    from raymesh.train import hf

    torch.set_num_threads(1)
    clients = [int(c) for c in args.clients.split(",")]
    res: dict[str, Any] = {
        "bench": "serve_generate",
        "mode": "quick" if args.quick else "full",
        "loadavg_start": [round(x, 2) for x in os.getloadavg()],
        "model": "save_tiny_llama(hidden_size=128, layers=4, heads=4, kv_heads=2, "
        "intermediate_size=256, seed=0), byte-level tokenizer, CPU, 1 torch thread",
        "rounds": args.rounds,
        "max_tokens": args.tokens,
        "clients": clients,
        "modes": {name: {"max_streams": n} for name, n in MODES.items()},
    }
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="bench_generate_") as tmp:
        folder = hf.save_tiny_llama(
            Path(tmp) / "tiny", hidden_size=128, layers=4, intermediate_size=256
        )
        for name, max_streams in MODES.items():
            app = serve.deploy(
                hf=str(folder),
                replicas=1,
                cpus_per_replica=1,
                max_streams=max_streams,
                request_timeout_s=600,
                max_tokens=args.tokens,
                port=0,
            )
            try:
                for n in clients:
                    log(f"{name}: {n} clients")
                    res["modes"][name][str(n)] = run_load(app.url, n, args.rounds, args.tokens)
            finally:
                app.stop()
    texts = {
        str(n): [res["modes"][m][str(n)].pop("texts") for m in MODES] for n in clients
    }  # fmt: skip
    res["same_text"] = {n: a == b for n, (a, b) in texts.items()}
    speedup = {
        str(n): round(
            res["modes"]["batched"][str(n)]["tokens_per_s"]
            / res["modes"]["one_at_a_time"][str(n)]["tokens_per_s"],
            2,
        )
        for n in clients
    }
    res["speedup_tokens_per_s"] = speedup
    if "16" in speedup:
        res["target_4x_at_16"] = {"speedup": speedup["16"], "met": speedup["16"] >= TARGET_AT_16}
    res["wall_s"] = round(time.time() - t0, 1)
    res["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    text = json.dumps(res)
    if not args.quick:
        RESULTS.parent.mkdir(exist_ok=True)
        RESULTS.write_text(text + "\n")
    stdout.write(text + "\n")
    stdout.flush()


if __name__ == "__main__":
    main()
