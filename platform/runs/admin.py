from django.contrib import admin

from runs.models import Checkpoint, Dataset, PretrainedModel, Run, RunEvent


@admin.register(Dataset)
class DatasetAdmin(admin.ModelAdmin):
    list_display = ["name", "owner", "format", "records", "size_bytes", "created_at"]


@admin.register(PretrainedModel)
class PretrainedModelAdmin(admin.ModelAdmin):
    list_display = ["name", "owner", "path", "size_bytes", "created_at"]


@admin.register(Run)
class RunAdmin(admin.ModelAdmin):
    list_display = ["name", "owner", "status", "step", "restarts", "created_at"]
    list_filter = ["status"]


@admin.register(RunEvent)
class RunEventAdmin(admin.ModelAdmin):
    list_display = ["run", "seq", "source", "kind", "time"]
    list_filter = ["kind"]


@admin.register(Checkpoint)
class CheckpointAdmin(admin.ModelAdmin):
    list_display = ["run", "step", "path", "export_path"]
