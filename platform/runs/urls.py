from django.urls import include, path
from rest_framework.routers import DefaultRouter

from runs.downloads import CheckpointExportDownload, RunLogsDownload
from runs.plan import PlanView
from runs.views import (
    CheckpointViewSet,
    DatasetViewSet,
    PretrainedModelViewSet,
    ProjectViewSet,
    RunEventsView,
    RunGoodputView,
    RunViewSet,
    ShippedLogsView,
)

router = DefaultRouter(trailing_slash=True)
router.register("datasets", DatasetViewSet, basename="dataset")
router.register("pretrained-models", PretrainedModelViewSet, basename="pretrained-model")
router.register("runs", RunViewSet, basename="run")
router.register("checkpoints", CheckpointViewSet, basename="checkpoint")
router.register("projects", ProjectViewSet, basename="project")

urlpatterns = [
    path("runs/<int:run_id>/events/", RunEventsView.as_view(), name="run-events"),
    path("runs/<int:run_id>/goodput/", RunGoodputView.as_view(), name="run-goodput"),
    path("runs/<int:run_id>/shipped-logs/", ShippedLogsView.as_view(), name="run-shipped-logs"),
    path("runs/<int:run_id>/logs.tar", RunLogsDownload.as_view(), name="run-logs-tar"),
    path(
        "runs/<int:run_id>/checkpoints/<int:checkpoint_id>/export.tar",
        CheckpointExportDownload.as_view(),
        name="checkpoint-export-tar",
    ),
    path("plan/", PlanView.as_view(), name="plan"),
    path("", include(router.urls)),
]
