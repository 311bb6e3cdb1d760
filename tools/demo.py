"""The demo `make run` starts: train the tiny recipe on the built-in corpus with dp=2, then
deploy its final checkpoint on one vLLM replica and print how to chat with it.

Everything goes through the public REST API, as a user's script would.
"""

from __future__ import annotations

import threading
import time

import httpx

DEMO_SPEC = {"layout": {"dp": 2}, "train": {"steps": 120, "warmup_steps": 10, "checkpoint_interval": 40}}
REPLICA_OPTIONS = {"enforce_eager": True, "max_model_len": 64, "kv_cache_gib": 1}


def _wait(fetch, done, timeout: float):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = fetch()
        if done(value):
            return value
        time.sleep(2)
    raise TimeoutError


def _demo(url: str, token: str) -> None:
    api = httpx.Client(base_url=url, headers={"Authorization": f"Token {token}"}, timeout=60)
    run = api.post("/api/runs/", json={"name": "demo", "recipe": "tiny", "spec": DEMO_SPEC}).json()
    print(f"\n[demo] training run {run['id']} (tiny, dp=2): watch it at {url}/runs/{run['id']}", flush=True)
    checkpoints = _wait(
        lambda: api.get(f"/api/runs/{run['id']}/checkpoints/").json(), lambda c: c and c[-1]["export_path"], 1800
    )
    deployment = api.post(
        "/api/deployments/",
        json={"checkpoint": checkpoints[-1]["id"], "replicas": 1, "served_model_name": f"demo-{run['id']}", "options": REPLICA_OPTIONS},
    ).json()
    print(f"[demo] deploying step {checkpoints[-1]['step']} to vLLM: {url}/deployments/{deployment['id']}", flush=True)
    _wait(lambda: api.get(f"/api/deployments/{deployment['id']}/").json()["status"], lambda s: s in ("ready", "failed"), 900)
    key = api.post(f"/api/deployments/{deployment['id']}/keys/", json={"name": "demo"}).json()["key"]
    model = deployment["served_model_name"]
    print(
        f"""[demo] ready. Chat with it:
  curl {url}/v1/chat/completions -H "Authorization: Bearer {key}" -H "Content-Type: application/json" \\
    -d '{{"model": "{model}", "messages": [{{"role": "user", "content": "Ada walked to"}}], "max_tokens": 20}}'
  python -c "from openai import OpenAI; c = OpenAI(base_url='{url}/v1', api_key='{key}'); print(c.chat.completions.create(model='{model}', messages=[{{'role': 'user', 'content': 'Ada walked to'}}], max_tokens=20).choices[0].message.content)"
""",
        flush=True,
    )


def run_demo(url: str, login_line: str) -> None:
    """Starts the demo beside the server; `login_line` is what `ensure_login` printed."""
    token = login_line.rsplit("api token: ", 1)[1].strip()

    def guarded() -> None:
        try:
            _demo(url, token)
        except Exception as exc:  # the server keeps running; the demo says why it stopped
            print(f"[demo] stopped: {exc!r}", flush=True)

    threading.Thread(target=guarded, daemon=True).start()
