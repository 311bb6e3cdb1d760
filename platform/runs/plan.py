"""`GET /api/plan`: the parallelism planner's ranked layouts for a model on a cluster."""

from __future__ import annotations

from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from training.planner.search import plan_query


class PlanView(APIView):
    @extend_schema(
        parameters=[
            OpenApiParameter("model", str, description="8b, 70b, 405b, … (planner presets)"),
            OpenApiParameter("nodes", int),
            OpenApiParameter("gpus_per_node", int),
            OpenApiParameter("gpu", str, description="h100, h200, a100, cpu"),
            OpenApiParameter("global_batch", int, required=True),
            OpenApiParameter("seq_len", int),
            OpenApiParameter("precision", str, description="bf16 or fp32"),
            OpenApiParameter("trainer", str, description="fathom (as the trainer is) or fixed"),
            OpenApiParameter("top", int),
        ],
        responses=dict,
    )
    def get(self, request: Request) -> Response:
        # A query the planner refuses raises SpecError: a 400 naming the parameter
        # (controlplane.exceptions).
        return Response(plan_query(request.query_params))
