import django.db.models.deletion
from django.db import migrations, models


def forget_server_paths(apps, schema_editor):
    """Specs stored before runs named their data through objects may hold raw server paths.

    The launcher fills `data.dataset` from the run's Dataset, and a run that was given a tokenizer
    keeps its own copy in its folder, so clearing both loses nothing and no resume reads a path
    a user typed.
    """
    Run = apps.get_model("runs", "Run")
    for run in Run.objects.exclude(spec__data__dataset="", spec__data__tokenizer="").iterator():
        data = run.spec.get("data")
        if isinstance(data, dict) and (data.get("dataset") or data.get("tokenizer")):
            run.spec["data"] = {**data, "dataset": "", "tokenizer": ""}
            run.save(update_fields=["spec"])


class Migration(migrations.Migration):
    dependencies = [
        ("runs", "0001_initial"),
    ]

    operations = [
        migrations.AddField(
            model_name="run",
            name="tokenizer_run",
            field=models.ForeignKey(
                blank=True,
                help_text="An earlier run of the same owner whose tokenizer this run reuses; empty: trained on the dataset.",
                null=True,
                on_delete=django.db.models.deletion.PROTECT,
                related_name="tokenizer_reusers",
                to="runs.run",
            ),
        ),
        migrations.RunPython(forget_server_paths, migrations.RunPython.noop),
    ]
