"""The main example, examples/train_tree_grpo.py, end to end on CPU.

One short run of the script (2 steps, 4 completions of at most 8 tokens, as a subprocess, the way a user runs it)
serves every test below:

- it exits 0 and prints the per-step table;
- the folder it saved loads with plain ``transformers`` in a fresh interpreter that never imports harts_hf, and
  gives finite logits (and generates), i.e. the checkpoint carries nothing of the tree patches;
- its config.json names no harts_hf attention implementation;
- ``python -m harts_hf.report`` plots the run from the ``trainer_state.json`` it saved beside the checkpoint;
- ``--hub-model-id`` pushes the checkpoint to the Hub with ``trainer.push_to_hub``.

Push to Hub, offline: the run talks HTTP to a small stand-in for the Hub served by this module on 127.0.0.1
(``HF_ENDPOINT`` points there). It answers the four calls an upload makes (create repo, validate README
metadata, pre-upload, commit) and writes the committed files to disk. Its pre-upload answer asks for every file as
a "regular" upload (inline base64 in the commit), so no LFS or Xet storage needs faking; the real Hub would take
the weights as LFS. So ``transformers``' and ``huggingface_hub``'s own push code runs unmodified, down to the
HTTP requests, and the test checks that the files that arrive are the saved checkpoint, byte for byte. What is
not covered: authentication and LFS/Xet transfers, which live in huggingface_hub.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import subprocess
import sys
import textwrap
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from harts_hf import report

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "train_tree_grpo.py"
REPO_ID = "tester/tiny-tree-grpo"
STEPS = 2


# ------------------------------------------------------------------------------------------ a stand-in Hub
class _FakeHub(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    store: Path  # set on the subclass made per server
    calls: list

    def log_message(self, *args):  # keep pytest's output clean
        pass

    def _reply(self, status: int, body: dict | None = None, headers: dict | None = None):
        data = json.dumps(body if body is not None else {}).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def _body(self) -> bytes:
        return self.rfile.read(int(self.headers.get("Content-Length", 0)))

    def do_POST(self):
        body = self._body()
        path = self.path.split("?")[0]
        self.calls.append(("POST", path))
        host = f"http://{self.headers['Host']}"
        if path == "/api/repos/create":
            request = json.loads(body)
            repo_id = f"{request['organization']}/{request['name']}" if request.get("organization") else request["name"]
            return self._reply(200, {"url": f"{host}/{repo_id}"})
        if path == "/api/validate-yaml":
            return self._reply(200, {})
        match = re.fullmatch(r"/api/models/(?P<repo>[^/]+/[^/]+)/(?P<verb>preupload|commit)/(?P<revision>[^/]+)", path)
        if match and match["verb"] == "preupload":
            files = json.loads(body)["files"]
            return self._reply(200, {"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False,
                                                "oid": None} for f in files]})
        if match and match["verb"] == "commit":
            target = self.store / match["repo"]
            for line in body.splitlines():
                item = json.loads(line)
                if item["key"] == "file":
                    value = item["value"]
                    assert value["encoding"] == "base64"
                    destination = target / value["path"]
                    destination.parent.mkdir(parents=True, exist_ok=True)
                    destination.write_bytes(base64.b64decode(value["content"]))
                elif item["key"] != "header":  # lfsFile, deletedFile, ...: not asked for by this stand-in
                    return self._reply(400, {"error": f"unexpected commit operation {item['key']}"})
            return self._reply(200, {"commitUrl": f"{host}/{match['repo']}/commit/{'0' * 40}", "commitOid": "0" * 40,
                                     "pullRequestUrl": None})
        return self._reply(404, {"error": f"not served by the test hub: POST {path}"})

    def do_GET(self):
        self.calls.append((self.command, self.path.split("?")[0]))
        # anything read from the Hub (e.g. an existing model card): the repo is new, so nothing is there
        self._reply(404, {"error": "Entry not found"}, {"X-Error-Code": "EntryNotFound"})

    do_HEAD = do_GET


@pytest.fixture(scope="module")
def fake_hub(tmp_path_factory):
    store = tmp_path_factory.mktemp("hub_store")
    handler = type("Handler", (_FakeHub,), {"store": store, "calls": []})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield {"endpoint": f"http://127.0.0.1:{server.server_address[1]}", "store": store, "calls": handler.calls}
    server.shutdown()
    server.server_close()


def _environment(tmp_path: Path, **extra) -> dict:
    env = dict(os.environ, HF_HOME=str(tmp_path / "hf_home"), HF_HUB_DISABLE_TELEMETRY="1", PYTHONUNBUFFERED="1",
               TOKENIZERS_PARALLELISM="false", **extra)
    env.pop("HF_HUB_OFFLINE", None)
    env.pop("TRANSFORMERS_OFFLINE", None)
    return env


@pytest.fixture(scope="module")
def example_run(tmp_path_factory, fake_hub):
    work = tmp_path_factory.mktemp("example")
    output_dir = work / "checkpoint"
    command = [sys.executable, str(EXAMPLE), "--steps", str(STEPS), "--num-generations", "4",
               "--max-completion-length", "8", "--output-dir", str(output_dir), "--hub-model-id", REPO_ID]
    env = _environment(work, HF_ENDPOINT=fake_hub["endpoint"], HF_TOKEN="hf_local_test_token")
    result = subprocess.run(command, cwd=work, env=env, capture_output=True, text=True, timeout=600)
    return {"result": result, "output_dir": output_dir, "work": work}


def _check_exit(run):
    result = run["result"]
    assert result.returncode == 0, f"example failed ({result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"


# ------------------------------------------------------------------------------------------ tests
def test_example_trains_and_prints_the_step_table(example_run):
    _check_exit(example_run)
    lines = example_run["result"].stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["step", "reward"])
    columns = lines[header].split()
    assert {"reward", "R_tok", "path", "unique"} <= set(columns)
    rows = [line.split() for line in lines[header + 2:] if re.match(r"\s*\d+\s", line)]
    assert [int(row[0]) for row in rows] == list(range(1, STEPS + 1))
    for row in rows:
        values = dict(zip(columns, row))
        assert 0.0 <= float(values["reward"]) <= 1.2
        # all prompts share the system prompt and each group its user turn: the trees must compress
        assert float(values["R_tok"]) > 1.5
        assert int(values["unique"]) < int(values["path"])
    assert f"saved to {example_run['output_dir'].resolve()}" in example_run["result"].stdout


PLAIN_LOAD = textwrap.dedent("""
    import json, sys
    sys.modules["triton"] = None  # plain transformers binds fla's Triton kernels wherever triton imports, and those
                                  # cannot run on a CPU: this check loads the checkpoint as a triton-less CPU would
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = sys.argv[1]
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    messages = [{"role": "system", "content": "You are a careful calculator."},
                {"role": "user", "content": "What is 12+7? Answer with the number only."}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    inputs = tokenizer(text, return_tensors="pt")
    with torch.no_grad():
        logits = model(**inputs).logits
        generated = model.generate(**inputs, max_new_tokens=3, do_sample=False)
    print(json.dumps({
        "harts_hf_imported": any(name == "harts_hf" or name.startswith("harts_hf.") for name in sys.modules),
        "class": type(model).__name__,
        "attn_implementation": model.config._attn_implementation,
        "logits_shape": list(logits.shape),
        "finite": bool(torch.isfinite(logits).all()),
        "generated": generated.shape[1] - inputs["input_ids"].shape[1],
        "vocab_covers_tokenizer": model.config.vocab_size >= len(tokenizer),
    }))
""")


def test_checkpoint_loads_with_plain_transformers(example_run, tmp_path):
    _check_exit(example_run)
    # a fresh interpreter, started outside the repository, that only imports transformers
    result = subprocess.run([sys.executable, "-c", PLAIN_LOAD, str(example_run["output_dir"])], cwd=tmp_path,
                            env=_environment(tmp_path, HF_HUB_OFFLINE="1"), capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["harts_hf_imported"] is False
    assert report["class"] == "Qwen3NextForCausalLM"
    assert "harts" not in report["attn_implementation"]
    assert report["finite"] and report["logits_shape"][0] == 1 and report["logits_shape"][1] > 10
    assert report["generated"] == 3
    assert report["vocab_covers_tokenizer"]


def test_saved_config_has_no_harts_attention(example_run):
    _check_exit(example_run)
    text = (example_run["output_dir"] / "config.json").read_text()
    config = json.loads(text)
    assert "harts" not in text.lower()
    assert config.get("_attn_implementation", config.get("attn_implementation")) in (None, "eager", "sdpa")
    assert config["model_type"] == "qwen3_next" and config["architectures"] == ["Qwen3NextForCausalLM"]
    assert "auto_map" not in config  # plain transformers classes, no remote code
    assert config["layer_types"].count("linear_attention") == 3 and config["layer_types"].count("full_attention") == 1


def test_report_plots_the_run(example_run, tmp_path, capsys):
    _check_exit(example_run)
    report.main([str(example_run["output_dir"]), "--out", str(tmp_path)])  # what python -m harts_hf.report runs
    assert f"{STEPS} steps; last reward" in capsys.readouterr().out
    assert (tmp_path / "report.png").stat().st_size > 10_000
    series = json.loads((tmp_path / "report.json").read_text())
    assert series["step"] == list(range(1, STEPS + 1)) and None not in series["reward"]


def test_push_to_hub_uploads_the_checkpoint(example_run, fake_hub):
    _check_exit(example_run)
    assert ("POST", "/api/repos/create") in fake_hub["calls"]
    assert ("POST", f"/api/models/{REPO_ID}/commit/main") in fake_hub["calls"]
    pushed = fake_hub["store"] / REPO_ID
    names = {p.name for p in pushed.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "README.md"} <= names

    def digest(path):
        return hashlib.sha256(path.read_bytes()).hexdigest()

    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert digest(pushed / name) == digest(example_run["output_dir"] / name), name
    assert "tree-grpo" in (pushed / "README.md").read_text()  # the model card carries the trainer's tags
