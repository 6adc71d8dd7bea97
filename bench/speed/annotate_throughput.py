"""Throughput of 01_annotate.py's OpenAI-compatible critic against a local server that answers in 200 ms.

    python bench/speed/annotate_throughput.py                      # 1000 records, 200 ms, concurrency 16, then the fault run
    python bench/speed/annotate_throughput.py --delay 0.05         # a server 4x faster: the client's own cost shows more
    python bench/speed/annotate_throughput.py --records 300 --concurrency 8

Phase 1 sends 1000 records to a clean server (a fast asyncio HTTP server in its own process, so it never competes with
the client for the GIL) and compares the annotation wall time with the ideal records * delay / concurrency; the goal
is ratio <= 1.1 at 200 ms and concurrency 16 (the paper's code sends one request at a time: ratio ~16). Phase 2
repeats the run against a fault-injecting server (429 with Retry-After, 500, replies slower than the client timeout,
which fail and are not retried (infra.serving.retry_delay), fenced JSON, reasoning before the JSON, invalid JSON once or always, quotes that are not in the response or differ in
case and quote marks) and reports the unmatched-span rate and failures. The last line is one JSON object:
wall_s, ideal_s, ratio, and the fault run's numbers.
"""

import argparse
import asyncio
import importlib
import json
import os
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


# ----------------------------------------------------------------------------------------------------------------------
# The server: HTTP/1.1 keep-alive, /v1/chat/completions only
# ----------------------------------------------------------------------------------------------------------------------


def critique(response: str, kind: int, attempt: int) -> tuple[int, str, dict]:
    """(status, assistant text or error message, headers) for one request. `kind` in [0, 100) picks the fault."""
    words = response.split() or ["-"]
    good, poor = " ".join(words[:3]), words[-1].rstrip(".")
    spans = {"good_spans": [good], "poor_spans": [poor]}
    if 20 <= kind < 40:  # the critic paraphrases or misquotes one span: App. L's unmatched case
        spans["poor_spans"].append(f"{words[-1]} and more")
    if 40 <= kind < 50:  # quotes that differ in case and quote marks: find_span tolerates these
        spans["good_spans"] = [f"\u201c{good.upper()}\u201d"]
    body = json.dumps({"critique": f"It starts well with {good}, but {poor} is weak.", **spans})
    if kind < 5 and attempt == 1:
        return 429, "rate limited", {"Retry-After": "0.1"}
    if 5 <= kind < 10 and attempt == 1:
        return 500, "internal error", {}
    if 10 <= kind < 12 and attempt == 1:
        return 200, "SLOW", {}  # the handler sleeps past the client timeout
    if 12 <= kind < 17 and attempt == 1 or kind == 17:  # invalid once (repaired), or always (failed)
        return 200, "Looks fine to me {not json", {}
    if 50 <= kind < 65:
        return 200, f"```json\n{body}\n```", {}
    if 65 <= kind < 80:
        return 200, f"Reasoning: the opening is accurate; the ending is weak.\n\n{body}\nLet me know!", {}
    return 200, body, {}


async def serve(delay: float, faults: bool) -> None:
    attempts: dict[str, int] = {}

    async def handle(reader, writer):
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    (
                        int(line.split(b":")[1])
                        for line in head.split(b"\r\n")
                        if line.lower().startswith(b"content-length:")
                    ),
                    0,
                )
                body = json.loads(await reader.readexactly(length))
                if body.get("max_tokens") == 1:  # 01's preflight (infra.serving.check_server): one token
                    body["messages"] = [{"role": "system", "content": ""}, {"role": "user", "content": "OK"}]
                user = body["messages"][-1]["content"] if body["messages"][-1]["role"] == "user" else ""
                response = body["messages"][1]["content"].split("### Response\n", 1)[-1].split("\n\n###", 1)[0]
                attempts[response] = attempts.get(response, 0) + 1
                kind = zlib.crc32(response.encode()) % 100 if faults else 99
                status, text, headers = critique(
                    response, kind, attempts[response] if "could not use" not in user else 2
                )
                await asyncio.sleep(delay)
                if text == "SLOW":
                    await asyncio.sleep(3.0)
                    text = critique(response, 99, 2)[1]
                payload = {
                    "id": "x",
                    "object": "chat.completion",
                    "created": 0,
                    "model": body.get("model", "m"),
                    "choices": [
                        {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": text}}
                    ],
                    "usage": {"prompt_tokens": 400, "completion_tokens": 120, "total_tokens": 520},
                }
                if status != 200:
                    payload = {"error": {"message": text}}
                data = json.dumps(payload).encode()
                extra = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
                writer.write(
                    f"HTTP/1.1 {status} X\r\nContent-Type: application/json\r\nContent-Length: {len(data)}"
                    f"\r\n{extra}\r\n".encode()
                    + data
                )
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0, backlog=256)
    print(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1", flush=True)
    await server.serve_forever()


# ----------------------------------------------------------------------------------------------------------------------
# The client: 01_annotate.main against that server
# ----------------------------------------------------------------------------------------------------------------------


def run(args, faults: bool, workdir: Path) -> tuple[dict, float]:
    server = subprocess.Popen(
        [sys.executable, __file__, "--serve", "--delay", str(args.delay)] + ["--faults"] * faults,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        url = server.stdout.readline().strip()
        annotate = importlib.import_module("01_annotate")
        out = workdir / f"annotations-{'faults' if faults else 'clean'}.jsonl"
        cpu = time.process_time()
        summary = annotate.main(
            [
                "--task",
                "demo",
                "--dataset",
                str(workdir / "records.jsonl"),
                "--annotator",
                "openai",
                "--base-url",
                url,
                "--model",
                "bench",
                "--output",
                str(out),
                "--concurrency",
                str(args.concurrency),
                "--timeout",
                "1.0",
                "--backoff-base",
                "0.05",
            ]
        )
        return summary, time.process_time() - cpu
    finally:
        server.kill()
        server.wait()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--records", type=int, default=1000, help="records per run")
    p.add_argument("--concurrency", type=int, default=16, help="requests in flight")
    p.add_argument("--delay", type=float, default=0.2, help="server answer time in seconds")
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--faults", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve:
        asyncio.run(serve(args.delay, args.faults))
        return
    sys.path.insert(0, str(ROOT))
    os.environ.setdefault("OPENAI_API_KEY", "sk-bench-local")  # the local server ignores it
    import common
    from tasks.demo import demo_dataset

    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        common.write_jsonl(workdir / "records.jsonl", demo_dataset("bench", args.records))
        clean, client_cpu = run(args, False, workdir)
        faulty, _ = run(args, True, workdir)
        ok = [r for r in common.read_jsonl(workdir / "annotations-faults.jsonl") if r["status"] == "ok"]
        misquoted = sum(20 <= zlib.crc32(r["response"].encode()) % 100 < 40 for r in ok)  # see critique()
        expected_rate = misquoted / (2 * len(ok) + misquoted)
        expected_failed = sum(
            zlib.crc32(r["response"].encode()) % 100 in (10, 11, 17) for r in demo_dataset("bench", args.records)
        )  # 10, 11: slower than --timeout, not retried; 17: never valid JSON
    ideal = args.records * args.delay / args.concurrency
    wall = clean["this_run"]["annotate_s"]  # the annotation alone (elapsed_s: the whole run)
    result = {
        "wall_s": round(wall, 3),
        "ideal_s": round(ideal, 3),
        "ratio": round(wall / ideal, 3),
        "records": args.records,
        "concurrency": args.concurrency,
        "delay_s": args.delay,
        "client_cpu_s": round(client_cpu, 3),
        "cpu_count": os.cpu_count(),
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "faults": {
            "wall_s": faulty["this_run"]["annotate_s"],
            "failed": faulty["failed"],
            "expected_failed": expected_failed,
            "unmatched_span_rate": faulty["unmatched_span_rate"],
            "expected_unmatched_span_rate": round(expected_rate, 4),
            "good_spans_per_record": faulty["good_spans_per_record"],
            "poor_spans_per_record": faulty["poor_spans_per_record"],
        },
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
