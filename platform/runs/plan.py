"""`GET /api/plan`: the parallelism planner's ranked layouts for a model on a cluster."""

from __future__ import annotations

from typing import Any

from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from training.planner.hardware import DEVICES
from training.planner.layout_costs import IMPLEMENTATIONS
from training.planner.model_shapes import MODEL_NAMES
from training.planner.search import PRECISIONS, QUERY_MAXIMUMS, plan_query


def count(name: str, description: str, *, required: bool = False) -> OpenApiParameter:
    """An integer query parameter with the bounds `plan_query` holds it to."""
    schema: dict[str, Any] = {"type": "integer", "minimum": 1}
    if (high := QUERY_MAXIMUMS[name]) is not None:
        schema["maximum"] = high
    return OpenApiParameter(name, schema, required=required, description=description)


class PlanView(APIView):
    @extend_schema(
        parameters=[
            OpenApiParameter("model", str, enum=list(MODEL_NAMES), description="A planner preset (default 8b)."),
            count("nodes", "Nodes in the cluster (default 1)."),
            count("gpus_per_node", "Devices per node (default 8)."),
            OpenApiParameter("gpu", str, enum=list(DEVICES), description="The device (default h100)."),
            count("global_batch", "Sequences per optimizer step.", required=True),
            count("seq_len", "Tokens per sequence (default: the model preset's)."),
            OpenApiParameter("precision", str, enum=list(PRECISIONS), description="Default bf16 (fp32 on cpu)."),
            OpenApiParameter(
                "trainer",
                str,
                enum=list(IMPLEMENTATIONS),
                description="fathom: the trainer as it is; before-fixes: as it was before its memory fixes (default fathom).",
            ),
            count("top", "How many ranked layouts to answer with (default 10)."),
        ],
        responses=dict,
    )
    def get(self, request: Request) -> Response:
        # A query the planner refuses raises SpecError: a 400 naming the parameter
        # (controlplane.exceptions).
        return Response(plan_query(request.query_params))
