"""The bundled trainer: the only part of workbench that builds process groups (imports torch).

Reading order: ``model.py`` (the network), ``data.py`` (batches), ``mesh.py`` (the DeviceMesh from
the plan), ``parallelize.py`` (TP, activation checkpointing, FSDP/DDP), ``pipeline.py`` (stages and
schedules), ``train.py`` (the loop). Run it with ``torchrun ... -m workbench.trainer config.json``.
"""
