"""The bundled trainer: the only part of workbench that builds process groups (imports torch).

Reading order: ``transformer.py`` (the network), ``data.py`` (batches), ``mesh.py`` (the DeviceMesh
from the plan), ``parallelize.py`` (CP, EP, TP, activation checkpointing, FSDP/DDP), ``pipeline.py``
(stages and schedules), ``train.py`` (the loop), ``checkpoint.py`` (DCP save and load; ``safe_load.py``
reads checkpoints without running code from them), ``lifeline.py`` (a rank ends with its torchrun).
Measurement: ``instrument.py`` composes ``comm_meter.py`` (collectives), ``memory_meter.py``
(model states, bytes saved for backward), ``pipeline_timer.py`` (stage actions) and ``guards.py``.
``faults.py`` is the recovery drill's fault injection. Run it with
``torchrun ... -m workbench.trainer config.json``.
"""
