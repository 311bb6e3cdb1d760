from django.contrib import admin

from notifications.models import Delivery, Webhook


@admin.register(Webhook)
class WebhookAdmin(admin.ModelAdmin):
    list_display = ["url", "owner", "events", "created_at"]
    exclude = ["secret"]


@admin.register(Delivery)
class DeliveryAdmin(admin.ModelAdmin):
    list_display = ["event", "webhook", "status", "attempts", "response_code", "created_at"]
    list_filter = ["status", "event"]
    readonly_fields = ["payload", "attempts", "response_code", "response_excerpt", "last_error"]
