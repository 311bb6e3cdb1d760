from django.apps import AppConfig


class LaunchConfig(AppConfig):
    name = "launch"

    def ready(self) -> None:
        # Settings only read FATHOM_SLURM_*: a default that launch's rules refuse stops every
        # process kind as it starts, naming the variable, not the first run submitted to Slurm.
        from launch.slurm_options import install_defaults

        install_defaults()
