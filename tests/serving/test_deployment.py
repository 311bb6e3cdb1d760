"""A real deployment: a detached supervisor with two vLLM replicas behind the router app.

The tests run in file order on one deployment (started once for the module): traffic, what it
serves against `transformers` on the same weights and tokenizer, and metrics first, then a
replica is killed under load, and last the deployment is stopped.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch
import transformers

from serving.deployment_config import request_change
from serving.replica_metrics import histogram_quantile, parse_prometheus, poll, rates_between, scrape
from serving.router import Timeouts
from serving.state import read_events, read_state
from serving.supervisor import request_stop
from serving.vllm import REPLICA_KEEPALIVE_S, ReplicaOptions
from tests.serving.conftest import RunningDeployment, process_alive, start_deployment, wait_until
from training.ports import REPLICA_PORTS

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

STREAM_TOKENS = 1000  # long enough that all 20 streams are mid-flight when a replica is killed (300 were whole in
# the client's socket buffers before it saw them start, on a loaded machine: no stream was cut)
# What parity is checked on: greedy completions and prompt logprobs of these.
PARITY_PROMPTS = [
    "the cat sees",
    "a dog follows the moon",
    "my friend draws three apples",
    "the robot carries a red box near",
    "12 13 14 15",
    "the teacher finds",
    "a child counts the river under the tree. the bird",
    "7 8 9",
    "the bird likes a small boat",
    "the cat sees a dog at home. my friend",
]
PARITY_NEW_TOKENS = 16


@pytest.fixture(scope="module")
def deployment(
    tmp_path_factory: pytest.TempPathFactory, tiny_checkpoint: Path, vllm_python: str
) -> Iterator[RunningDeployment]:
    # "nobind": on a machine shared with other test runs, a replica pinned to a core competes
    # with whatever else is pinned there (another run's replica spinning its OpenMP threads).
    options = ReplicaOptions(
        max_model_len=1024,
        max_num_seqs=32,
        kv_cache_gib=1,
        enforce_eager=True,
        dtype="float32",
        cpu_threads_bind="nobind",
    )
    yield from start_deployment(
        tmp_path_factory.mktemp("deploy"),
        tiny_checkpoint,
        vllm_python,
        name="tiny",
        replicas=2,
        options=options,
    )


def events_of(deployment: RunningDeployment) -> list:
    return read_events(deployment.state_dir)[0]


async def stream_completion(client: httpx.AsyncClient, url: str, live: dict | None = None, **body: object) -> dict:
    """One streamed completion: which replica served it, the text, finish reason, and whether it
    ended with an error event. `live`, when given, is filled in as the stream goes."""
    payload = {"model": "tiny", "prompt": "the cat sees", "max_tokens": STREAM_TOKENS, "ignore_eos": True, "temperature": 0, "stream": True,
               "stream_options": {"include_usage": True}, **body}  # fmt: skip
    # vLLM may pack several tokens into one chunk when the reader lags: count tokens from usage.
    result: dict = live if live is not None else {}
    result.update(text="", finish_reason=None, error=None, chunks=0, tokens=None, replica=None)
    async with client.stream("POST", f"{url}/v1/completions", json=payload) as response:
        result["status"] = response.status_code
        result["replica"] = response.headers.get("x-fathom-replica")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: ") :])
            if "error" in event:
                result["error"] = event["error"]
                continue
            if event.get("usage"):
                result["tokens"] = event["usage"]["completion_tokens"]
            if not event.get("choices"):
                continue
            result["chunks"] += 1
            choice = event["choices"][0]
            result["text"] += choice.get("text", "")
            result["finish_reason"] = choice.get("finish_reason") or result["finish_reason"]
    return result


def test_the_supervisor_reports_every_replica_ready_with_its_own_port_and_logs(deployment: RunningDeployment) -> None:
    state = read_state(deployment.state_dir)
    assert state is not None and len(state.replicas) == 2
    assert {r.phase for r in state.replicas} == {"ready"}
    assert len({r.port for r in state.replicas}) == 2
    # From the replicas' range, below the ephemeral ports outgoing connections take.
    assert all(r.port in REPLICA_PORTS for r in state.replicas)
    assert all(r.pid and process_alive(r.pid) for r in state.replicas)
    assert all(Path(r.log).stat().st_size > 0 for r in state.replicas)
    kinds = [(e.kind, e.replica) for e in events_of(deployment)]
    for index in (0, 1):
        assert kinds.index(("replica_starting", index)) < kinds.index(("replica_ready", index))


async def test_chat_and_completions_work_through_the_router_with_the_openai_client(
    deployment: RunningDeployment,
) -> None:
    client = openai.AsyncOpenAI(base_url=f"{deployment.router_url}/v1", api_key="unused", max_retries=0, timeout=120)
    chat = await client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "the dog"}], max_tokens=12, temperature=0
    )
    assert chat.choices[0].message.content
    assert chat.usage is not None and chat.usage.completion_tokens >= 1
    pieces = []
    stream = await client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "the dog"}], max_tokens=12, temperature=0, stream=True
    )
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
    assert "".join(pieces) == chat.choices[0].message.content  # greedy: streamed equals whole
    completion = await client.completions.create(model="tiny", prompt="a dog finds", max_tokens=8, temperature=0)
    assert completion.choices[0].text
    await client.close()


@pytest.fixture(scope="module")
def reference(tiny_checkpoint: Path) -> tuple[transformers.PreTrainedModel, transformers.PreTrainedTokenizerBase]:
    torch.set_num_threads(1)
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32)
    model.eval()
    return model, transformers.AutoTokenizer.from_pretrained(tiny_checkpoint)


async def test_what_it_serves_matches_transformers_in_prompt_logprobs_and_greedy_completions(
    deployment: RunningDeployment, reference
) -> None:  # type: ignore[no-untyped-def]
    model, tokenizer = reference
    client = openai.AsyncOpenAI(base_url=f"{deployment.router_url}/v1", api_key="unused", max_retries=0, timeout=120)
    worst_logprob_gap = 0.0
    same_completion = 0
    for prompt in PARITY_PROMPTS:
        ids = tokenizer(prompt).input_ids
        served = await client.completions.create(
            model="tiny",
            prompt=prompt,
            max_tokens=PARITY_NEW_TOKENS,
            temperature=0,
            extra_body={"prompt_logprobs": 0, "return_token_ids": True},
        )
        choice = served.choices[0]
        extra = choice.model_extra or {}
        served_prompt_logprobs = extra["prompt_logprobs"]
        assert served_prompt_logprobs[0] is None and len(served_prompt_logprobs) == len(ids)

        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0]
            expected = torch.log_softmax(logits.double(), dim=-1)
            greedy = model.generate(
                torch.tensor([ids]),
                max_new_tokens=PARITY_NEW_TOKENS,
                do_sample=False,
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            )
        for position in range(1, len(ids)):
            token = ids[position]
            entry = served_prompt_logprobs[position][str(token)]  # keyed by the prompt's own token id
            gap = abs(entry["logprob"] - expected[position - 1, token].item())
            worst_logprob_gap = max(worst_logprob_gap, gap)

        reference_tokens = greedy[0, len(ids) :].tolist()
        served_tokens = list(extra["token_ids"])
        if served_tokens == reference_tokens[: len(served_tokens)] and len(served_tokens) == len(reference_tokens):
            same_completion += 1
    await client.close()
    print(
        f"worst prompt logprob gap {worst_logprob_gap:.2e}; {same_completion}/{len(PARITY_PROMPTS)} greedy completions identical"
    )
    assert worst_logprob_gap < 1e-3
    assert same_completion >= 9, f"{same_completion} of {len(PARITY_PROMPTS)} greedy completions matched"


def test_a_replica_keeps_an_idle_connection_open_past_vllms_own_5_s(deployment: RunningDeployment) -> None:
    """The router keeps idle connections to replicas for a while (a burst after a quiet spell
    then connects nothing); the replica must keep them longer, or the router would reuse
    connections the replica is closing. vLLM's own default closes them after 5 s."""
    assert REPLICA_KEEPALIVE_S > Timeouts().keepalive_s
    host, port = deployment.ready_urls()[0].removeprefix("http://").rsplit(":", 1)
    request = f"GET /health HTTP/1.1\r\nHost: {host}\r\n\r\n".encode()
    with socket.create_connection((host, int(port)), timeout=10) as connection:
        connection.sendall(request)
        assert connection.recv(4096).startswith(b"HTTP/1.1 200")
        time.sleep(7)
        connection.sendall(request)
        assert connection.recv(4096).startswith(b"HTTP/1.1 200"), "the replica closed the idle connection"


def test_the_router_runs_as_a_batch_task(deployment: RunningDeployment) -> None:
    """serving.app.relay_scheduling: the router does not preempt the task running on its core
    at every request and token event it is woken for."""
    assert os.sched_getscheduler(deployment.router_pid) == os.SCHED_BATCH


async def test_errors_reach_the_openai_client_as_its_usual_exceptions(deployment: RunningDeployment) -> None:
    client = openai.AsyncOpenAI(base_url=f"{deployment.router_url}/v1", api_key="unused", max_retries=0, timeout=60)
    with pytest.raises(openai.NotFoundError) as missing:
        await client.completions.create(model="nope", prompt="hi", max_tokens=2)
    assert missing.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as hot:
        await client.completions.create(model="tiny", prompt="hi", max_tokens=2, temperature=3)
    assert hot.value.param == "temperature"
    with pytest.raises(openai.BadRequestError) as long:
        await client.completions.create(model="tiny", prompt="the cat sees the moon " * 300, max_tokens=2)
    assert long.value.code == "context_length_exceeded"
    # A parameter only vLLM checks: its error comes back in OpenAI's shape.
    with pytest.raises(openai.BadRequestError) as upstream:
        await client.completions.create(model="tiny", prompt="hi", max_tokens=2, extra_body={"top_k": -5})
    assert upstream.value.body is not None and upstream.value.status_code == 400
    await client.close()


async def test_metrics_of_a_real_replica_show_load_tokens_and_ttft(deployment: RunningDeployment) -> None:
    url = deployment.ready_urls()[0]
    async with httpx.AsyncClient(timeout=120) as client:
        before = await scrape(client, url)
        await asyncio.gather(*(stream_completion(client, url, max_tokens=16) for _ in range(4)))
        after = await scrape(client, url)
        raw = parse_prometheus((await client.get(f"{url}/metrics")).text)
    # 64 from these requests, plus the supervisor's one-token liveness probes meanwhile.
    assert 64 <= after.generation_tokens_total - before.generation_tokens_total <= 70
    assert after.prompt_tokens_total > before.prompt_tokens_total
    assert rates_between(before, after)["generation_tokens_per_s"] > 0
    assert after.requests_running == 0 and after.requests_waiting == 0
    assert 0 <= after.kv_cache_usage <= 1
    assert after.ttft_p50_s is not None and after.ttft_p50_s > 0
    assert after.ttft_count >= 4
    assert histogram_quantile(raw, "vllm:time_to_first_token_seconds", 0.5) == after.ttft_p50_s


async def test_requests_sharing_a_prompt_prefix_reach_one_replica_whose_prefix_cache_serves_them(
    deployment: RunningDeployment,
) -> None:
    # A shared system prompt longer than the router's prefix, then each user's own question.
    system = "You answer for the bakery on the corner of the river street, open from six to two. " * 8

    def hits(samples: dict) -> float:
        return sum(v for (name, _), v in samples.items() if name == "vllm:prefix_cache_hits_total")

    async with httpx.AsyncClient(timeout=120) as client:
        before = {url: hits(parse_prometheus((await client.get(f"{url}/metrics")).text)) for url in deployment.ready_urls()}
        one_by_one = [
            await stream_completion(client, deployment.router_url, prompt=f"{system}Question {i}?", max_tokens=4)
            for i in range(6)
        ]
        (home,) = {r["replica"] for r in one_by_one}  # by prefix, the default: one replica
        after = {url: hits(parse_prometheus((await client.get(f"{url}/metrics")).text)) for url in deployment.ready_urls()}
        # vLLM's own counter: the home replica's cache served the shared blocks of the later five.
        assert after[home] - before[home] >= 5 * 128, (before, after)
        # The hit rate the sync reads off the same counters for the page: blocks of the home
        # replica's prompts came from its cache.
        home_rate = (await scrape(client, home)).prefix_cache_hit_rate
        assert home_rate is not None and 0 < home_rate < 1
        # Sent together, they spill to the other replica once the home one is loaded past the bound.
        together = await asyncio.gather(*(
            stream_completion(client, deployment.router_url, prompt=f"{system}Another question {i}?", max_tokens=64)
            for i in range(8)
        ))  # fmt: skip
    assert {r["replica"] for r in together} == set(deployment.ready_urls())
    assert sum(r["replica"] == home for r in together) >= 4
    assert all(r["status"] == 200 and r["error"] is None for r in one_by_one + together)


async def test_the_poll_loop_reports_each_replica_with_tokens_per_second(deployment: RunningDeployment) -> None:
    urls = deployment.ready_urls()
    samples: list[tuple[str, dict]] = []
    stop = asyncio.Event()
    async with httpx.AsyncClient(timeout=120) as client:
        poller = asyncio.create_task(
            poll(client, lambda: urls, lambda url, values: samples.append((url, values)), interval_s=0.3, stop=stop)
        )
        await asyncio.gather(*(stream_completion(client, deployment.router_url, max_tokens=64) for _ in range(4)))
        await asyncio.sleep(0.7)
        stop.set()
        await asyncio.wait_for(poller, 30)
    assert {url for url, _ in samples} == set(urls)
    rated = [values for _, values in samples if "generation_tokens_per_s" in values]
    assert rated and any(values["generation_tokens_per_s"] > 0 for values in rated)
    assert all(
        {"requests_running", "requests_waiting", "kv_cache_usage", "ttft_p50_s"} <= set(values) for _, values in samples
    )


async def test_killing_a_replica_under_load_fails_only_its_streams_and_it_comes_back(
    deployment: RunningDeployment,
) -> None:
    state = read_state(deployment.state_dir)
    assert state is not None
    victim = state.replicas[0]
    assert victim.pid and victim.url
    events_before = len(events_of(deployment))

    async with httpx.AsyncClient(timeout=httpx.Timeout(300, connect=10)) as client:
        live: list[dict] = [{} for _ in range(20)]
        streams = [asyncio.create_task(stream_completion(client, deployment.router_url, progress)) for progress in live]

        def victim_is_generating() -> bool:
            routed = all(p.get("replica") for p in live)
            return routed and any(p["replica"] == victim.url and p["chunks"] and not p["finish_reason"] for p in live)

        async with asyncio.timeout(240):
            while not victim_is_generating():
                failed = [
                    p
                    for p, task in zip(live, streams, strict=True)
                    if task.done() and (p.get("status") != 200 or p["error"])
                ]
                assert not failed, f"streams failed before the kill: {failed}"
                await asyncio.sleep(0.01)
        # The client reads behind the replicas: a stream it has not finished may already be whole
        # in the socket buffers (the first-routed ones run ahead while the last are still routed).
        chunks_at_kill = [(p["replica"] == victim.url, p["chunks"]) for p in live]
        os.killpg(victim.pid, signal.SIGKILL)
        results = await asyncio.wait_for(asyncio.gather(*streams), 300)

        on_victim = [r for r in results if r["replica"] == victim.url]
        on_survivor = [r for r in results if r["replica"] != victim.url]
        assert on_victim and on_survivor, chunks_at_kill
        for result in on_survivor:  # in flight on the survivor: finished in full
            assert result["status"] == 200 and result["error"] is None
            assert result["finish_reason"] == "length" and result["tokens"] == STREAM_TOKENS
        # On the victim, a stream is whole (its replica had sent it all before it died) or cut by
        # an OpenAI error event: never cut short silently, never left hanging.
        cut = [r for r in on_victim if r["error"] is not None]
        whole = [r for r in on_victim if r["error"] is None]
        assert cut, ("no stream was cut by the kill", chunks_at_kill)
        assert all(r["error"]["type"] == "server_error" for r in cut), cut
        assert all(r["finish_reason"] == "length" and r["tokens"] == STREAM_TOKENS for r in whole), [
            {k: r[k] for k in ("finish_reason", "tokens", "chunks")} for r in whole
        ]

        # New requests succeed at once, while the killed replica restarts.
        after = await asyncio.wait_for(
            asyncio.gather(*(stream_completion(client, deployment.router_url, max_tokens=8) for _ in range(10))), 240
        )
        assert all(r["status"] == 200 and r["error"] is None and r["finish_reason"] == "length" for r in after)

        def victim_back() -> bool:
            kinds = [(e.kind, e.replica, e.restarts) for e in events_of(deployment)[events_before:]]
            return ("replica_ready", 0, 1) in kinds

        await asyncio.to_thread(wait_until, victim_back, 240, "the killed replica to restart")
        new_events = events_of(deployment)[events_before:]
        died = next(e for e in new_events if e.kind == "replica_died" and e.replica == 0)
        assert died.exit_code == -signal.SIGKILL
        assert any(e.kind == "replica_restarting" and e.replica == 0 and e.delay_s for e in new_events)
        restarted = read_state(deployment.state_dir)
        assert restarted is not None and restarted.replicas[0].phase == "ready" and restarted.replicas[0].restarts == 1
        assert restarted.replicas[0].pid != victim.pid

        # It rejoins: concurrent requests spread over both replicas again.
        rejoined = await asyncio.wait_for(
            asyncio.gather(*(stream_completion(client, deployment.router_url, max_tokens=32) for _ in range(8))), 240
        )
        assert len({r["replica"] for r in rejoined}) == 2
        assert not process_alive(victim.pid)


async def test_a_lower_count_drains_and_stops_the_last_replica_and_a_higher_one_starts_it_again_leaving_the_other_be(
    deployment: RunningDeployment,
) -> None:
    """What an autoscaler's decision does to a running supervisor (`request_change`, SIGHUP)."""
    state = read_state(deployment.state_dir)
    assert state is not None and [r.phase for r in state.replicas] == ["ready", "ready"]
    kept, last = state.replicas
    events_before = len(events_of(deployment))
    async with httpx.AsyncClient(timeout=httpx.Timeout(300, connect=10)) as client:
        # A stream on the replica to be removed, straight to it: the removal waits it out.
        live: dict = {}
        in_flight = asyncio.create_task(stream_completion(client, last.url, live, max_tokens=300))
        async with asyncio.timeout(120):
            while not live.get("chunks"):
                assert not in_flight.done(), f"the stream ended before its first token: {in_flight.result()}"
                await asyncio.sleep(0.01)
        assert request_change(deployment.state_dir, replicas=1)
        result = await asyncio.wait_for(in_flight, 240)
        assert result["error"] is None and result["finish_reason"] == "length" and result["tokens"] == 300

        def one_left() -> bool:
            now = read_state(deployment.state_dir)
            return now is not None and [(r.index, r.phase) for r in now.replicas] == [(0, "ready")]

        await asyncio.to_thread(wait_until, one_left, 120, "the last replica to be stopped")
        assert not process_alive(last.pid)
        scaled_down = [(e.kind, e.replica) for e in events_of(deployment)[events_before:]]
        assert scaled_down == [("replica_stopped", 1)], scaled_down
        answered = await stream_completion(client, deployment.router_url, max_tokens=8)
        assert answered["status"] == 200 and answered["replica"] == kept.url

        assert request_change(deployment.state_dir, replicas=2)

        def two_ready() -> bool:
            now = read_state(deployment.state_dir)
            return now is not None and [(r.index, r.phase) for r in now.replicas] == [(0, "ready"), (1, "ready")]

        await asyncio.to_thread(wait_until, two_ready, 240, "the replica added to be ready")
        again = read_state(deployment.state_dir)
        assert again is not None
        assert (again.replicas[0].pid, again.replicas[0].restarts) == (kept.pid, kept.restarts)
        assert again.replicas[1].pid != last.pid and process_alive(again.replicas[1].pid)
        spread = await asyncio.wait_for(
            asyncio.gather(*(stream_completion(client, deployment.router_url, max_tokens=32) for _ in range(8))), 240
        )
        assert all(r["status"] == 200 and r["error"] is None for r in spread)
        assert len({r["replica"] for r in spread}) == 2


async def test_stopping_drains_in_flight_requests_then_stops_every_replica(deployment: RunningDeployment) -> None:
    state = read_state(deployment.state_dir)
    assert state is not None
    events_before = len(events_of(deployment))
    replica_pids = [r.pid for r in state.replicas if r.pid]
    async with httpx.AsyncClient(timeout=httpx.Timeout(300, connect=10)) as client:
        live: dict = {}
        in_flight = asyncio.create_task(stream_completion(client, deployment.router_url, live))
        async with asyncio.timeout(120):
            while not live.get("chunks"):
                assert not in_flight.done(), f"the stream ended before its first token: {in_flight.result()}"
                await asyncio.sleep(0.01)
        assert request_stop(deployment.state_dir)
        result = await asyncio.wait_for(in_flight, 240)
    assert result["error"] is None and result["finish_reason"] == "length" and result["tokens"] == STREAM_TOKENS
    await asyncio.to_thread(
        wait_until, lambda: not process_alive(deployment.supervisor_pid), 120, "the supervisor to exit"
    )
    assert not any(process_alive(pid) for pid in replica_pids)
    final = read_state(deployment.state_dir)
    assert final is not None and {r.phase for r in final.replicas} == {"stopped"}
    stopped = [e.replica for e in events_of(deployment)[events_before:] if e.kind == "replica_stopped"]
    assert sorted(stopped) == [0, 1]
