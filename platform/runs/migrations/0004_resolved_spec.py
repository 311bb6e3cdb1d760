from django.conf import settings
from django.db import migrations, models

from training.run_dir import RunDir


def resolve_data_paths(apps, schema_editor):
    """Runs stored before specs were resolved at submit hold no data paths (the launcher filled
    them in at each launch); a resume now writes the stored spec as it is, so they get them here,
    from the objects they name, as `runs.services.resolve_data` does for new runs."""
    Run = apps.get_model("runs", "Run")
    for run in Run.objects.select_related("dataset", "tokenizer_run").iterator():
        source = run.tokenizer_run
        # Historical models have no properties: the folder is named as Run.folder names it.
        tokenizer = (
            str(RunDir(settings.RUNS_DIR / f"{source.pk}-{source.created_at:%Y%m%d-%H%M%S-%f}").tokenizer_dir)
            if source is not None
            else ""
        )
        data = {"dataset": run.dataset.path if run.dataset is not None else "", "tokenizer": tokenizer}
        if run.spec.get("data") != data:
            run.spec["data"] = data
            run.save(update_fields=["spec"])


class Migration(migrations.Migration):
    dependencies = [
        ("runs", "0003_checkpoint_pruned_and_node_reports"),
    ]

    operations = [
        migrations.AlterField(
            model_name="run",
            name="spec",
            field=models.JSONField(
                help_text="The run's training.config.RunSpec as plain data, checked and resolved at submit "
                "(data paths filled in from its dataset and tokenizer run)."
            ),
        ),
        migrations.RunPython(resolve_data_paths, migrations.RunPython.noop),
    ]
