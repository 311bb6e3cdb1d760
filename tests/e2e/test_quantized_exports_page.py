"""The run page's checkpoint row follows a quantized export as the quantize and quality tasks
record it (being made → its size beside the float export's → its top-1 agreement and
perplexity), and the deploy form offers none / int8 / int4 / fp8 with those figures. The rows and
events are written as those tasks write them (`tests/platform/test_quantized_deploy.py` runs the
tasks themselves); the web process, the database and the browser are real."""

from __future__ import annotations

import pytest
from django.utils import timezone
from playwright.sync_api import Page, expect

from runs import services
from runs.models import Checkpoint, QuantizedExport, Run
from tests.e2e.conftest import ConsoleWatch, log_in, off_loop
from tests.e2e.test_live_updates import create_run

pytestmark = pytest.mark.browser

MIB = 1024 * 1024


@pytest.mark.django_db(transaction=True)
def test_a_checkpoint_row_and_the_deploy_form_show_a_quantized_exports_size_and_quality(
    alice, live_web, browser_page: Page, console: ConsoleWatch
):
    page = browser_page
    run = create_run(alice, "quantized", {"train": {"steps": 20}}, status=Run.Status.SUCCEEDED)
    folder = off_loop(lambda: Run.objects.get(pk=run.pk).folder)
    export = folder / "exports" / "step_00000020"
    export.mkdir(parents=True)
    (export / "model.safetensors").write_bytes(bytes(4 * MIB))  # what the float export's size is read from
    checkpoint = off_loop(lambda: Checkpoint.objects.create(
        run=run, step=20, path=str(folder / "checkpoints" / "step_00000020"), export_path=str(export)
    ))  # fmt: skip
    quantized = off_loop(
        lambda: QuantizedExport.objects.create(checkpoint=checkpoint, scheme="int8", status=QuantizedExport.Status.RUNNING)
    )
    log_in(page, live_web.url, "alice", "alice-password-1")
    page.goto(f"{live_web.url}/runs/{run.pk}")

    line = page.locator('#checkpoint-rows tr[data-step="20"] .quantized[data-scheme="int8"]')
    expect(line).to_have_attribute("data-state", "running")
    expect(line).to_contain_text("being made")

    # The quantize task's end: the row, then its event, which the page reads the row again for.
    def quantized_done() -> None:
        QuantizedExport.objects.filter(pk=quantized.pk).update(
            status=QuantizedExport.Status.READY, path=str(export.with_name("step_00000020-int8")),
            size_bytes=int(1.2 * MIB), source_size_bytes=4 * MIB, samples=16, finished_at=timezone.now(),
        )  # fmt: skip
        services.do_record_event(run, "quantized", {
            "step": 20, "scheme": "int8", "quantized_export": quantized.pk, "bytes": int(1.2 * MIB),
            "source_bytes": 4 * MIB, "samples": 16, "seconds": 61.0,
        })  # fmt: skip

    off_loop(quantized_done)
    expect(line).to_have_attribute("data-state", "ready")
    expect(line).to_contain_text("1.2 MiB of 4.0 MiB · quality not measured yet")
    expect(page.locator('#timeline li[data-kind="quantized"]')).to_contain_text("Quantized to int8")

    def measured() -> None:
        QuantizedExport.objects.filter(pk=quantized.pk).update(
            top1=385 / 386, top1_positions=386, perplexity=3.2128, source_perplexity=3.2000
        )
        services.do_record_event(run, "quality_measured", {
            "step": 20, "scheme": "int8", "quantized_export": quantized.pk, "top1": 385 / 386, "positions": 386,
            "perplexity": 3.2128, "source_perplexity": 3.2,
        })  # fmt: skip

    off_loop(measured)
    expect(line).to_contain_text("top-1 agreement 99.7% (386 positions)")
    expect(line).to_contain_text("held-out perplexity 3.21 vs 3.2 float")
    expect(page.locator('#timeline li[data-kind="quality_measured"]')).to_contain_text("top-1 agreement 99.7%")

    page.locator('#checkpoint-rows tr[data-step="20"]').get_by_role("button", name="Deploy…").click()
    choices = page.locator("#deploy-quantization option")
    expect(choices).to_have_text([
        "none (float export) — 4.0 MiB",
        "int8 (W8A8) — 1.2 MiB, top-1 99.7%, perplexity ×1.004",
        "int4 (W4A16, bfloat16 on CPU) — made first (takes minutes)",
        "fp8 (vLLM at load; CUDA or AMX CPUs)",
    ])  # fmt: skip
    expect(page.get_by_label("Quantization")).to_have_value("none")
