"""Creates the first login for a fresh install and prints it (`make run` calls this)."""

import secrets

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand
from rest_framework.authtoken.models import Token


class Command(BaseCommand):
    help = "Create the admin login once, and print its username, password and API token."

    def add_arguments(self, parser):  # type: ignore[no-untyped-def]
        parser.add_argument("--username", default="admin")

    def handle(self, *args, username: str, **options) -> None:  # type: ignore[no-untyped-def]
        # The password is kept (mode 600) beside the database so every `make run` can print it.
        secret_file = settings.DATA_DIR / "login.txt"
        User = get_user_model()
        user = User.objects.filter(username=username).first()
        if user is None or not secret_file.exists():
            password = secrets.token_urlsafe(12)
            if user is None:
                user = User.objects.create_superuser(username=username, password=password, email="")
            else:
                user.set_password(password)
                user.save()
            secret_file.write_text(password)
            secret_file.chmod(0o600)
        token, _ = Token.objects.get_or_create(user=user)
        self.stdout.write(f"login: {username}  password: {secret_file.read_text().strip()}  api token: {token.key}")
