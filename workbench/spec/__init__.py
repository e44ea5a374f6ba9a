"""What to train, where, split how, trained how: the plain objects that describe a job.

Reading order: :mod:`.errors` (one exception, checks that spell out the rule), :mod:`.model`
(ModelSpec; :mod:`.hf` reads a Hugging Face ``config.json``), :mod:`.cluster`, :mod:`.schedules`
(pipeline schedule names and torch's rules for them), :mod:`.plan` (degrees, rank <-> mesh
coordinates, composite dimensions, placement), :mod:`.config` (TrainSettings, RunConfig, the checks
that need more than one object, and the one builder from loose values), :mod:`.trainable` (what the
bundled trainer refuses). No torch and no UI here.
"""
