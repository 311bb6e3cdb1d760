from django.contrib import admin

from deployments.models import ApiKey, Deployment, Replica


@admin.register(Deployment)
class DeploymentAdmin(admin.ModelAdmin):
    list_display = ["served_model_name", "owner", "status", "replicas", "created_at"]


@admin.register(Replica)
class ReplicaAdmin(admin.ModelAdmin):
    list_display = ["deployment", "index", "url", "status", "restarts"]


@admin.register(ApiKey)
class ApiKeyAdmin(admin.ModelAdmin):
    list_display = ["deployment", "name", "lookup", "created_at", "last_used_at", "requests", "revoked"]
    readonly_fields = ["key_hash", "requests", "prompt_tokens", "completion_tokens", "last_used_at"]
