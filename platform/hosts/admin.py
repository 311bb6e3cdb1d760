from typing import Any

from django.contrib import admin, messages
from django.db.models import QuerySet
from django.http import HttpRequest

from controlplane.exceptions import WrongState
from hosts import services
from hosts.models import DeviceClaim, Host, Quota


@admin.register(Host)
class HostAdmin(admin.ModelAdmin):
    list_display = ["name", "address", "status", "last_seen"]
    list_filter = ["status"]
    actions = ["drain", "undrain"]

    def _each(self, request: HttpRequest, hosts: QuerySet[Host], operation: Any, done: str) -> None:
        for host in hosts:
            try:
                operation(host)
                self.message_user(request, f"{host.name} {done}")
            except WrongState as exc:
                self.message_user(request, f"{host.name}: {exc.message}", messages.WARNING)

    @admin.action(description="Drain: keep what they run, place nothing new")
    def drain(self, request: HttpRequest, hosts: QuerySet[Host]) -> None:
        self._each(request, hosts, services.do_drain, "drains")

    @admin.action(description="Undrain: place runs on them again")
    def undrain(self, request: HttpRequest, hosts: QuerySet[Host]) -> None:
        self._each(request, hosts, services.do_undrain, "is ready")


@admin.register(DeviceClaim)
class DeviceClaimAdmin(admin.ModelAdmin):
    list_display = ["host", "device", "run", "node", "claimed_at"]


@admin.register(Quota)
class QuotaAdmin(admin.ModelAdmin):
    list_display = ["__str__", "gpus", "cpu_slots", "queued_runs", "priority_ceiling", "preemptible"]
