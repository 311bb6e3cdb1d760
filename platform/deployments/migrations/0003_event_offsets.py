from pathlib import Path

from django.conf import settings
from django.db import migrations, models


def offsets_from_files(apps, schema_editor):
    """Deployments that were syncing keep their place: the offsets move from the `events.offset`
    files, which the sync kept before, into the row."""
    Deployment = apps.get_model("deployments", "Deployment")
    for deployment in Deployment.objects.all():
        folder = Path(settings.DEPLOYMENTS_DIR) / f"{deployment.pk}-{deployment.created_at:%Y%m%d-%H%M%S-%f}"
        offsets = {}
        for offset_file in [folder / "events.offset", *folder.glob("hosts/*/events.offset")]:
            try:
                offsets[str(offset_file.parent.relative_to(folder))] = int(offset_file.read_text())
            except (OSError, ValueError):
                continue
        if offsets:
            Deployment.objects.filter(pk=deployment.pk).update(event_offsets=offsets)


class Migration(migrations.Migration):
    dependencies = [
        ("deployments", "0002_key_usage_and_rate_limit"),
    ]

    operations = [
        migrations.AddField(
            model_name="deployment",
            name="event_offsets",
            field=models.JSONField(blank=True, default=dict),
        ),
        migrations.RunPython(offsets_from_files, migrations.RunPython.noop),
    ]
