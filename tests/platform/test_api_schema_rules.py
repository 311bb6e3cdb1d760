"""The OpenAPI schema states the rules the server holds requests to (issue 31): the planner's
choices and bounds, the tag and status patterns, what a deployment's options and a dataset's JSON
body are. Each rule is read off /api/schema/ and checked against what the API answers, so neither
can change without the other."""

from __future__ import annotations

from typing import Any

import jsonschema_rs  # schemathesis' validator: a schema's regex is ECMA's, not Python's re
import pytest

from runs import organise
from runs.models import Checkpoint, Run
from training.planner.hardware import DEVICES
from training.planner.layout_costs import IMPLEMENTATIONS
from training.planner.model_shapes import MODEL_NAMES
from training.planner.search import PRECISIONS, QUERY_MAXIMUMS

pytestmark = pytest.mark.django_db


@pytest.fixture
def schema(client) -> dict[str, Any]:
    response = client.get("/api/schema/?format=json")
    assert response.status_code == 200
    return response.json()


def query_parameters(schema: dict[str, Any], path: str) -> dict[str, dict[str, Any]]:
    return {p["name"]: p for p in schema["paths"][path]["get"]["parameters"]}


def matches(item_schema: dict[str, Any], value: str) -> bool:
    return bool(jsonschema_rs.validator_for(item_schema).is_valid(value))


def component(schema: dict[str, Any], ref: dict[str, str]) -> dict[str, Any]:
    return schema["components"]["schemas"][ref["$ref"].rsplit("/", 1)[1]]


def test_the_plan_parameters_are_the_planners_choices_and_bounds(schema, alice_api):
    params = query_parameters(schema, "/api/plan/")
    for name, choices in (
        ("model", MODEL_NAMES),
        ("gpu", DEVICES),
        ("precision", PRECISIONS),
        ("trainer", IMPLEMENTATIONS),
    ):
        assert set(params[name]["schema"]["enum"]) == set(choices), name
    for name, high in QUERY_MAXIMUMS.items():
        bounds = params[name]["schema"]
        assert bounds["type"] == "integer" and bounds["minimum"] == 1 and bounds.get("maximum") == high, name
    assert params["global_batch"]["required"] is True

    # The edges, as the planner answers them: the bound itself is a plan, one past it or an
    # empty value a 400 naming the parameter.
    assert (
        alice_api.get("/api/plan/?model=tiny&gpu=cpu&nodes=1&gpus_per_node=64&global_batch=64&top=1").status_code == 200
    )
    for query, field in (
        ("global_batch=8&nodes=1025", "nodes"),
        ("global_batch=8&gpus_per_node=65", "gpus_per_node"),
        (f"global_batch={(1 << 20) + 1}", "global_batch"),
        ("global_batch=8&seq_len=0", "seq_len"),
        ("global_batch=8&gpu=", "gpu"),
        ("global_batch=", "global_batch"),
        ("global_batch=+8", "global_batch"),
        ("global_batch=8&trainer=fixed", "trainer"),
    ):
        response = alice_api.get(f"/api/plan/?{query}")
        assert response.status_code == 400 and list(response.json()) == [field], (query, response.content)


SAMPLES = ["baseline", "lr-sweep", "v2.1:a_b", "x" * 32, "x" * 33, "Baseline", "has space", " baseline", "baseline\n",
           "-lead", "", "a,b", "a, b ,", ",", "a,,B", "\x1cbaseline", "base\ufeffline"]  # fmt: skip


def test_the_tag_filter_and_the_tags_a_patch_takes_are_the_patterns_the_schema_states(schema, alice, alice_api):
    tag_filter = query_parameters(schema, "/api/runs/")["tag"]["schema"]["items"]
    organise_body = component(
        schema, schema["paths"]["/api/runs/{id}/"]["patch"]["requestBody"]["content"]["application/json"]["schema"]
    )
    item = organise_body["properties"]["tags"]["items"]
    assert item["pattern"] == f"^{organise.TAG_PATTERN.pattern}$" and item["maxLength"] == organise.MAX_TAG_LENGTH
    assert organise.TAG_PATTERN.pattern in tag_filter["pattern"]

    run = Run.objects.create(owner=alice, name="r", spec={}, status="succeeded")
    for value in SAMPLES:
        listed = alice_api.get("/api/runs/", {"tag": value})
        assert listed.status_code == (200 if matches(tag_filter, value) else 400), repr(value)
        tagged = alice_api.patch(f"/api/runs/{run.pk}/", {"tags": [value]}, format="json")
        valid = matches(item, value)
        assert tagged.status_code == (200 if valid else 400), (repr(value), tagged.content)
        if not valid:
            assert list(tagged.json()) == ["tags"]


def test_the_status_filter_is_the_pattern_the_schema_states(schema, alice_api):
    status = query_parameters(schema, "/api/runs/")["status"]["schema"]
    for value in [
        "running",
        "queued,failed",
        " succeeded , ",
        "",
        "Running",
        "run",
        "running,nope",
        "done",
        "failed\n",
    ]:
        assert alice_api.get("/api/runs/", {"status": value}).status_code == (200 if matches(status, value) else 400), (
            repr(value)
        )


def test_deployment_options_are_an_object(schema, alice, alice_api):
    body = schema["paths"]["/api/deployments/"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert component(schema, body)["properties"]["options"]["type"] == "object"
    run = Run.objects.create(owner=alice, name="r", spec={}, status="succeeded")
    checkpoint = Checkpoint.objects.create(run=run, step=10, path=str(run.folder / "checkpoints" / "step_10"))
    for options, says in (([], "an array"), ("fp8", "a string"), (3, "a number"), (None, "null")):
        response = alice_api.post("/api/deployments/", {"checkpoint": checkpoint.pk, "options": options}, format="json")
        assert response.status_code == 400 and says in response.json()["options"][0], response.content


def test_an_upload_is_multipart_and_json_only_names_a_server_path(schema):
    for path, upload in (("/api/datasets/", "file"), ("/api/pretrained-models/", "files")):
        content = schema["paths"][path]["post"]["requestBody"]["content"]
        assert upload in component(schema, content["multipart/form-data"]["schema"])["properties"]
        as_json = component(schema, content["application/json"]["schema"])
        assert set(as_json["properties"]) == {"name", "path"} and as_json["required"] == ["path"], path
