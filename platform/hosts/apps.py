from django.apps import AppConfig


class HostsConfig(AppConfig):
    name = "hosts"
