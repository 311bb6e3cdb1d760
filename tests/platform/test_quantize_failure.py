"""A model the quantizer cannot take fails the quantize task with the quantizer's reason, and the
deployment that waited for it fails with that reason too.

The model (hidden size 48) is trained for real; on a CUDA control plane the deploy checks let an
int4 deploy of it through (vLLM's multiple-of-32 rule is its CPU kernel's), and the real Celery
worker runs `serving.quantize` in the llmcompressor env, which refuses it: int4 groups of
128/64/32 inputs must divide every linear layer's input size.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from deployments import services as deployment_services
from deployments.models import Deployment
from runs.models import Checkpoint, QuantizedExport, Run
from tools.check_parity import launch, parity_spec
from training.config import RunSpec
from training.run_dir import RunDir

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def odd_shaped(tmp_path_factory: pytest.TempPathFactory) -> tuple[RunSpec, Path]:
    """A 2-step run of a model whose linear layers take 48 inputs, on a dataset file of its own."""
    work = tmp_path_factory.mktemp("odd-shaped")
    data = work / "sentences.txt"
    data.write_text("\n\n".join(f"the cat sees {n} apples and {n + 1} pears." for n in range(300)))
    base = parity_spec(2).to_dict()
    spec = RunSpec.from_dict({
        **base,
        "model": {"n_layers": 2, "dim": 48, "n_heads": 2, "n_kv_heads": 2, "vocab_size": 512, "seq_len": 64},
        "data": {**base["data"], "dataset": str(data)},
    })  # fmt: skip
    launch(spec, work / "run", timeout=600)
    return spec, work / "run"


def wait_while_pending(deployment: Deployment) -> None:
    deadline = time.monotonic() + 600
    while Deployment.objects.get(pk=deployment.pk).status == Deployment.Status.PENDING:
        assert time.monotonic() < deadline, "the quantize task did not end within 600 s"
        time.sleep(1)


@pytest.mark.django_db(transaction=True)
def test_a_model_the_quantizer_cannot_take_fails_the_task_and_its_deployment_with_the_reason(
    alice, odd_shaped, celery_worker, settings
):
    spec, run_dir = odd_shaped
    run = Run.objects.create(owner=alice, name="odd", spec=spec.to_dict(), status=Run.Status.SUCCEEDED)
    found = RunDir(run_dir).latest_checkpoint()
    assert found is not None
    checkpoint = Checkpoint.objects.create(run=run, step=2, path=str(found))
    settings.SERVING_DEVICE = "cuda"  # this process's checks only; the worker quantizes on its CPU
    deployment = deployment_services.do_create_deployment(
        alice, checkpoint, name="", served_model_name="odd-int4", replicas=1, options={}, quantization="int4"
    )
    wait_while_pending(deployment)

    row = QuantizedExport.objects.get(checkpoint=checkpoint, scheme="int4")
    assert row.status == QuantizedExport.Status.FAILED and row.path == ""
    assert "int4 needs every linear layer's input size to be a multiple of 32" in row.reason
    assert "[48, 128]" in row.reason  # the model's own sizes: attention and MLP inputs
    deployment.refresh_from_db()
    assert deployment.status == Deployment.Status.FAILED
    assert deployment.status_reason == f"its int4 export could not be made: {row.reason}"
    events = [(e.kind, e.data) for e in run.events.order_by("seq")]
    assert [(kind, data.get("stage")) for kind, data in events if kind.startswith("quantiz")] == [
        ("quantizing", "loading"), ("quantize_failed", None),
    ]  # fmt: skip
    assert next(data for kind, data in events if kind == "quantize_failed")["reason"] == row.reason
    assert [e.kind for e in deployment.events.order_by("seq")] == ["created", "waiting_for_quantization", "failed"]

    # A later deploy asks again: the failed row is queued once more (a failure may have been the
    # machine's), and fails the same way.
    again = deployment_services.do_create_deployment(
        alice, checkpoint, name="", served_model_name="odd-int4-again", replicas=1, options={}, quantization="int4"
    )
    assert QuantizedExport.objects.get(pk=row.pk).status in (QuantizedExport.Status.PENDING, QuantizedExport.Status.RUNNING)
    wait_while_pending(again)
    assert Deployment.objects.get(pk=again.pk).status_reason == f"its int4 export could not be made: {row.reason}"
    assert QuantizedExport.objects.count() == 1
    assert [e.kind for e in run.events.order_by("seq")].count("quantize_failed") == 2
