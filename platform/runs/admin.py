from django.contrib import admin

from runs.models import Checkpoint, Dataset, PretrainedModel, Project, ProjectMember, Run, RunEvent


@admin.register(Dataset)
class DatasetAdmin(admin.ModelAdmin):
    list_display = ["name", "owner", "format", "records", "size_bytes", "created_at"]


@admin.register(PretrainedModel)
class PretrainedModelAdmin(admin.ModelAdmin):
    list_display = ["name", "owner", "path", "size_bytes", "created_at"]


@admin.register(Run)
class RunAdmin(admin.ModelAdmin):
    list_display = ["name", "owner", "status", "step", "restarts", "recipe", "project", "created_at"]
    list_filter = ["status", "recipe"]


@admin.register(RunEvent)
class RunEventAdmin(admin.ModelAdmin):
    list_display = ["run", "seq", "source", "kind", "time"]
    list_filter = ["kind"]


@admin.register(Checkpoint)
class CheckpointAdmin(admin.ModelAdmin):
    list_display = ["run", "step", "path", "export_path"]


class ProjectMemberInline(admin.TabularInline):
    model = ProjectMember
    extra = 0


@admin.register(Project)
class ProjectAdmin(admin.ModelAdmin):
    list_display = ["name", "owner", "created_at"]
    inlines = [ProjectMemberInline]
