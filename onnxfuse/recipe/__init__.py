"""What a run is made of (the layer above the exporters): every setting declared once (``settings.py``), config
files and the one validation of settings (``config.py``), ``TrainConfig`` and the ``RunSettings`` a run reads
(``train_config.py``), data and named datasets, losses, optimizers (``optim.py``), schedules, and the runtimes a
run may choose (``runtimes.py``).

Importing the layer fills the settings' registries: ``optim.py`` and ``schedules.py`` register their optimizers
and schedules into ``settings.OPTIMIZERS`` / ``settings.SCHEDULES``.
"""
from onnxfuse.recipe import optim, schedules  # noqa: F401  (registrations)
